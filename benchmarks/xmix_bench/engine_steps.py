"""Served engine steps: every step a vLLM server's engine core runs, recorded in a file, and the
steps of one benchmark run summarized.

**Recording** (:func:`install`, in the server's processes: ``recorded_server.py``). With
``XMIX_STEP_RECORD_DIR`` set, vLLM's ``Scheduler.schedule`` and ``Scheduler.update_from_output``
are wrapped at class level (``AsyncScheduler`` inherits both). Per step the wrappers take four
``time.perf_counter()`` readings (seconds, CLOCK_MONOTONIC: comparable across the processes of
one host):

* ``t0`` / ``t1``: before and after ``schedule()`` (kept by the ``id()`` of the returned
  ``SchedulerOutput`` until its output is processed: the object is not touched, so nothing more
  travels to the workers);
* ``t2`` / ``t3``: before and after ``update_from_output()`` of that ``SchedulerOutput``, i.e.
  once the step's model output has arrived in the engine core (and the aborts that came
  meanwhile were applied), and once the scheduler has turned it into the requests' outputs.

Each processed step appends one row of six float64 values, ``(t0, t1, t2, t3, tokens,
requests)`` (``tokens``: ``total_num_scheduled_tokens``; ``requests``: the requests scheduled,
``len(num_scheduled_tokens)``), in the order vLLM processes the outputs (the order the steps
were scheduled), to ``<dir>/steps.<pid>.bin`` of the process that runs the scheduler (the
engine core; one file per engine core with data parallelism). The file is created at the first
row (a process that never schedules, the API server, writes none) and mapped with ``mmap``
(``MAP_SHARED``): a :data:`HEADER_BYTES`-byte header (int64 row count at offset 0, written after
the row; int64 flag at 8, set to 1 when the file is full; int64 capacity at 16; the magic
:data:`MAGIC` at 24) and room for :data:`CAPACITY` rows (a sparse file: only written pages take
disk). A full file stops the recording and says so in its header; the meter reports it. Per step
the work is four clock reads, a dict set and pop and two ``struct.pack_into`` calls (the cost
measured on a CPU is in benchmarks/README.md).

With the plugin loaded, the plugin wraps ``Scheduler.update_from_output`` too (its read values
and triggers, ``vllm_xmix/_vllm_compat/scheduler.py``), in the engine core after this recorder:
its wrapper sits outside the recorder's, so ``t3 - t2`` is vLLM's own update alone (and ``t2``
comes after the plugin's work before it), and the plugin's work around it falls between one
step's ``t3`` and the next step's ``t2``: under async scheduling in the next step's period
(below), without it in the time between steps (``between``), never in an update time.

**Reading** (:class:`StepMeter`, in the benchmark's process): the rows count of every
``steps.*.bin`` in the folder at construction, the rows added since at :meth:`StepMeter.stop`,
and :func:`summarize` of them:

* a step's **period** = ``t2(k) - max(t3(k-1), t0(k))`` (ms): from the previous step's output
  being processed, or from this step being scheduled if that came later, to this step's output
  arriving. Under vLLM's async scheduling (a batch queue of 2) step k is scheduled before step
  k-1's output is handled, so this is the time step k held the pipeline, and the periods of
  consecutive steps add up to the time the engine was busy stepping. Without it (vLLM's
  ``EngineCore.step``: CPU builds, or async scheduling off), and after an idle gap, it is the
  schedule-to-output latency, and the engine core's work from one step's ``t3`` to the next
  one's ``t0`` (sending outputs, taking new requests, the plugin's work after vLLM's update) is
  in no period: ``between_ms_median`` / ``between_ms_sum`` give it (``max(0, t0(k) - t3(k-1))``,
  idle gaps included);
* a step whose ``schedule()`` the recorder did not see (``t0``, ``t1`` NaN) has no period and is
  counted apart (``unscheduled_steps``);
* groups: ``decode`` (tokens == requests: one token per request; with speculative decoding a
  decode step counts as mixed), ``mixed_le512`` (tokens > requests, tokens <= 512: the
  CUDA-graph range of vLLM's default capture sizes), ``mixed_gt512`` (tokens > 512), and steps
  that scheduled no token (``empty_steps``: counted, no group);
* per group: ``n``, the period's median, p90, p99 and mean (ms), the median tokens, the median
  host time of ``schedule()`` (``t1 - t0``) and of ``update_from_output()`` (``t3 - t2``) (ms),
  and its long steps (period above twice the group's median): how many, the time above the
  median they carry, and their own median host times (:func:`summarize`).

:meth:`StepMeter.stop` with ``save_to`` also writes the run's rows (:func:`save_rows`), for a
look at single steps.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import mmap
import os
import struct
import sys
import time

#: the environment variable that switches recording on: the folder of the step files
ENV = "XMIX_STEP_RECORD_DIR"
#: rows one file holds (2**21 rows: hours of steps; the file is sparse)
CAPACITY = 2 ** 21
HEADER_BYTES = 64
MAGIC = b"XMIXSTP1"
#: one row: t0, t1, t2, t3 (perf_counter seconds), tokens, requests
ROW = struct.Struct("<6d")
_I64 = struct.Struct("<q")
#: the largest token count of the ``mixed_le512`` group (vLLM's default CUDA-graph sizes end there)
GRAPH_TOKENS = 512
#: the step groups of a summary and their labels in the printed line; ``decode_one``: the decode
#: steps of a single request, a subset of ``decode`` and the comparison that holds on an MoE model
#: when an app changes the routing (one token reads top-k experts whatever they are; a batch
#: reads as many as its tokens are routed to)
GROUPS = {"decode": "decode", "decode_one": "decode of 1", "mixed_le512": "mixed<=512", "mixed_gt512": "mixed>512"}


def step_file(record_dir: str, pid: int | None = None) -> str:
    """The step file of process ``pid`` (default: this one) in ``record_dir``."""
    return os.path.join(record_dir, f"steps.{os.getpid() if pid is None else pid}.bin")


class StepWriter:
    """Appends rows to one step file (created here, ``CAPACITY`` rows of room, sparse).

    ``append(t0, t1, t2, t3, tokens, requests)`` writes the row, then the row count; once the
    file holds ``capacity`` rows it sets the header's full flag and writes nothing more."""

    def __init__(self, path: str, capacity: int = CAPACITY):
        self.path, self.capacity = path, capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity * ROW.size)
            self.mm = mmap.mmap(fd, HEADER_BYTES + capacity * ROW.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _I64.pack_into(self.mm, 16, capacity)
        self.mm[24:32] = MAGIC
        self.n = 0
        self.full = False

    def append(self, t0: float, t1: float, t2: float, t3: float, tokens: float, requests: float) -> None:
        n = self.n
        if n >= self.capacity:
            if not self.full:
                self.full = True
                _I64.pack_into(self.mm, 8, 1)
            return
        ROW.pack_into(self.mm, HEADER_BYTES + n * ROW.size, t0, t1, t2, t3, tokens, requests)
        self.n = n + 1
        _I64.pack_into(self.mm, 0, n + 1)


# ------------------------------------------------------------------------------ recording

_writer: StepWriter | None = None
_failed = False
#: id(SchedulerOutput) -> (t0, t1), from schedule() until update_from_output() of that output
_scheduled: dict[int, tuple[float, float]] = {}
#: t0, t1 of a step whose schedule() the recorder did not see: NaN (no period, counted apart)
_UNSCHEDULED = (float("nan"), float("nan"))


def _forget_writer() -> None:
    """After a fork: the child records to a file of its own (at its first row)."""
    global _writer, _failed
    _writer, _failed = None, False
    _scheduled.clear()


os.register_at_fork(after_in_child=_forget_writer)


def _open_writer(record_dir: str) -> StepWriter | None:
    global _writer, _failed
    try:
        os.makedirs(record_dir, exist_ok=True)
        _writer = StepWriter(step_file(record_dir))
    except OSError as e:  # the server keeps serving; the meter reports that no step was recorded
        _failed = True
        print(f"engine step recorder: cannot record to {record_dir}: {e}", file=sys.stderr, flush=True)
    return _writer


def install() -> bool:
    """Wrap ``Scheduler.schedule`` and ``Scheduler.update_from_output`` (class level, once per
    process) when :data:`ENV` is set; returns whether the wrappers are in place."""
    record_dir = os.environ.get(ENV)
    if not record_dir:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "__xmix_step_record__", False):
        return True
    perf = time.perf_counter
    scheduled = _scheduled
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output

    @functools.wraps(orig_schedule)
    def schedule(self, *args, **kwargs):
        t0 = perf()
        out = orig_schedule(self, *args, **kwargs)
        scheduled[id(out)] = (t0, perf())
        return out

    @functools.wraps(orig_update)
    def update_from_output(self, scheduler_output, model_runner_output):
        t2 = perf()
        outs = orig_update(self, scheduler_output, model_runner_output)
        t3 = perf()
        t0, t1 = scheduled.pop(id(scheduler_output), _UNSCHEDULED)  # (not scheduled through the wrapper)
        w = _writer
        if w is None:
            if _failed:
                return outs
            w = _open_writer(record_dir)
            if w is None:
                return outs
        w.append(t0, t1, t2, t3, scheduler_output.total_num_scheduled_tokens,
                 len(scheduler_output.num_scheduled_tokens))
        return outs

    for f, orig in ((schedule, orig_schedule), (update_from_output, orig_update)):
        f.__wrapped__ = orig
        f.__xmix_step_record__ = True
    Scheduler.schedule = schedule
    Scheduler.update_from_output = update_from_output
    return True


# ------------------------------------------------------------------------------ reading


def read_header(path: str) -> tuple[int, bool, int]:
    """(rows written, full flag, capacity) of a step file.

    Raises:
        ValueError: not a step file (no :data:`MAGIC`)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[24:32] != MAGIC:
        raise ValueError(f"{path}: not an engine step file")
    return _I64.unpack_from(head, 0)[0], bool(_I64.unpack_from(head, 8)[0]), _I64.unpack_from(head, 16)[0]


def read_rows(path: str, start: int, stop: int):
    """Rows ``start`` .. ``stop - 1`` of a step file as a float64 array of shape (k, 6)."""
    import numpy as np

    k = max(stop - start, 0)
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), k * ROW.size, HEADER_BYTES + start * ROW.size)
    return np.frombuffer(data, dtype="<f8").reshape(-1, 6)


def _files(record_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(record_dir, "steps.*.bin")))


def _ms(x) -> float:
    return round(float(x) * 1e3, 4)


def step_periods(rows, prev_t3):
    """Each step's period (the module docstring's): ``rows`` (k, 6) as :func:`read_rows` gives
    them, ``prev_t3`` (k,) the previous step's ``t3`` of each (NaN for a file's first step). A
    NaN ``t0`` (a step not seen scheduled) gives NaN; a NaN ``prev_t3``, the period from ``t0``."""
    import numpy as np

    return rows[:, 2] - np.where(np.isnan(rows[:, 0]), np.nan, np.fmax(prev_t3, rows[:, 0]))


def summarize(blocks: list[tuple[object, object]]) -> dict:
    """The summary of steps of one or more engine cores: ``blocks`` is a list of
    ``(rows, previous)``, ``rows`` an array (k, 6) of one file's consecutive rows and
    ``previous`` the row before them (None: the file's first row is among them).

    Returns ``{"engines", "steps", "empty_steps", "tokens", "period_sum_ms", "window_s",
    "schedule_ms_median", "update_ms_median", "decode", "decode_one", "mixed_le512", "mixed_gt512"}``: counts,
    the total tokens, the sum of the non-empty steps' periods (ms), the seconds from the first
    step's ``t0`` to the last one's ``t3``, the median host times of every non-empty step (ms),
    and per group ``{"n", "period_ms_median", "period_ms_p90", "period_ms_p99", "period_ms_mean",
    "tokens_median", "schedule_ms_median", "update_ms_median", "long_n", "long_excess_ms",
    "long_schedule_ms_median", "long_update_ms_median"}`` (``{"n": 0}`` for an empty group). The
    ``long_*`` keys describe the group's tail: its steps whose period is more than twice the
    group's median (``long_n``), the time above that median they carry (``long_excess_ms``,
    summed), and their median host times in
    ``schedule()`` / ``update_from_output()`` (None without such a step), which tell a tail of
    long host phases from one whose time lies elsewhere (the device, the model runner's host
    work, the engine core between steps). Steps are in the module docstring's terms."""
    import numpy as np

    rows, periods, betweens, engines = [], [], [], 0
    for r, prev in blocks:
        r = np.asarray(r, dtype=float).reshape(-1, 6)
        if not len(r):
            continue
        engines += 1
        prev_t3 = np.concatenate([[np.nan if prev is None else float(prev[3])], r[:-1, 3]])
        periods.append(step_periods(r, prev_t3))
        betweens.append(np.clip(r[:, 0] - prev_t3, 0.0, None))
        rows.append(r)
    if not rows:
        return {"engines": 0, "steps": 0}
    r, period, between = np.concatenate(rows), np.concatenate(periods), np.concatenate(betweens)
    tokens, reqs = r[:, 4], r[:, 5]
    sched, upd = r[:, 1] - r[:, 0], r[:, 3] - r[:, 2]
    known = ~np.isnan(r[:, 0])
    busy = (tokens > 0) & known
    gap = between[busy & ~np.isnan(between)]
    out = {"engines": engines, "steps": int(len(r)), "empty_steps": int((tokens <= 0).sum()),
           "unscheduled_steps": int((~known).sum()), "tokens": int(tokens.sum()),
           "period_sum_ms": _ms(period[busy].sum()),
           "window_s": round(float(np.nanmax(r[:, 3]) - np.nanmin(np.where(known, r[:, 0], r[:, 2]))), 4),
           "schedule_ms_median": _ms(np.median(sched[busy])) if busy.any() else None,
           "update_ms_median": _ms(np.median(upd[busy])) if busy.any() else None,
           "between_ms_median": _ms(np.median(gap)) if gap.size else None,
           "between_ms_sum": _ms(gap.sum())}
    decode = busy & (tokens == reqs)
    mixed = busy & (tokens > reqs)
    sels = {"decode": decode, "decode_one": decode & (reqs == 1), "mixed_le512": mixed & (tokens <= GRAPH_TOKENS),
            "mixed_gt512": mixed & (tokens > GRAPH_TOKENS)}
    for name in GROUPS:
        sel = sels[name]
        n = int(sel.sum())
        if not n:
            out[name] = {"n": 0}
            continue
        p = period[sel]
        med = float(np.median(p))
        long = p > 2 * med
        out[name] = {"n": n, "period_ms_median": _ms(med), "period_ms_p90": _ms(np.percentile(p, 90)),
                     "period_ms_p99": _ms(np.percentile(p, 99)),
                     "period_ms_mean": _ms(p.mean()), "tokens_median": float(np.median(tokens[sel])),
                     "schedule_ms_median": _ms(np.median(sched[sel])), "update_ms_median": _ms(np.median(upd[sel])),
                     "long_n": int(long.sum()), "long_excess_ms": _ms((p[long] - med).sum()),
                     "long_schedule_ms_median": _ms(np.median(sched[sel][long])) if long.any() else None,
                     "long_update_ms_median": _ms(np.median(upd[sel][long])) if long.any() else None}
    return out


class StepMeter:
    """The engine steps recorded in ``record_dir`` between :meth:`__init__` and :meth:`stop`.

    :meth:`stop` returns :func:`summarize` of the rows added in between (with the row before
    them, for the first one's period), or ``{"error": "no engine steps recorded (<why>)"}`` when
    the folder has no step file or no row was added; ``"capacity_full"`` (the files, and a
    ``"warning"``) when a file filled up, so steps after it are missing."""

    def __init__(self, record_dir: str):
        self.dir = record_dir
        self.restart()

    def restart(self) -> None:
        """Count from now: the steps recorded so far are left out (e.g. a benchmark client's
        ready-check request before the measured ones)."""
        self.start: dict[str, int] = {}
        for path in _files(self.dir):
            try:
                self.start[path] = read_header(path)[0]
            except (OSError, ValueError):
                continue

    def stop(self, requests: int | None = None, save_to: str | None = None) -> dict:
        """``requests``: how many requests the run completed (named in the error); ``save_to``: a
        ``.npz`` path the run's rows also go to (:func:`save_rows`), for a look at single steps
        the summary does not keep (an earlier file of that name is removed either way)."""
        if save_to:
            with contextlib.suppress(FileNotFoundError):  # (an earlier run's file of that name is not this run's)
                os.remove(save_to)
        files = _files(self.dir)
        if not files:
            why = (f"no steps.*.bin in {self.dir}: the engine core did not record; was the server started "
                   f"with --record-steps, through benchmarks.xmix_bench.recorded_server?")
            return {"error": f"no engine steps recorded ({why})"}
        blocks, paths, full, bad = [], [], [], []
        for path in files:
            try:
                count, is_full, capacity = read_header(path)
            except (OSError, ValueError) as e:
                bad.append(f"{os.path.basename(path)}: {e}")
                continue
            a = self.start.get(path, 0)
            if count < a:  # a new file under the same name (a restarted engine core with that pid)
                a = 0
            if is_full:
                full.append(f"{os.path.basename(path)} ({capacity} rows)")
            if count > a:
                prev = read_rows(path, a - 1, a)[0] if a > 0 else None
                blocks.append((read_rows(path, a, count), prev))
                paths.append(path)
        out = summarize(blocks)
        if save_to and out["steps"]:
            save_rows(save_to, blocks, [os.path.basename(p) for p in paths])
        if not out["steps"]:
            while_ = f" while the run completed {requests} requests" if requests else ""
            why = f"no row added to {len(files)} step file(s) in {self.dir}{while_}"
            if bad:
                why += "; unreadable: " + "; ".join(bad)
            out = {"error": f"no engine steps recorded ({why})"}
        if full:
            out["capacity_full"] = full
            out["warning"] = (f"step file(s) {', '.join(full)} full: recording stopped there, later steps are "
                              f"missing")
        return out


def save_rows(path: str, blocks: list[tuple[object, object]], files: list[str]) -> None:
    """The rows of ``blocks`` (:func:`summarize`'s argument; ``files``: the step file each block
    comes from, its basename ``steps.<pid>.bin``) in a compressed ``.npz``: per block ``e<i>`` a
    float64 array (k, 6) of ``t0, t1, t2, t3`` in ms from the earliest first row's ``t0`` (or
    ``t2`` where ``t0`` is NaN) of all blocks, then tokens and requests; ``e<i>_prev`` the row
    before them the same way (NaN without one); ``files`` the step files, block by block."""
    import numpy as np

    arrays = [np.asarray(r, dtype=float).reshape(-1, 6) for r, _ in blocks]
    starts = [a[0, 0] if not np.isnan(a[0, 0]) else a[0, 2] for a in arrays if len(a)]
    origin = min(starts) if starts else 0.0
    out = {"files": np.array(files)}
    for i, ((_, prev), a) in enumerate(zip(blocks, arrays)):
        for key, rows in ((f"e{i}", a), (f"e{i}_prev", np.full((1, 6), np.nan) if prev is None
                                         else np.asarray(prev, dtype=float).reshape(1, 6))):
            rows = rows.copy()
            rows[:, :4] = (rows[:, :4] - origin) * 1e3
            out[key] = rows
    np.savez_compressed(path, **out)


# ------------------------------------------------------------------------------ reporting


def summary(s: dict) -> str:
    """One line: ``decode 12.31 ms (n 840), mixed<=512 20.05 ms (n 96), mixed>512 - (n 0)``."""
    if not s:
        return "not recorded"
    if "error" in s:
        return s["error"] + (f"; {s['warning']}" if s.get("warning") else "")
    parts = []
    for name, label in GROUPS.items():
        g = s.get(name) or {"n": 0}
        parts.append(f"{label} {g['period_ms_median']:.2f} ms (n {g['n']})" if g["n"] else f"{label} - (n 0)")
    line = ", ".join(parts)
    if s.get("warning"):
        line += f"; {s['warning']}"
    return line


#: summary.md's columns: (group or None for the totals, key, header)
TABLE = [("decode", "period_ms_median", "decode period (ms)"), ("decode", "n", "decode n"),
         ("decode_one", "period_ms_median", "decode of 1 request (ms)"), ("decode_one", "n", "decode of 1 n"),
         ("mixed_le512", "period_ms_median", "mixed <=512 period (ms)"), ("mixed_le512", "n", "mixed <=512 n"),
         ("mixed_gt512", "period_ms_median", "mixed >512 period (ms)"), ("mixed_gt512", "n", "mixed >512 n"),
         (None, "schedule_ms_median", "schedule (ms)"), (None, "update_ms_median", "update (ms)")]


def table_rows(by_config: dict[str, list[dict]]) -> list[str]:
    """Markdown rows (with header) of each configuration's engine steps: per column the median
    over its runs of the run's value (``by_config``: configuration -> the runs' summaries; runs
    with an error are left out, a configuration with none shows "-"); [] when no run has steps."""
    import numpy as np

    if not any(s.get("steps") for runs in by_config.values() for s in runs):
        return []
    rows = ["| config | " + " | ".join(h for _, _, h in TABLE) + " |", "|---" * (1 + len(TABLE)) + "|"]
    for c, runs in by_config.items():
        runs = [s for s in runs if s.get("steps")]
        cells = []
        for group, key, _ in TABLE:
            xs = [(s.get(group) or {} if group else s).get(key) for s in runs]
            xs = [x for x in xs if x is not None]
            cells.append("-" if not xs else f"{np.median(xs):.0f}" if key == "n" else f"{np.median(xs):.3f}")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return rows
