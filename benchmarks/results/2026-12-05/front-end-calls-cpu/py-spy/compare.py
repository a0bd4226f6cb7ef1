# the py-spy profiles of record.py compared: samples per run, inclusive and self, apps off -> probe
import collections, gzip, pathlib, re, sys
HERE = pathlib.Path(__file__).resolve().parent
def load(path):
    incl = collections.Counter(); selfc = collections.Counter(); total = 0
    for line in gzip.open(path, 'rt'):
        line = line.rstrip()
        if not line: continue
        stack, n = line.rsplit(' ', 1); n = int(n)
        frames = stack.split(';')
        if 'MainThread' not in frames[0] and 'main' not in frames[0].lower():
            pass
        total += n
        seen = set()
        for f in frames:
            k = re.sub(r':\d+\)', ')', f)  # drop line numbers
            if k not in seen:
                incl[k] += n; seen.add(k)
        selfc[re.sub(r':\d+\)', ')', frames[-1])] += n
    return incl, selfc, total
runs = {c: [load(HERE / f'spy_{c}_{r}.txt.gz') for r in range(2)] for c in ['none', 'probe_one']}
for c, rs in runs.items(): print(c, [r[2] for r in rs], 'threads:', collections.Counter(l.split(';')[0] for l in gzip.open(HERE / f'spy_{c}_0.txt.gz', 'rt')).most_common(4))
def avg(c, idx):
    out = collections.Counter()
    for r in runs[c]:
        for k, v in r[idx].items(): out[k] += v / 2
    return out
for idx, label in ((0, 'inclusive'), (1, 'self')):
    a, b = avg('none', idx), avg('probe_one', idx)
    keys = sorted(set(a) | set(b), key=lambda k: -(b[k] - a[k]))
    print('==', label, '(samples per run, 4 ms each; none -> probe)')
    for k in keys[:25]: print('%+7.1f  %7.1f -> %7.1f  %s' % (b[k]-a[k], a[k], b[k], k[:150]))
