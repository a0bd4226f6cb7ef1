"""``vllm serve`` with its engine steps recorded (``engine_steps``), and optionally its API server
profiled (``XMIX_PROFILE_OUT``, :func:`main`): ``python -m
benchmarks.xmix_bench.recorded_server serve <model> <args...>`` takes the arguments of ``vllm
serve`` (run from the repository's root, with ``XMIX_STEP_RECORD_DIR`` set; ``serve start
--record-steps`` starts its servers so).

The wrappers go in at import, before vLLM's command line runs, so the engine-core process gets
them either way vLLM starts it: spawned (what ``vllm serve`` sets up when
``VLLM_WORKER_MULTIPROC_METHOD`` is unset, and what vLLM forces where CUDA is already
initialized), ``multiprocessing`` runs this module again in the child as ``__mp_main__`` (a
``-m`` main module is re-imported by name), which installs them there before vLLM loads its
plugins; forked (``VLLM_WORKER_MULTIPROC_METHOD=fork``), the child inherits the wrapped class.
With the plugin, its own wrapper of ``Scheduler.update_from_output`` is installed later, when
vLLM loads plugins, so it sits outside the recorder's (``engine_steps``' docstring)."""

from __future__ import annotations

import sys

from benchmarks.xmix_bench import engine_steps

engine_steps.install()


def main() -> int:
    """``vllm serve`` with these arguments; with ``XMIX_PROFILE_OUT`` set, its API server's main
    thread (this process) also gets the signal-switched profiler of ``profiled_server.py``
    (``serve start --profile-api``; the engine core, a child process, does not)."""
    import os

    from benchmarks.xmix_bench import profiled_server
    from benchmarks.xmix_bench.common import vllm_cli

    if os.environ.get(profiled_server.ENV):
        profiled_server.install(os.environ[profiled_server.ENV])
    return vllm_cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
