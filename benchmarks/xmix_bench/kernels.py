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
"""

from __future__ import annotations

import json
import time

from . import common

HELP = "the steering kernel alone (CUDA-graph microbenchmark; torch reference or Triton interpreter on CPU)"


def add_arguments(p) -> None:
    p.add_argument("--tokens", help="comma-separated token counts T (default 1,8,64,512,8192 on CUDA, 1,8,64 on CPU)")
    p.add_argument("--kernel", choices=["add", "norm"], default="add",
                   help="add: the steering add alone; norm: the add + RMSNorm kernel against vLLM's and Inductor's")
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


def bench_norm(T: int, D: int, layers: int, dtype, eps: float = 1e-5) -> dict:
    """Microseconds per launch of the residual add + RMSNorm on ``[T, D]`` (module docstring),
    ``layers`` launches captured in one CUDA graph; a variant whose kernel is not available here
    (vLLM's ``_C`` ops) is left out."""
    import torch
    import triton.testing

    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_triton

    hs, coef, vec, ent = _inputs(T, D, "cuda", dtype, 2 * layers)
    xs, rs = hs[:layers], hs[layers:]
    w = torch.ones(D, device="cuda", dtype=dtype)
    kinds = torch.zeros(1, dtype=torch.int32, device="cuda")
    values = torch.zeros(1, dtype=torch.float32, device="cuda")
    timer = triton.testing.do_bench_cudagraph
    out = {}
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        fused = torch.ops._C.fused_add_rms_norm
        out["vllm"] = timer(lambda: [fused(x, r, w, eps) for x, r in zip(xs, rs)])
    except Exception as e:  # no vLLM CUDA build here
        print(f"vllm fused_add_rms_norm: not available ({e})")

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
    proj = torch.ones(1, dtype=torch.int32, device="cuda")  # row semantics, a projection (directional ablation)
    for name, slot in (("xmix_ablate_off", 0), ("xmix_ablate", 1)):
        out[name] = timer(lambda: [add_rms_norm_triton(x, r, w, eps, toks[slot], coef, ent, proj, values, vec, True)
                                   for x, r in zip(xs, rs)])
    return {k: round(v * 1e3 / layers, 2) for k, v in out.items()}


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
