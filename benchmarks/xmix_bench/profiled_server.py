"""vLLM's OpenAI API server (``vllm.entrypoints.openai.api_server``, same arguments) with a
deterministic profiler in its main thread (the event loop: HTTP, streaming, the output
processor), switched by signals so that only the measured requests are profiled:

* ``SIGUSR1``: start a profile (cProfile) and garbage-collection accounting;
* ``SIGUSR2``: stop it and write ``$XMIX_PROFILE_OUT.<k>`` (pstats) and ``$XMIX_PROFILE_OUT.<k>.gc.json``
  (collections per generation, seconds in them, objects collected, objects tracked at start and
  end), ``k`` = 0, 1, ... per profile.

Used by ``profile api-calls`` (``api_calls.py``): ``python -m benchmarks.xmix_bench.profiled_server
--model ...`` from the repository's root."""

from __future__ import annotations

import cProfile
import gc
import json
import os
import runpy
import signal
import sys
import time


#: the environment variable that names the profiles' path prefix
ENV = "XMIX_PROFILE_OUT"


def install(out: str) -> None:
    """The signal-switched profiler of this process's main thread (see the module docstring),
    writing ``out.<k>`` and ``out.<k>.gc.json``. Also used by ``recorded_server.py`` when
    :data:`ENV` is set (``serve start --profile-api``)."""
    state = {"prof": None, "k": 0, "gc": None, "t0": 0.0}

    def on_gc(phase, info):
        g = state["gc"]
        if g is None:
            return
        if phase == "start":
            state["t0"] = time.perf_counter()
            return
        g["collections"][info["generation"]] += 1
        g["seconds"][info["generation"]] += time.perf_counter() - state["t0"]
        g["collected"] += info["collected"]

    def start(signum, frame):
        state["gc"] = {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": 0,
                       "tracked_start": len(gc.get_objects()), "frozen": gc.get_freeze_count()}
        state["prof"] = cProfile.Profile()
        state["prof"].enable()

    def stop(signum, frame):
        prof, g = state["prof"], state["gc"]
        if prof is None:
            return
        prof.disable()
        state["prof"] = state["gc"] = None
        g["tracked_end"] = len(gc.get_objects())
        prof.dump_stats(f"{out}.{state['k']}")
        with open(f"{out}.{state['k']}.gc.json", "w") as f:
            json.dump(g, f)
        state["k"] += 1

    gc.callbacks.append(on_gc)
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def main() -> None:
    install(os.environ[ENV])
    sys.argv = ["vllm.entrypoints.openai.api_server"] + sys.argv[1:]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
