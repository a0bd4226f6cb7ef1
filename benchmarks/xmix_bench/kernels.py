"""kernels: the steering kernels alone, as they run in a step.

``steer_add`` (the kernel of unconditional adds): ``--layers`` launches, one per layer, on
``h [T, d_model]``, with every token on the null slot (app off) and with every token steered;
against a plain in-place add of the same bytes (``h += v``, ``torch_add``) for reference.
Reported per token count T: microseconds per launch.

* On CUDA: the launches captured in one CUDA graph (``triton.testing.do_bench_cudagraph``),
  the Triton kernel (``--impl triton``, the default there) or the torch reference.
* On CPU (no GPU, or ``--device cpu``): wall time per launch (median of ``--cpu-repeats``
  timed rounds after one warm-up) of the torch reference (the default there), or of the Triton
  kernel under the interpreter (``TRITON_INTERPRET=1`` in the environment, ``--impl triton``;
  slow: use small ``--tokens``).

``--check``: the Triton kernel's output against the reference's for each T, off and on (max
absolute difference; 0 expected for the null slot).

``--kernel norm`` (CUDA): the residual add + RMSNorm that a residual-stream site's writes replace
with ``fused_writes="norm"`` (``kernels/add_rms_norm.py``), microseconds per launch per T:
``vllm`` (vLLM's CUDA ``fused_add_rms_norm``, what the plugin runs where no app is on),
``inductor`` (the same arithmetic compiled by torch.compile: what plain vLLM's compiled graph
runs), ``xmix_norm`` (the plugin's kernel without writes), ``xmix_off`` / ``xmix_on`` (one add
entry, every token on the null slot / steered; ``xmix_on_w16`` / ``xmix_on_w4``: steered, launched with
16 / 4 warps per program instead of 8), ``xmix_ablate_off`` / ``xmix_ablate`` (one projection
entry with the row semantics, a directional ablation: null slot / on).

``--kernel norm-launch`` (CUDA): what a step without CUDA graphs (more tokens than the largest
captured size) pays on the host per launch of those kernels: each one launched eagerly
``--calls`` times in a row on ``[T, D]``, host CPU microseconds per launch (the launching
thread's CPU time, so the device's own time does not count) and wall microseconds per launch
(a launch loop that outruns the device waits for it: wall above CPU means the device bounded
the loop). ``vllm`` (vLLM's CUDA ``fused_add_rms_norm`` called through ``torch.ops._C``: the
plugin's hosted norm with no app on), ``xmix_on`` (the plugin's kernel with one add entry, the
tokens steered) and ``xmix_ablate`` (one projection entry, row semantics), all through their
Python entry points as the hook op calls them.
"""

from __future__ import annotations

import json
import time

from . import common

HELP = "the steering kernel alone (CUDA-graph microbenchmark; torch reference or Triton interpreter on CPU)"


def add_arguments(p) -> None:
    p.add_argument("--tokens", help="comma-separated token counts T (default 1,8,64,512,8192 on CUDA, 1,8,64 on CPU)")
    p.add_argument("--kernel", choices=["add", "norm", "norm-launch"], default="add",
                   help="add: the steering add alone; norm: the add + RMSNorm kernel against vLLM's and Inductor's "
                        "(device time, CUDA graphs); norm-launch: host time per eager launch of those kernels")
    p.add_argument("--calls", type=int, default=200,
                   help="norm-launch: launches per timed loop (kept below CUDA's launch queue, ~1k, so that a "
                        "launch never waits for the device inside the loop)")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32, help="launches per measurement (one per layer)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--impl", choices=["auto", "triton", "reference"], default="auto",
                   help="auto: Triton on CUDA, the torch reference on CPU")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--cpu-repeats", type=int, default=5, help="timed rounds on CPU")
    p.add_argument("--check", action="store_true", help="compare the Triton kernel's output with the reference's")
    p.add_argument("--out", help="write the results (JSON) here")


def main(args) -> int:
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    impl = args.impl if args.impl != "auto" else ("triton" if device == "cuda" else "reference")
    tokens = [int(x) for x in (args.tokens or ("1,8,64,512,8192" if device == "cuda" else "1,8,64")).split(",")]
    dtype = getattr(torch, args.dtype)
    if args.kernel == "norm":
        if device != "cuda":
            raise SystemExit("--kernel norm: CUDA only (it compares against vLLM's CUDA kernel)")
        res = {str(T): bench_norm(T, args.d_model, args.layers, dtype) for T in tokens}
    elif args.kernel == "norm-launch":
        if device != "cuda":
            raise SystemExit("--kernel norm-launch: CUDA only (it times launches of CUDA kernels)")
        res = {str(T): bench_norm_launch(T, args.d_model, dtype, args.calls) for T in tokens}
    else:
        res = {str(T): bench(T, args.d_model, args.layers, impl, device, dtype, args.cpu_repeats) for T in tokens}
    out = {"kernel": args.kernel, "device": device, "impl": impl, "dtype": args.dtype, "d_model": args.d_model, "layers": args.layers,
           "us_per_launch": res, "commit": common.git_commit(), "date": common.today(),
           "command": common.command_line()}
    if args.check:
        out["triton_vs_reference_max_abs"] = {str(T): check(T, args.d_model, device, dtype) for T in tokens}
        print("TRITON_VS_REFERENCE", json.dumps(out["triton_vs_reference_max_abs"]))
    print("KERNEL_US_PER_LAUNCH", json.dumps(res))
    if args.out:
        common.write_json(args.out, out)
    return 0


def _inputs(T: int, D: int, device: str, dtype, layers: int = 1):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    hs = [torch.randn(T, D, generator=g).to(device=device, dtype=dtype) for _ in range(layers)]
    coef = torch.tensor([[0.0], [0.01]], device=device)
    vec = torch.randn(1, D, generator=g).to(device)
    ent = torch.tensor([0], dtype=torch.int32, device=device)
    return hs, coef, vec, ent


def _timer(device: str, repeats: int):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph  # ms per call of fn

    def cpu(fn) -> float:
        fn()  # warm-up (and, under the interpreter, compilation)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return common.median(times) * 1e3

    return cpu


def bench(T: int, D: int, layers: int, impl: str, device: str, dtype, repeats: int = 5) -> dict:
    """Microseconds per launch: app off (null slot), app on, and torch's in-place add."""
    import torch

    from vllm_xmix.kernels.steer_add import steer_add_reference, steer_add_triton

    kernel = steer_add_triton if impl == "triton" else steer_add_reference
    timer = _timer(device, repeats)
    hs, coef, vec, ent = _inputs(T, D, device, dtype, layers)
    out = {}
    for name, slot in (("off", 0), ("on", 1)):
        tok = torch.full((T,), slot, dtype=torch.int32, device=device)
        out[name] = timer(lambda: [kernel(h, tok, coef, ent, vec) for h in hs]) * 1e3 / layers
    vb = vec.to(dtype)
    out["torch_add"] = timer(lambda: [h.add_(vb) for h in hs]) * 1e3 / layers
    return {k: round(v, 2) for k, v in out.items()}


def _norm_args(D: int, dtype):
    """The norm kernels' other inputs on CUDA: ``weight`` [D] (ones), ``kinds`` int32 [1] of an
    add entry and ``proj`` of a projection entry (row semantics: a directional ablation),
    ``values`` float32 [1], and vLLM's ``fused_add_rms_norm`` op (None where vLLM's CUDA build is
    not importable here)."""
    import torch

    w = torch.ones(D, device="cuda", dtype=dtype)
    kinds = torch.zeros(1, dtype=torch.int32, device="cuda")
    proj = torch.ones(1, dtype=torch.int32, device="cuda")
    values = torch.zeros(1, dtype=torch.float32, device="cuda")
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        fused = torch.ops._C.fused_add_rms_norm
    except Exception as e:  # no vLLM CUDA build here
        print(f"vllm fused_add_rms_norm: not available ({e})")
        fused = None
    return w, kinds, proj, values, fused


def bench_norm(T: int, D: int, layers: int, dtype, eps: float = 1e-5) -> dict:
    """Microseconds per launch of the residual add + RMSNorm on ``[T, D]`` (module docstring),
    ``layers`` launches captured in one CUDA graph; a variant whose kernel is not available here
    (vLLM's ``_C`` ops) is left out."""
    import torch
    import triton.testing

    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_triton

    hs, coef, vec, ent = _inputs(T, D, "cuda", dtype, 2 * layers)
    xs, rs = hs[:layers], hs[layers:]
    w, kinds, proj, values, fused = _norm_args(D, dtype)
    timer = triton.testing.do_bench_cudagraph
    out = {}
    if fused is not None:
        out["vllm"] = timer(lambda: [fused(x, r, w, eps) for x, r in zip(xs, rs)])

    def native(x, r):
        z = (x.float() + r.float()).to(dtype)
        zf = z.float()
        return ((zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * w), z

    compiled = torch.compile(native, dynamic=False)
    out["inductor"] = timer(lambda: [compiled(x, r) for x, r in zip(xs, rs)])
    toks = {slot: torch.full((T,), slot, dtype=torch.int32, device="cuda") for slot in (0, 1)}
    out["xmix_norm"] = timer(lambda: [add_rms_norm_triton(x, r, w, eps, toks[0], coef, None, kinds, values, vec, False)
                                      for x, r in zip(xs, rs)])
    for name, slot, nw in (("xmix_off", 0, None), ("xmix_on", 1, None), ("xmix_on_w16", 1, 16), ("xmix_on_w4", 1, 4)):
        out[name] = timer(lambda: [add_rms_norm_triton(x, r, w, eps, toks[slot], coef, ent, kinds, values, vec, False,
                                                       num_warps=nw) for x, r in zip(xs, rs)])
    for name, slot in (("xmix_ablate_off", 0), ("xmix_ablate", 1)):
        out[name] = timer(lambda: [add_rms_norm_triton(x, r, w, eps, toks[slot], coef, ent, proj, values, vec, True)
                                   for x, r in zip(xs, rs)])
    return {k: round(v * 1e3 / layers, 2) for k, v in out.items()}


def bench_norm_launch(T: int, D: int, dtype, calls: int = 200, repeats: int = 20, eps: float = 1e-5) -> dict:
    """Host cost per eager launch of the hosted norm's kernels on ``[T, D]`` (module
    docstring): for each kernel, the median over ``repeats`` loops of ``calls`` launches of the
    launching thread's CPU microseconds per launch (``<name>_cpu_us``) and of the wall
    microseconds per launch, the device drained after each loop (``<name>_wall_us``). ``calls``
    stays below CUDA's launch queue (about 1024 entries): a launch into a full queue waits,
    spinning, and that wait would count as CPU time."""
    import torch

    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_triton

    (x, r), coef, vec, ent = _inputs(T, D, "cuda", dtype, 2)
    w, kinds, proj, values, fused = _norm_args(D, dtype)
    tok = torch.ones(T, dtype=torch.int32, device="cuda")
    fns = {} if fused is None else {"vllm": lambda: fused(x, r, w, eps)}
    fns["xmix_on"] = lambda: add_rms_norm_triton(x, r, w, eps, tok, coef, ent, kinds, values, vec, False)
    fns["xmix_ablate"] = lambda: add_rms_norm_triton(x, r, w, eps, tok, coef, ent, proj, values, vec, True)
    out = {}
    for name, fn in fns.items():
        fn()  # compile / load
        torch.cuda.synchronize()
        cpu, wall = [], []
        for _ in range(repeats):
            c, t = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            c = time.thread_time() - c
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t) / calls * 1e6)
            cpu.append(c / calls * 1e6)
        out[f"{name}_cpu_us"] = round(common.median(cpu), 2)
        out[f"{name}_wall_us"] = round(common.median(wall), 2)
    return out


def check(T: int, D: int, device: str, dtype) -> dict:
    """Max |triton - reference| after one call, app off and on."""
    import torch

    from vllm_xmix.kernels.steer_add import steer_add_reference, steer_add_triton

    (h,), coef, vec, ent = _inputs(T, D, device, dtype)
    out = {}
    for name, slot in (("off", 0), ("on", 1)):
        tok = torch.full((T,), slot, dtype=torch.int32, device=device)
        a, b = h.clone(), h.clone()
        steer_add_triton(a, tok, coef, ent, vec)
        steer_add_reference(b, tok, coef, ent, vec)
        out[name] = float((a.float() - b.float()).abs().max())
    return out
