"""Host (CPU) time that vllm-xmix adds per engine step, measured with cProfile on an in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: front end, engine core and worker in one process).

The plugin's bookkeeping (request registry, per-step ``fill``, read snapshots and their transport
``reads_of``, result assembly ``ReadResults.add`` / ``assemble``) is Python that does not depend
on the accelerator, so it can be measured on the CPU with the embedded tiny model; what it costs
on a GPU server depends on whether the engine core's host work per step stays under the GPU step
time (async scheduling overlaps the two). The hook ops themselves run the torch *reference*
kernels here (``steer_add_reference``, ``read_rows_reference``, ``gate_reference``, ...): their
time is CPU compute and does not transfer to a GPU (there they are Triton launches or fused).

Reports, per configuration (``none``: no app on, like serve_bench's ``inactive``; otherwise every
request with that app on; ``--batch`` requests of ``--tokens`` generated tokens): engine steps,
wall time per step, the summed *self* time of functions defined in ``vllm_xmix`` per step (time
in torch ops and in vLLM code they call is not included), the 5 functions with the most self
time, and the *cumulative* time of the entry points (``fill``, ``update_requests``, ``snapshot``,
``reads_of``, ``add``, ``assemble``, ``hook_write_``; cumulative includes what they call).
With one app on, only that app's sites run (graph variants per app; eager here: exactly the sites
the registered requests need).

usage: python benchmarks/host_overhead.py [--batch 64] [--tokens 64] [--configs none,steer_all,probe_one,cast]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", default="none,steer_all,probe_one,cast")
    args = ap.parse_args()

    import numpy as np
    from vllm import LLM, SamplingParams

    from vllm_xmix import MIApp, deploy
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model("llama")
    d, n = 64, 4
    rng = np.random.default_rng(0)
    v, w, c = (rng.standard_normal(d).astype(np.float32) for _ in range(3))
    apps = [MIApp("steer_all"), MIApp("probe_one"), MIApp("cast")]
    apps[0].write("add", vector=v, scale=0.5).layers("all")
    apps[1].read("linear_probe", weight=w / np.sqrt(d), sigmoid=True).layers([n // 2])
    apps[2].read("cosine", weight=c, buffer="sim", scope="request").layers([0])
    apps[2].write("add", vector=v, scale=0.5).layers([2, 3]).cond(buffer="sim", op=">", threshold=-1.0)
    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=args.batch, seed=0, enforce_eager=True,
              additional_config=deploy(*apps), block_size=32)
    prompts = [{"prompt_token_ids": rng.integers(10, 1000, int(k)).tolist()} for k in rng.integers(16, 128, args.batch)]

    def sp(name):
        extra = None if name == "none" else {"xmix": {"apps": [{"name": name}]}}
        return SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, extra_args=extra)

    llm.generate(prompts, sp("steer_all"), use_tqdm=False)  # warm-up
    print(f"batch {args.batch}, {args.tokens} tokens; per engine step (ms):")
    for name in args.configs.split(","):
        steps0 = _steps(llm)
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate(prompts, sp(name), use_tqdm=False)
        prof.disable()
        wall = time.perf_counter() - t
        steps = _steps(llm) - steps0
        st = pstats.Stats(prof)
        ours = []
        for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
            if f"{os.sep}vllm_xmix{os.sep}" in file:
                ours.append((tt, ct, nc, f"{os.path.basename(file)}:{line}({fn})"))
        own = sum(x[0] for x in ours)  # self time of our functions (no double counting)
        print(f"  {name:10s} steps {steps:4d}  wall/step {wall / steps * 1e3:7.3f}  "
              f"vllm_xmix self time/step {own / steps * 1e3:7.3f}  ({own / wall * 100:.1f}% of wall)")
        for tt, ct, nc, label in sorted(ours, reverse=True)[:5]:
            print(f"      {tt / steps * 1e3:7.4f} ms/step self, {ct / steps * 1e3:7.4f} cumulative, {nc:6d} calls  {label}")
        entry = ("(fill)", "(update_requests)", "(snapshot)", "(reads_of)", "(add)", "(assemble)", "(hook_write_)")
        for tt, ct, nc, label in sorted(ours, key=lambda x: -x[1]):
            if label.endswith(entry):
                print(f"      cumulative {ct / steps * 1e3:7.4f} ms/step  {nc:6d} calls  {label}")
    return 0


def _steps(llm) -> int:
    st = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .compilation_config.static_forward_context["vllm_xmix"]
    return st.forwards


if __name__ == "__main__":
    sys.exit(main())
