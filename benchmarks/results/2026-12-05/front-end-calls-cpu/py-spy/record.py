# py-spy raw profiles of one CPU server, apps off and a probe, 2 runs each (gzip the spy_*.txt it writes; compare.py reads the .gz)
import asyncio, os, sys, time, subprocess, collections
import pathlib
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[5]))  # the repository root
from benchmarks.xmix_bench.api_cpu import _start, _stop, _stream_all, model_and_deployment

model, dep = model_and_deployment(['probe_one'])
proc, url = _start(model, dep, str(HERE / 'spy_server.log'))
try:
    asyncio.run(_stream_all(url, model, None, 96, 64, 32))
    for rnd in range(2):
        for c in ['none', 'probe_one']:
            xargs = None if c == 'none' else {'xmix': [c]}
            out = str(HERE / f'spy_{c}_{rnd}.txt')
            spy = subprocess.Popen(['py-spy', 'record', '-p', str(proc.pid), '-r', '250', '-f', 'raw', '-o', out, '--nonblocking'],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            t = time.time()
            chunks, toks = asyncio.run(_stream_all(url, model, xargs, 192, 64, 32))
            print(c, rnd, 'tokens', toks, 'secs', round(time.time() - t, 2), flush=True)
            spy.send_signal(2); spy.wait(30)
finally:
    _stop(proc)
