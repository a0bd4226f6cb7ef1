"""Read results of one request, assembled in the front end: ``RequestOutput.mi_results``.

Values arrive in chunks (``(app, name, layer, positions, pos0, n, width, float32 bytes)``, one per
read entry and step, see ``ReadTransport.reads_of``) and are placed by **absolute position**, so
prefill chunks in any order of arrival, recompute after preemption (the same positions again:
the first value received is kept, the one a stream has already sent; the recomputed one equals
it up to the rounding of a differently sized batch) and async scheduling give one value per
position.

Alignment (documented in docs/hooks.md): position ``i`` is the ``i``-th token of
``prompt_token_ids + outputs[0].token_ids``, fed to the model as input; the value at ``i`` is
read while the model processes that token (the state that predicts token ``i + 1``). A finished
request with ``P`` prompt tokens and ``G`` generated tokens processed ``P + G - 1`` positions (the
last generated token is never fed back).

``mi_results[app][name]``, float32 numpy arrays:

* ``linear_probe``: ``[P + G - 1]``, one score per processed position;
* ``capture`` with ``positions="all"``: ``[P + G - 1, width]``; ``"generated"``: ``[G, width]``,
  row ``j`` = position ``P - 1 + j`` (the state that predicted generated token ``j``);
  ``"last"``: ``[width]`` at position ``P - 1`` (the last prompt token);

* ``triggers`` (apps with a read that has a trigger, ``read(...).on(...)``): a list, in position
  order, of ``{"read", "layer", "action", "position", "value"}``: each triggered read entry's
  first position whose value crossed its threshold (empty if none did). A ``stop`` trigger's
  request ended there (``stop_reason`` ``"xmix:<app>.<read>"``).

``width`` is ``d_model`` (``n_experts`` at ``mlp.hook_router_logits``). When a read covers
several layers in the request, ``mi_results[app][name]`` is ``{layer: array}`` instead. Before
the request finishes (streaming) the arrays cover the positions processed so far.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import struct

import numpy as np

logger = logging.getLogger("vllm.xmix")


class ReadResults:
    """Accumulates one request's read chunks; :meth:`assemble` builds ``mi_results``.

    :meth:`add` only keeps the step's chunk list (it runs for every output of every request with
    a read on, on the front end's per-token path); chunks are parsed when values are first
    assembled."""

    def __init__(self, n_prompt: int):
        self.n_prompt = n_prompt
        # (app, name, layer) -> [positions, width, [(seq, pos0, n, float32 bytes [n, width]), ...]]
        # (a chunk's bytes become an array only where its values are used: _values)
        self._parts: dict[tuple[str, str, int], list] = {}
        self._raw: list = []  # chunk lists received, not yet parsed
        self._parsed = 0  # chunks parsed into _parts
        self.n_chunks = 0
        self.triggers: dict | None = None  # {"apps": [...], "events": [(app, name, layer, action, pos, value)]}
        self._final: tuple | None = None  # ((n_generated, upto), final_json's value) for the chunks and triggers now

    def add_triggers(self, record: dict) -> None:
        """The engine core's trigger record of this request (the latest replaces the earlier)."""
        self.triggers = record
        self._final = None

    def trigger_records(self) -> dict[str, list[dict]]:
        """``{app: [{"read", "layer", "action", "position", "value"}, ...]}`` (see the module docstring)."""
        if not self.triggers:
            return {}
        out: dict[str, list[dict]] = {app: [] for app in self.triggers.get("apps", [])}
        for app, name, layer, action, pos, value in self.triggers.get("events", []):
            out.setdefault(app, []).append({"read": name, "layer": int(layer), "action": action,
                                            "position": int(pos), "value": float(value)})
        return out

    def add(self, chunks) -> None:
        """Keep one output's chunks (see ``ReadTransport.reads_of``), in arrival order, as
        tuples in one flat list: a tuple of strings, ints and bytes leaves the garbage
        collector's tracking at its first collection, the lists that msgpack decodes do not (a
        request whose outputs are not streamed kept one list per token alive)."""
        if chunks:
            self._raw += map(tuple, chunks)
            self.n_chunks += len(chunks)
            self._final = None

    def _parse(self, upto: int | None = None) -> None:
        """Parse the chunks received (``upto``: only those before it, in arrival order; the
        later ones stay as they arrived, for :meth:`StreamDelta.take_text`)."""
        if upto is None or upto - self._parsed >= len(self._raw):
            raw, self._raw = self._raw, []
        else:
            k = max(0, upto - self._parsed)
            raw, self._raw = self._raw[:k], self._raw[k:]
        seq = self._parsed
        parts = self._parts
        for app, name, layer, positions, pos0, n, width, data in raw:  # (per generated token: kept lean)
            key = (app, name, int(layer))
            part = parts.get(key)
            if part is None:
                part = parts[key] = [positions, int(width), []]
            part[2].append((seq, pos0, n, data))
            seq += 1
        self._parsed = seq

    def final_json(self, n_generated: int | None, upto: int | None = None) -> dict:
        """``to_json(self.assemble(n_generated, upto))``, computed once for the same chunks: a
        finished request's values are asked for twice (the response's ``kv_transfer_params`` and
        the last streamed chunk's ``mi_results_complete``), a few hundred microseconds each on
        the front end's event loop for a probe over a few hundred positions."""
        upto = self.n_chunks if upto is None else min(upto, self.n_chunks)
        key = (n_generated, upto)  # (new chunks or trigger records drop the kept value: add, add_triggers)
        if self._final is None or self._final[0] != key:
            self._final = (key, to_json(self.assemble(n_generated, upto)))
        return self._final[1]

    def view(self, n_generated: int | None = None) -> "ResultsView":
        """What a RequestOutput carries: the values received so far, assembled when asked for."""
        return ResultsView((self, self.n_chunks, n_generated))

    def parts(self, n_generated: int | None = None, upto: int | None = None):
        """Per read entry, ``((app, name, layer), positions, start, values [n, width])``: the
        values of positions ``start .. start + n - 1`` (``start``: 0, or ``P - 1`` for captures
        of ``generated`` / ``last`` positions); arguments as for :meth:`assemble`."""
        if self._raw:
            self._parse()
        P = self.n_prompt
        for key, (positions, width, all_chunks) in sorted(self._parts.items()):
            chunks = [c for c in all_chunks if c[0] < upto] if upto is not None else all_chunks
            if not chunks:
                continue
            start = 0 if positions in ("all", "probe") else P - 1
            # the common stream: each chunk starts where the one before ended (a prompt, then one
            # position per decode step), from start on: the values are the chunks' bytes end to
            # end (one join and one array, writeable: a bytearray)
            nxt = start
            for _, p0, n, _ in chunks:
                if p0 != nxt:
                    break
                nxt += n
            else:
                if positions != "last" and (n_generated is None or nxt == P + n_generated - 1):
                    joined = bytearray().join([c[3] for c in chunks])
                    if len(joined) != (nxt - start) * width * 4:  # (each chunk's n x width float32: as np.ndarray checked it)
                        raise ValueError(f"read {key}: chunks hold {len(joined)} bytes of values, "
                                         f"{nxt - start} positions x {width} float32 expected")
                    yield key, positions, start, np.frombuffer(joined, np.float32).reshape(-1, width)
                    continue
            if positions == "last":
                end = P
            elif n_generated is not None:
                end = P + n_generated - 1
            else:
                end = max(p0 + n for _, p0, n, _ in chunks)
            arr = np.full((max(end - start, 0), width), np.nan, dtype=np.float32)
            for _, p0, n, data in reversed(chunks):  # (the first value received of a recomputed position is written last)
                lo, hi = max(p0, start), min(p0 + n, end)
                if hi > lo:
                    arr[lo - start:hi - start] = _values(n, width, data)[lo - p0:hi - p0]
            yield key, positions, start, arr

    def assemble(self, n_generated: int | None = None, upto: int | None = None) -> dict[str, dict]:
        """``n_generated``: number of generated tokens when the request has finished (fixes the
        expected length; a missing position is NaN and logged), None while it runs. ``upto``:
        use only the first ``upto`` chunks received (a streamed output's snapshot)."""
        out: dict[str, dict] = {}
        for (app, name, layer), positions, start, arr in self.parts(n_generated, upto):
            width = arr.shape[1]
            if n_generated is not None and np.isnan(arr).all(axis=1).any():
                missing = np.flatnonzero(np.isnan(arr).all(axis=1)) + start
                logger.warning("vllm_xmix: read %s.%s at layer %d has no value at positions %s (NaN)",
                               app, name, layer, missing[:10].tolist())
            if positions == "probe":
                arr = arr[:, 0]
            elif positions == "last":
                arr = arr[0] if len(arr) else np.full(width, np.nan, np.float32)
            out.setdefault(app, {}).setdefault(name, {})[layer] = arr
        for app, reads in out.items():
            for name, by_layer in reads.items():
                if len(by_layer) == 1:
                    reads[name] = next(iter(by_layer.values()))
        for app, records in self.trigger_records().items():
            out.setdefault(app, {})["triggers"] = records
        return out


class ResultsView(tuple):
    """``RequestOutput.mi_results`` of one output: ``(acc, upto, n_generated)``, the request's
    :class:`ReadResults`, how many of its chunks had arrived with that output, and its number of
    generated tokens once finished (None before). Assembled only when asked for (:meth:`get`:
    outputs nobody reads, e.g. the server's streamed chunks, cost nothing); a tuple, so that
    making one per output is a single C call on the front end's per-token path."""

    __slots__ = ()

    _acc = property(operator.itemgetter(0))
    _upto = property(operator.itemgetter(1))
    _n_generated = property(operator.itemgetter(2))

    def get(self) -> dict[str, dict]:
        """``{app: {name: array}}`` of the chunks up to this output (see the module docstring)."""
        return self[0].assemble(self[2], self[1])


def to_json(results: dict) -> dict:
    """``mi_results`` as JSON-able data (nested lists of floats; NaN / inf become None), keyed
    like ``mi_results`` (layer keys as strings)."""

    def clean(x):
        if isinstance(x, list):
            return [clean(y) for y in x]
        return None if not np.isfinite(x) else x

    def conv(v):
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        a = np.asarray(v, dtype=np.float64)
        return a.tolist() if np.isfinite(a).all() else clean(a.tolist())

    return {app: {name: (v if name == "triggers" else conv(v)) for name, v in reads.items()}
            for app, reads in results.items()}



class StreamDelta:
    """One streamed request's read values chunk by chunk (``mi_results`` of each chunk the
    OpenAI server streams): :meth:`take` returns the values of the positions that arrived since
    the previous call, as JSON-able data::

        {app: {name: {"pos0": first position, "values": [...]}}}   # {name: {layer: {...}}} for several layers

    ``values`` has one entry per position ``pos0, pos0 + 1, ...`` (probes: a float; captures: a
    row of ``width`` floats; missing values: null), in the alignment of ``mi_results`` (position
    ``i`` is the ``i``-th token of prompt + generated tokens); a ``last`` capture comes once, as
    ``{"pos0": P - 1, "values": [row]}``. Concatenated over a stream's chunks they are the
    values of the non-streaming response (for a ``last`` capture, whose non-streaming value is
    the row itself: the one-position list holding it)."""

    def __init__(self) -> None:
        self._sent: dict[tuple, int] = {}  # (app, name, layer) -> next position to send
        self._seen: dict[tuple, int] = {}  # (app, name, layer) -> chunks of it already looked at
        self._triggers_sent: dict[str, int] = {}  # app -> trigger records already sent
        self._layers: dict[tuple[str, str], int] = {}  # (app, name) -> layers it has (of _n_parts parts)
        self._n_parts = 0
        self._taken = 0  # chunks (in arrival order) looked at: every chunk before this one
        self._fast: list | None = None  # take_text's state while on its path (_start_fast)

    def take_text(self, acc: ReadResults | None, upto: int | None = None) -> str | None:
        """:meth:`take`'s result as JSON text, for the common case of streamed decode steps only:
        the new chunks are whole steps, each one value of the same probe read entries (one read,
        a probe at several layers, several probes), each at its next position to send (one step
        a chunk; several when the stream merged outputs), every entry already streamed, and
        there are no trigger records. None otherwise (then call :meth:`take`). Looks at the
        chunks where they arrived, without assembling: once a stream is on this path, a streamed
        token costs a few comparisons, one ``struct`` unpack and one string per entry, put into
        a JSON template made once (:meth:`_start_fast`; the entries and their next position are
        kept in ``_fast``, written back into the per-read state by :meth:`_sync` when anything
        else looks at it)."""
        if acc is None or acc.triggers is not None:
            return None
        raw, parsed = acc._raw, acc._parsed
        k0 = self._taken - parsed
        k1 = (acc.n_chunks if upto is None else upto) - parsed
        if k0 < 0 or k1 <= k0 or k1 > len(raw):
            return None
        fast = self._fast
        c = raw[k0]
        if fast is None or c[4] != fast[1] or c[0] != fast[0][0][0] or c[1] != fast[0][0][1] or c[2] != fast[0][0][2]:
            fast = self._start_fast(raw, k0, k1)
            if fast is None:
                return None
        keys, pos0, segs = fast[0], fast[1], fast[2]
        k = len(keys)
        if k == 1 and k1 == k0 + 1:  # one read's one decode step, the commonest chunk (c is its entry's, at pos0)
            if c[5] != 1 or c[3] != "probe":
                return None
            (x,) = _F32_UNPACK(c[7])
            fast[1] = pos0 + 1
            self._taken = k1 + parsed
            return (f'{segs[0]}{{"pos0":{pos0},"values":[{x!r}]}}{segs[1]}' if x - x == 0.0
                    else f'{segs[0]}{{"pos0":{pos0},"values":[null]}}{segs[1]}')
        m, rest = divmod(k1 - k0, k)
        if rest:
            return None
        if m == 1:  # one decode step, the common chunk (x - x is 0.0 for finite floats, NaN otherwise)
            text = [segs[0]]
            for j in range(k):
                c = raw[k0 + j]
                key = keys[j]
                if c[4] != pos0 or c[5] != 1 or c[3] != "probe" or c[0] != key[0] or c[1] != key[1] or c[2] != key[2]:
                    return None
                (x,) = _F32_UNPACK(c[7])
                text.append(f'{{"pos0":{pos0},"values":[{x!r}]}}{segs[j + 1]}' if x - x == 0.0
                            else f'{{"pos0":{pos0},"values":[null]}}{segs[j + 1]}')
        else:  # merged outputs: m whole steps, in order
            vals: list[list] = [[] for _ in range(k)]
            i = k0
            for pos in range(pos0, pos0 + m):
                for j in range(k):
                    c = raw[i]
                    key = keys[j]
                    if c[4] != pos or c[5] != 1 or c[3] != "probe" or c[0] != key[0] or c[1] != key[1] or c[2] != key[2]:
                        return None
                    vals[j] += _F32_UNPACK(c[7])
                    i += 1
            text = [segs[0]]
            for j in range(k):
                body = ",".join(repr(v) if v - v == 0.0 else "null" for v in vals[j])
                text.append(f'{{"pos0":{pos0},"values":[{body}]}}{segs[j + 1]}')
        fast[1] = pos0 + m
        self._taken = k1 + parsed
        return "".join(text)

    def _start_fast(self, raw: list, k0: int, k1: int) -> list | None:
        """:meth:`take_text`'s state (``[read entries (app, name, layer) in step order, next
        position, JSON template: k + 1 texts around the entries' values, first position]``)
        if chunk ``k0`` starts a step of probe values (one or several), each a read entry
        already streamed at the step's position; else None. The template nests the entries as
        :meth:`take` does (:meth:`_put`: under the layer for a read at several layers)."""
        self._sync()
        pos = raw[k0][4]
        keys: list[tuple] = []
        for i in range(k0, k1):
            app, name, layer, tag, pos0, n, width, data = raw[i]
            if pos0 != pos:
                break
            key = (app, name, layer)
            if tag != "probe" or n != 1 or self._sent.get(key) != pos or key in keys:
                return None
            keys.append(key)
        out: dict = {}
        marks = [f"@xmix-entry-{j}@" for j in range(len(keys))]
        for (app, name, layer), mark in zip(keys, marks):
            slot = out.setdefault(app, {})
            if self._layers.get((app, name)) == 1:
                slot[name] = mark
            else:
                slot.setdefault(name, {})[str(layer)] = mark
        text, segs = json.dumps(out, separators=(",", ":")), []
        for mark in marks:  # (a name that spells a mark: no template, the parsed path)
            q = json.dumps(mark)
            if text.count(q) != 1:
                return None
            head, text = text.split(q)
            segs.append(head)
        segs.append(text)
        self._fast = [keys, pos, segs, pos]
        return self._fast

    def _sync(self) -> None:
        """Write the fast path's progress (positions sent, chunks looked at: one per position
        and entry) back into the per-read state and leave the fast path."""
        fast = self._fast
        if fast is not None:
            for key in fast[0]:
                self._sent[key] = fast[1]
                self._seen[key] = self._seen.get(key, 0) + fast[1] - fast[3]
            self._fast = None

    def take(self, acc: ReadResults | None, upto: int | None = None) -> dict:
        """The values new since the last call, of the first ``upto`` chunks of ``acc`` (the
        output being streamed: chunks of later outputs may already be there). Looks at each
        chunk once, so a stream costs time linear in its length."""
        out: dict = {}
        if acc is None:
            return out
        self._sync()
        self._taken = acc.n_chunks if upto is None else max(self._taken, min(upto, acc.n_chunks))
        if acc._raw:
            acc._parse(upto)  # (a lagging stream's later chunks stay for take_text)
        parts = acc._parts
        if len(parts) != self._n_parts:  # (a read's first values: count the layers of each read again)
            layers: dict[tuple[str, str], int] = {}
            for app, name, _ in parts:
                layers[(app, name)] = layers.get((app, name), 0) + 1
            self._layers, self._n_parts = layers, len(parts)
        P = acc.n_prompt
        seen = self._seen
        for key, (positions, width, chunks) in parts.items():
            i = seen.get(key, 0)
            n = len(chunks)
            if i == n:
                continue
            if upto is None or chunks[-1][0] < upto:  # (chunk sequence numbers increase)
                j = n
            else:
                j = i
                while j < n and chunks[j][0] < upto:
                    j += 1
                if j == i:
                    continue
            seen[key] = j
            start = 0 if positions in ("all", "probe") else P - 1
            sent = self._sent.get(key, start)
            _, p0, nv, data = chunks[i]
            if j == i + 1:  # one new chunk (a step's values): no copy when it starts where the last ended
                end = P if positions == "last" else p0 + nv
                if end <= sent:
                    continue  # (recomputed positions, already sent)
                if positions == "probe" and end == sent + 1 and p0 <= sent:  # a decode step's one value
                    (x,) = _F32_UNPACK(data, 4 * (sent - p0) * width)
                    self._sent[key] = end
                    self._put(out, key, {"pos0": sent, "values": [x if math.isfinite(x) else None]})
                    continue
                new = _values(nv, width, data)[sent - p0:end - p0] if p0 <= sent and p0 + nv >= end else None
            else:
                end = P if positions == "last" else max(c[1] + c[2] for c in chunks[i:j])
                if end <= sent:
                    continue
                new = None
            if new is None:
                new = np.full((end - sent, width), np.nan, dtype=np.float32)
                for _, p0, n, data in reversed(chunks[i:j]):  # (a position's first value is written last)
                    lo, hi = max(p0, sent), min(p0 + n, end)
                    if hi > lo:
                        new[lo - sent:hi - sent] = _values(n, width, data)[lo - p0:hi - p0]
            self._sent[key] = end
            self._put(out, key, {"pos0": sent, "values": _json_values(new[:, 0] if positions == "probe" else new)})
        for app, records in acc.trigger_records().items():  # records fired since the last chunk
            new = records[self._triggers_sent.get(app, 0):]
            if new:
                self._triggers_sent[app] = len(records)
                out.setdefault(app, {})["triggers"] = new
        return out

    def _put(self, out: dict, key: tuple, entry: dict) -> None:
        """Put one read entry's values into a chunk's ``mi_results`` (under its layer when the
        read has several)."""
        app, name, layer = key
        slot = out.setdefault(app, {})
        if self._layers[(app, name)] == 1:
            slot[name] = entry
        else:
            slot.setdefault(name, {})[str(layer)] = entry


#: one float32 as the bytes of a read chunk hold it (numpy's ``tobytes``: native byte order)
_F32 = struct.Struct("=f")
_F32_UNPACK = _F32.unpack_from


def _values(n: int, width: int, data: bytes) -> np.ndarray:
    """A chunk's values: a read-only float32 ``[n, width]`` view of its bytes (np.frombuffer and
    reshape in one call)."""
    return np.ndarray((n, width), np.float32, data)


def _json_values(a: np.ndarray) -> list:
    """Floats as a (nested) list, non-finite values as None."""
    vals = a.tolist()  # (float32 values become the Python floats of the same value)
    if (all(map(math.isfinite, vals)) if a.ndim == 1 and len(vals) <= 64 else bool(np.isfinite(a).all())):
        return vals

    def clean(x):
        return [clean(y) for y in x] if isinstance(x, list) else (None if not np.isfinite(x) else x)

    return clean(vals)
