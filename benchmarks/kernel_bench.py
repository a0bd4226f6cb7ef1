"""Microbenchmark of the steer_add kernel alone, as it runs in a decode step: 32 launches (one per
layer) captured in a CUDA graph, bf16 h [T, 4096]; all tokens on the null slot (app off) vs all
tokens steered; against a plain in-place add of the same bytes (h += v) for reference."""

import json
import sys

import torch
import triton.testing

from vllm_xmix.kernels.steer_add import steer_add_triton


def bench(T: int, D: int = 4096, layers: int = 32) -> dict:
    dev = "cuda"
    hs = [torch.randn(T, D, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    coef = torch.tensor([[0.0], [0.01]], device=dev)
    vec = torch.randn(1, D, device=dev)
    ent = torch.tensor([0], dtype=torch.int32, device=dev)
    out = {}
    for name, slot in (("off", 0), ("on", 1)):
        tok = torch.full((T,), slot, dtype=torch.int32, device=dev)
        fn = lambda: [steer_add_triton(h, tok, coef, ent, vec) for h in hs]  # noqa: E731
        out[name] = triton.testing.do_bench_cudagraph(fn) * 1e3 / layers  # us per launch
    vb = vec.to(torch.bfloat16)
    out["torch_add"] = triton.testing.do_bench_cudagraph(lambda: [h.add_(vb) for h in hs]) * 1e3 / layers
    return {k: round(v, 2) for k, v in out.items()}


if __name__ == "__main__":
    res = {T: bench(T) for T in (1, 8, 64, 512, 8192)}
    print("KERNEL_US_PER_LAUNCH", json.dumps(res))
    if len(sys.argv) > 1:
        json.dump(res, open(sys.argv[1], "w"))
