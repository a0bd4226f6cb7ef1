"""Sampled profiles of a vLLM server's API server over one benchmark run (py-spy).

At saturation a request with reads is bounded by the OpenAI API server's event loop (one Python
thread; RESULTS.md), so what a configuration costs there is the Python work per output token.
``serve rounds --api-profile`` measures it with cProfile: calls exactly, but times by the wall
clock with the profiler's own ~1 us per call inside them, which inflates every call and charges
a socket write's wait for the CPU to the function that wrote. This module samples instead:
``py-spy record --gil --nonblocking`` reads the process's Python stacks from outside at a fixed
rate without pausing it, and keeps only the samples of the thread that holds the GIL, i.e. the
Python work that bounds the event loop. Each sample stands for ``1 / rate_hz`` seconds of it, so
per configuration: GIL-held microseconds per output token, and per function its own
("self": the innermost Python frame, C code it calls included) and inclusive microseconds per
output token. Compare configurations sampled on the same machine in one call.

py-spy is a static binary (``pip install py-spy``, the ``test`` extra); :func:`py_spy_path`
finds it on ``PATH``, beside the interpreter or at ``$XMIX_PY_SPY`` (the GPU kit has no pip: the benchmark plans carry
the binary). It needs the right to read the other process's memory (same user, ptrace allowed).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time

#: the environment variable naming the py-spy binary, where it is not on ``PATH``
PY_SPY_ENV = "XMIX_PY_SPY"
#: samples per second
RATE_HZ = 500

_LINE_NO = re.compile(r":\d+\)$")
#: the function a sample without a Python frame is counted under
NO_FRAME = "<no Python frame>"


def py_spy_path() -> str:
    """The py-spy binary: ``$XMIX_PY_SPY``, else ``py-spy`` on ``PATH`` or beside the running
    interpreter.

    Raises:
        RuntimeError: neither exists (the message says how to get it)."""
    env = os.environ.get(PY_SPY_ENV)
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise RuntimeError(f"${PY_SPY_ENV}={env!r} is not an executable file")
        return env
    # (on PATH, else beside this interpreter: a virtual environment's bin/ need not be on PATH)
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not found:
        raise RuntimeError(f"py-spy not found: `pip install py-spy` (the test extra has it), or set ${PY_SPY_ENV} "
                           "to its binary")
    return found


class Sampler:
    """py-spy recording process ``pid``'s GIL-holding thread at ``rate_hz`` into ``path`` (py-spy's
    raw format: one ``frame;frame;... count`` line per distinct stack, outermost frame first)
    from construction to :meth:`stop`.

    Raises:
        RuntimeError: py-spy is missing (:func:`py_spy_path`), or exited before :meth:`stop` (it
            could not attach: the message holds its output)."""

    def __init__(self, pid: int, path: str, rate_hz: int = RATE_HZ):
        self.path = path
        self.rate_hz = rate_hz
        self._log = path + ".log"
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [py_spy_path(), "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw",
                 "--output", path, "--gil", "--nonblocking"], stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # (attaching takes a moment: the run starts after it)
        self._check()

    def _check(self) -> None:
        if self._proc.poll() is not None:
            raise RuntimeError(f"py-spy exited ({self._proc.returncode}) before the run's end: "
                               + open(self._log).read()[-1500:])

    def stop(self) -> str:
        """End the recording (py-spy writes its file on SIGINT); the file's path.

        Raises:
            RuntimeError: py-spy had exited already, or wrote no file within 60 s."""
        self._check()
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise RuntimeError(f"py-spy did not stop within 60 s of SIGINT ({self._log})") from None
        if not os.path.exists(self.path):
            raise RuntimeError(f"py-spy wrote no {self.path}: " + open(self._log).read()[-1500:])
        return self.path


def load(path: str) -> tuple[collections.Counter, collections.Counter, int]:
    """(inclusive samples per function, self samples per function, all samples) of a raw py-spy
    file. A function is ``name (file)``, its line number dropped, so that a function's samples at
    different lines add up; a frame repeated within one stack (recursion) counts once inclusively;
    a sample with an empty stack counts under :data:`NO_FRAME`.

    Raises:
        ValueError: a line is not ``stack count``."""
    incl: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            stack, sep, n = line.rpartition(" ")
            if not sep or not n.isdigit():
                raise ValueError(f"{path}:{ln}: not a raw py-spy line (stack count): {line[:200]!r}")
            k = int(n)
            # (an empty stack: the GIL held with no Python frame on the thread, e.g. between two calls)
            frames = [_LINE_NO.sub(")", fr) for fr in stack.split(";")] if stack else [NO_FRAME]
            total += k
            for fr in set(frames):
                incl[fr] += k
            own[frames[-1]] += k
    return incl, own, total


def summary(path: str, rate_hz: int, output_tokens: int, requests: int, top: int = 40) -> dict:
    """One sampled run per output token: ``{"output_tokens", "requests", "samples", "gil_us_per_token"
    (GIL-held microseconds of the API server per output token), "self": [[function, us per token],
    ...] and "inclusive": [...] (the ``top`` functions of each)}``."""
    incl, own, total = load(path)
    per = 1e6 / rate_hz / max(output_tokens, 1)
    return {"output_tokens": output_tokens, "requests": requests, "samples": total,
            "gil_us_per_token": round(total * per, 2),
            "self": [[fn, round(n * per, 3)] for fn, n in own.most_common(top)],
            "inclusive": [[fn, round(n * per, 3)] for fn, n in incl.most_common(top)]}


def report(got: dict, base: str = "vanilla", rows: int = 8) -> str:
    """Lines of sampled runs (``{config: summary}``): per configuration its GIL-held microseconds
    per output token against ``base``'s, and the functions whose self and inclusive time per
    token grew most against it (functions outside either's top list count as 0 there)."""
    lines = ["API server, py-spy samples of the GIL-holding thread, microseconds per output token:"]
    ref = got.get(base) or {}
    for name, r in got.items():
        vs = "" if name == base or not ref else f" ({r['gil_us_per_token'] - ref['gil_us_per_token']:+.1f} on {base})"
        lines.append(f"  {name:16s} {r['gil_us_per_token']:8.1f} us{vs} ({r['samples']} samples, "
                     f"{r['output_tokens']} tokens)")
        if name == base or not ref:
            continue
        for key in ("self", "inclusive"):
            was = dict(ref[key])
            now = dict(r[key])
            grown = sorted(((now.get(fn, 0.0) - was.get(fn, 0.0), fn) for fn in set(was) | set(now)), reverse=True)
            lines += [f"      {key:9s} {delta:+8.2f} us  {fn[:150]}" for delta, fn in grown[:rows] if delta > 0]
    return "\n".join(lines)
