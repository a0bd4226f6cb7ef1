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

``--vs-plain``: the whole engine step against vLLM without the plugin, in the default compiled
mode (no CUDA graphs on a CPU), with a serving-like arrival pattern: a 32-layer Llama config
(d_model 64, dummy weights, token-id prompts), a new request of 16-400 prompt tokens every
second step beside up to 32 decoding ones, ``max_num_batched_tokens`` 512 (chunked prefill).
One process without the plugin (``VLLM_PLUGINS=""``), one with serve_bench's deployment
(``--fused-writes``), each driving ``LLMEngine.step()`` under cProfile: wall ms per step that
schedules prompt tokens ("mixed", where a request's first token comes from) and per decode step,
and the functions whose *self* time per step grew most against the plain engine (where host
time goes that is not the hook ops' compute; generated Inductor code counted as one function).
It is the CPU stand-in for the +1.5 ms host time per mixed step seen in a GPU profile
(RESULTS.md, F3); compute is CPU compute here, so only which functions run carries over.

usage: python benchmarks/host_overhead.py [--batch 64] [--tokens 64] [--configs none,steer_all,probe_one,cast]
       python benchmarks/host_overhead.py --serving-deployment benchmarks/models/llama31_8b
       python benchmarks/host_overhead.py --vs-plain [--configs inactive,steer_all,probe_one] [--fused-writes adds]
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
    ap.add_argument("--configs", default="none,steer_all,probe_one,cast",
                    help="apps on per request (none: no app; --vs-plain: serve_bench's names, e.g. "
                         "inactive,steer_all,probe_one)")
    ap.add_argument("--serving-deployment", metavar="MODEL_DIR",
                    help="time the worker-side runtime alone with serve_bench.py's deployment for this config")
    ap.add_argument("--fused-writes", choices=["none", "adds", "all"], default="none",
                    help="with --serving-deployment: the deployment's fused_writes (adds/all: fill() also "
                         "writes the per-token fused coefficients)")
    ap.add_argument("--vs-plain", action="store_true",
                    help="whole engine steps, compiled, serving-like arrivals: the plugin's engine vs plain vLLM")
    ap.add_argument("--steps", type=int, default=300, help="with --vs-plain: measured engine steps per config")
    ap.add_argument("--_engine", help=argparse.SUPPRESS)  # internal: one engine of --vs-plain
    args = ap.parse_args()
    if args._engine:
        return engine_steps(args._engine, args.configs, args.fused_writes, args.steps)
    if args.vs_plain:
        return vs_plain(args.configs, args.fused_writes, args.steps)
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


def _vs_plain_model() -> str:
    """A 32-layer Llama config (d_model 64) for dummy weights, in a temp dir."""
    import json
    import tempfile

    d = tempfile.mkdtemp(prefix="xmix-host-")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=64,
               num_hidden_layers=32, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
               intermediate_size=128, max_position_embeddings=1024, rms_norm_eps=1e-5, torch_dtype="float32",
               tie_word_embeddings=False)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def engine_steps(spec: str, configs: str, fused_writes: str, n_steps: int) -> int:
    """One engine (``spec`` = "plain:MODEL_DIR" or "xmix:MODEL_DIR") driven step by step under
    cProfile; prints JSON (per config: median ms per mixed / decode step, self seconds per function
    and step) as the last line of stdout, after ``XMIX_JSON``."""
    import json
    import tempfile

    import numpy as np
    from vllm import LLM, SamplingParams

    kind, model = spec.split(":", 1)
    kw = {}
    names = ["plain"]
    if kind == "xmix":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import serve_bench

        from vllm_xmix import deploy

        apps = serve_bench.apps_for(json.load(open(os.path.join(model, "config.json"))),
                                    tempfile.mkdtemp(prefix="xmix-vecs-"))
        kw["additional_config"] = deploy(*apps, fused_writes=fused_writes)
        names = configs.split(",")
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              max_num_seqs=48, max_num_batched_tokens=512, seed=0, block_size=32, **kw)
    eng = llm.llm_engine
    out = {}

    def label(f, ln, fn):
        if "torchinductor" in f or "torch_compile_cache" in f:  # generated code: its file name is a hash
            return f"<inductor-generated>({fn})"
        f = f.split("site-packages" + os.sep, 1)[-1] if "site-packages" in f else os.path.basename(f)
        return f"{f}:{ln}({fn})"

    for name, warm in ((n, w) for n in names for w in (True, False)):  # each config warmed up first
        rng = np.random.default_rng(1)  # the same arrivals for every config
        extra = None if name in ("plain", "inactive", "none") else {"xmix": {"apps": [{"name": name}]}}
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, extra_args=extra)
        steps = 40 if warm else n_steps
        mixed, decode, k = [], [], 0
        prof = cProfile.Profile()
        for i in range(steps):
            new = i % 2 == 0
            if new:
                p = rng.integers(10, 1000, int(np.clip(rng.lognormal(5.0, 0.9), 16, 400))).tolist()
                eng.add_request(f"{name}-{warm}-{k}", {"prompt_token_ids": p}, sp)
                k += 1
            t = time.perf_counter()
            prof.enable()
            eng.step()
            prof.disable()
            (mixed if new else decode).append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        if warm:
            continue
        st = pstats.Stats(prof)
        own = {}
        for (f, ln, fn), (cc, nc, tt, ct, _) in st.stats.items():
            own[label(f, ln, fn)] = own.get(label(f, ln, fn), 0.0) + tt / steps
        out[name] = {"mixed_ms": float(np.median(mixed) * 1e3), "decode_ms": float(np.median(decode) * 1e3),
                     "self_s_per_step": own}
    print("XMIX_JSON " + json.dumps(out))
    return 0


def vs_plain(configs: str, fused_writes: str, n_steps: int) -> int:
    import json
    import subprocess

    model = _vs_plain_model()
    res = {}
    for spec, env in (("plain:" + model, {"VLLM_PLUGINS": ""}), ("xmix:" + model, {})):
        cmd = [sys.executable, os.path.abspath(__file__), "--_engine", spec, "--configs", configs,
               "--fused-writes", fused_writes, "--steps", str(n_steps)]
        p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("XMIX_JSON ")]
        if p.returncode or not line:
            sys.stderr.write(p.stderr[-4000:])
            raise SystemExit(f"host_overhead: the {spec.split(':')[0]} engine failed (rc {p.returncode})")
        res.update(json.loads(line[-1][len("XMIX_JSON "):]))
    base = res["plain"]
    print(f"32-layer Llama (d_model 64, dummy, compiled, CPU), fused_writes={fused_writes}, {n_steps} steps "
          "per config: median ms per step (ratio to plain)")
    print(f"  {'plain':10s} mixed {base['mixed_ms']:8.3f}            decode {base['decode_ms']:8.3f}")
    for name in configs.split(","):
        r = res[name]
        print(f"  {name:10s} mixed {r['mixed_ms']:8.3f} ({r['mixed_ms'] / base['mixed_ms'] - 1:+6.1%})  "
              f"decode {r['decode_ms']:8.3f} ({r['decode_ms'] / base['decode_ms'] - 1:+6.1%})")
        keys = set(r["self_s_per_step"]) | set(base["self_s_per_step"])
        grow = sorted(((r["self_s_per_step"].get(f, 0.0) - base["self_s_per_step"].get(f, 0.0), f) for f in keys),
                      reverse=True)
        print(f"      self time per step, all steps: {sum(r['self_s_per_step'].values()) * 1e3:.3f} ms "
              f"(plain {sum(base['self_s_per_step'].values()) * 1e3:.3f}); grown most:")
        for dv, f in grow[:12]:
            print(f"      {dv * 1e3:+8.4f} ms/step self  {f}")
    return 0


def _steps(llm) -> int:
    st = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .compilation_config.static_forward_context["vllm_xmix"]
    return st.forwards


if __name__ == "__main__":
    sys.exit(main())
