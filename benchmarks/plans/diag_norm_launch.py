"""Where a hosted norm's host time goes with its sites on (CUDA): one timing per layer of the call.

Run on the GPU machine from the project root: ``python3 benchmarks/plans/diag_norm_launch.py``
(``$OUT``: where ``diag_norm_launch.json`` and ``diag_norm_profile.txt`` go). The engine is
``profile norm-call``'s (a 4-layer Llama config of width 64, float32, steer_all deployed, eager);
each line times ``DIAG_N`` calls (20,000) of one layer, the device drained at the end: vLLM's
norm, the hosted norm off and on, the op through torch's dispatcher, its Python body, the launch
object's lookup and call, its key and pointer arguments, the compiled launch, ``CompiledKernel.run``
alone, the same kernel through Triton's JIT; then cProfile of 3,000 hosted calls. On a CPU
(``TRITON_INTERPRET=1``, small ``DIAG_N``) it only checks that the script runs."""
import cProfile, io, json, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
from vllm.forward_context import set_forward_context
from benchmarks.xmix_bench import common
from benchmarks.xmix_bench.profile import norm_call_engine
from vllm_xmix import ops
from vllm_xmix.kernels import add_rms_norm as arn
from vllm_xmix.kernels import launch as ln

T = 8
llm, runner, norm, x, r = norm_call_engine(T)
w, eps = norm.weight.data, norm.variance_epsilon
st = common.xmix_state(llm)
var = st.variants
out = {}
N = int(os.environ.get("DIAG_N", "20000"))
if not torch.cuda.is_available():  # (a dry run of this script on a CPU)
    torch.cuda.synchronize = lambda: None
def timed(name, f, n=N):
    for _ in range(min(200, N)):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    out[name] = round((time.perf_counter() - t) / n * 1e6, 2)
    print(name, out[name], "us", flush=True)
with set_forward_context(None, runner.vllm_config):
    timed("vllm_norm", lambda: ops.plain_add_rms_norm(x, r, w, eps))
    var.set_variant(0)
    timed("hosted_off", lambda: norm(x, r))
    var.set_variant(var.all_mask)
    timed("hosted_on", lambda: norm(x, r))
    timed("op_on", lambda: torch.ops.vllm_xmix.hook_norm_(x, r, w, eps))
    timed("hook_norm_py_on", lambda: ops.hook_norm_(x, r, w, eps))
    plans = [(s, var.site_plan(s, 0)) for s in st.site_keys.sites_of(w) if s >= 0]
    plans = [(s, p) for s, p in plans if p is not None]
    p = plans[0][1]; q = plans[1][1] if len(plans) > 1 else None
    out["n_plans"] = len(plans)
    L = ops._norm_launch(st, p, q, True)
    timed("norm_launch_lookup", lambda: ops._norm_launch(st, p, q, True))
    timed("launcher_call", lambda: L(x, r, w, eps))
    key = L.key(x, r, w)
    k = arn._LAUNCH.compiled(key)
    out["compiled_hit"] = k is not None
    out["n_compiled"] = len(arn._LAUNCH._compiled)
    out["hooks"] = repr(ln._launch_hooks())
    timed("key", lambda: L.key(x, r, w))
    timed("ptr_args", lambda: L.ptr_args(x, r, w, eps))
    pa = L.ptr_args(x, r, w, eps)
    if k is not None:
        timed("launch_run", lambda: arn._LAUNCH.run(k, (T,), 0, pa))
        s = torch._C._cuda_getCurrentRawStream(0)
        timed("k_run", lambda: k.run(T, 1, 1, s, k.function, k.packed_metadata, None, None, None, *pa))
    args = L.args(x, r, w, eps)
    timed("jit", lambda: arn._add_rms_norm_kernel[(T,)](*args, num_warps=4), n=max(1, N // 4))
    timed("site_plan", lambda: var.site_plan(plans[0][0], 0))
    timed("state", lambda: ops._state())
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(min(3000, N)):
        norm(x, r)
    pr.disable()
    torch.cuda.synchronize()
    var.set_variant(0)
sio = io.StringIO()
pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
print(sio.getvalue())
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "diag_norm_launch.json"), "w") as f:
    json.dump(out, f, indent=1)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "diag_norm_profile.txt"), "w") as f:
    f.write(sio.getvalue())
print(json.dumps(out))
