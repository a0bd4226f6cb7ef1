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

``--serving-deployment MODEL_DIR`` (e.g. benchmarks/models/llama31_8b): no engine; the worker-side
runtime alone (``XmixState`` on CPU tensors, built from serve_bench.py's deployment for that
config: full-size vectors, 7 apps) driven with scheduler outputs shaped like vLLM's: per app, the
median host time of ``update_requests`` + ``fill`` + read snapshot / transport for a mixed step
(one new request of 220 prompt tokens beside 40 decoding ones) and for a decode step.

usage: python benchmarks/host_overhead.py [--batch 64] [--tokens 64] [--configs none,steer_all,probe_one,cast]
       python benchmarks/host_overhead.py --serving-deployment benchmarks/models/llama31_8b
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
    ap.add_argument("--serving-deployment", metavar="MODEL_DIR",
                    help="time the worker-side runtime alone with serve_bench.py's deployment for this config")
    ap.add_argument("--fused-writes", choices=["none", "adds", "all"], default="none",
                    help="with --serving-deployment: the deployment's fused_writes (adds/all: fill() also "
                         "writes the per-token fused coefficients)")
    args = ap.parse_args()
    if args.serving_deployment:
        return runtime_steps(args.serving_deployment, fused_writes=args.fused_writes)

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


def runtime_steps(model_dir: str, running: int = 40, prompt: int = 220, n: int = 300,
                  fused_writes: str = "none") -> int:
    """Per app of serve_bench.py's deployment: median host ms of the runtime's per-step work
    (``update_requests``, ``fill``, ``snapshot`` / ``reads_of``) in a mixed and a decode step."""
    import json
    from types import SimpleNamespace as NS

    import numpy as np
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import serve_bench

    from vllm_xmix import deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    import tempfile

    apps = serve_bench.apps_for(cfg, tempfile.mkdtemp(prefix="xmix-vecs-"))
    st = XmixState.build(parse_deployment(deploy(*apps, fused_writes=fused_writes)["xmix"]), cfg["num_hidden_layers"], cfg["hidden_size"],
                         torch.device("cpu"), 8192, 257, vocab_size=cfg["vocab_size"], max_model_len=4096)
    st.fused_mode = True

    def step(new, cached, finished=(), tokens=None):
        so = NS(finished_req_ids=set(finished), preempted_req_ids=set(), scheduled_new_reqs=new,
                scheduled_cached_reqs=NS(req_ids=list(cached), num_computed_tokens=[prompt + 10] * len(cached)))
        t = time.perf_counter()
        st.update_requests(so)
        ids = [r.req_id for r in new] + list(cached)
        st.fill(ids, np.asarray(tokens if tokens is not None else [1] * len(ids)), n_padded=len(ids) + prompt)
        st.snapshot()
        snap = st.pop_snapshot()
        if snap is not None:
            st.reads_of(snap)
        return time.perf_counter() - t

    print(f"{os.path.basename(model_dir.rstrip('/'))}: runtime host ms per step (mixed: 1 new request of "
          f"{prompt} tokens + {running} decoding; decode: {running + 1} decoding; fused_writes={fused_writes})")
    for app in [a.name for a in apps]:
        live, mixed, dec = [], [], []
        for i in range(n):
            rid = f"{app}-{i}"
            fin = live[:1] if len(live) >= running else []
            live = live[len(fin):]
            req = NS(req_id=rid, sampling_params=NS(extra_args={"xmix": {"apps": [{"name": app}]}}),
                     prompt_token_ids=list(range(prompt)), num_computed_tokens=0)
            mixed.append(step([req], live, fin, [prompt] + [1] * len(live)))
            live.append(rid)
            dec.append(step([], live))
        for r in live:
            st._forget(r)
        print(f"  {app:12s} mixed {np.median(mixed[50:]) * 1e3:6.3f}  decode {np.median(dec[50:]) * 1e3:6.3f}")
    return 0


def _steps(llm) -> int:
    st = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .compilation_config.static_forward_context["vllm_xmix"]
    return st.forwards


if __name__ == "__main__":
    sys.exit(main())
