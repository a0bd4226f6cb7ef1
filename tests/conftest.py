"""Shared fixtures: the tiny model, the HF-transformers oracle, vLLM engines (real, CPU, fp32)."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile

# Engine settings for CPU CI; set before vLLM is imported anywhere in this process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process (fast); subprocess tests use 1
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="xmix-vllm-cache-"))
# MLA models (DeepSeek-V2): vLLM has no MLA attention backend on CPU; this runs their MHA form
# (the same weights, the latent kv expanded per head), which vLLM reads when it builds the model
os.environ.setdefault("VLLM_MLA_DISABLE", "1")
os.environ.pop("VLLM_CPU_CI_ENV", None)  # keep Inductor for the compiled mode: where hooks vanish


def _bind_xdist_worker() -> str | None:
    """Under pytest-xdist (``-n N``), worker ``gwK`` binds its engines' OpenMP threads to core K mod
    the cores this process may use. vLLM's CPU default ("auto") reserves the last core and binds
    every engine to the same first core, so two workers would share one core and leave the other
    idle; one thread per worker keeps them from oversubscribing (the engine runs one thread per
    bound core either way). An explicit ``VLLM_CPU_OMP_THREADS_BIND`` is left as it is. Returns the
    binding set here, or None."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


#: the one-core binding of this pytest-xdist worker (None: not a worker, or the user's own binding)
WORKER_BIND = _bind_xdist_worker()

import numpy as np
import pytest
import torch

D_MODEL = 64
N_LAYERS = 4


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from vllm_xmix.tiny import build_tiny_model

    return build_tiny_model("llama", root=tmp_path_factory.mktemp("models") / "tiny-llama")


def unit_rms(seed: int, d: int = D_MODEL) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    return v / np.sqrt((v**2).mean())


# Deployment shared by the engine fixtures: two apps, different layers.
V_HAPPY = unit_rms(1)
V_SAD = unit_rms(2)
HAPPY_LAYERS = [1, 2]
SAD_LAYERS = list(range(N_LAYERS))
HAPPY_SCALE = 4.0
SAD_SCALE = 2.0


def deployment():
    from vllm_xmix import MIApp, deploy

    happy = MIApp("happy")
    happy.write("add", vector=V_HAPPY, scale=HAPPY_SCALE).layers(HAPPY_LAYERS).submodule("hook_resid_post")
    sad = MIApp("sad")
    sad.write("add", vector=V_SAD, scale=SAD_SCALE).layers("all")
    return deploy(happy, sad, fused_writes="adds")  # compiled engines: the adds fused into the graph


def app_deltas(apps: list[dict]) -> dict[int, np.ndarray]:
    """{layer: delta} that the request's apps add at blocks.{layer}.hook_resid_post."""
    table = {"happy": (V_HAPPY, HAPPY_LAYERS, HAPPY_SCALE), "sad": (V_SAD, SAD_LAYERS, SAD_SCALE)}
    out: dict[int, np.ndarray] = {}
    for a in apps:
        v, layers, default = table[a["name"]]
        s = a.get("scale", default)
        for L in a.get("layers", layers):
            out[L] = out.get(L, 0) + np.float32(s) * v
    return out


#: where each hook point lives in the HF model's decoder layer (``model.model.layers[L]``), per
#: family, for the oracle's plain hooks: the modules whose outputs are attn_out / mlp_out, the module
#: whose input is resid_mid (the stream after the attention's addition, which HF also keeps as the
#: residual: written in place there), and the router module whose output[0] is the router logits
HF_PATHS = {
    "llama": dict(attn_out="self_attn", mlp_out="mlp", resid_mid="post_attention_layernorm", router="mlp.gate"),
    "gemma2": dict(attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
                   resid_mid="pre_feedforward_layernorm", router=None),
    "olmo3": dict(attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm", resid_mid="mlp",
                  router=None),
    "gpt_oss": dict(attn_out="self_attn", mlp_out="mlp", resid_mid="post_attention_layernorm", router="mlp.router"),
}


def _sub(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


class HFOracle:
    """HF transformers causal LM with plain PyTorch forward hooks (the reference).

    ``greedy(ids, n, deltas)``: greedy decoding by full recompute (no KV cache), adding
    ``delta`` at TransformerLens hook points for every token position. ``deltas`` maps
    ``layer`` (meaning ``hook_resid_post``) or ``(layer, hook_name)`` to a ``[d_model]`` array.
    Where each hook lives in the HF layer (``paths``, default Llama's, see :data:`HF_PATHS`):

    - ``hook_resid_pre``: forward pre-hook on ``model.layers[L]`` adds to its hidden_states input;
    - ``hook_attn_out``: forward hook on the ``attn_out`` module (``self_attn``) adds to its output;
    - ``hook_resid_mid``: forward pre-hook on the ``resid_mid`` module (``post_attention_layernorm``)
      adds in place to its input, which HF's layer also keeps as the residual;
    - ``hook_mlp_out``: forward hook on the ``mlp_out`` module (``mlp``);
    - ``hook_resid_post``: forward hook on ``layers[L]`` adds to its output.

    ``router_bias(biases)`` adds a bias to the router logits inside the HF router's forward,
    before its softmax / top-k."""

    def __init__(self, model_dir: str, paths: dict | None = None, attn_implementation: str | None = None):
        from transformers import AutoModelForCausalLM

        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
        self.paths = paths or HF_PATHS["llama"]

    def router(self, L: int):
        """The HF router module of layer ``L``."""
        return _sub(self.model.model.layers[L], self.paths["router"])

    @contextlib.contextmanager
    def router_bias(self, biases: dict, seen: list | None = None):
        """Within the block: each layer ``L`` of ``biases`` ({L: [n_experts] tensor}) computes its
        router logits as ``F.linear(x, W, b) + bias`` (the HF router's own forward otherwise: its
        softmax / top-k see the biased logits); ``seen`` collects the output of each call."""
        import torch.nn.functional as F

        real = F.linear
        olds = {}
        for L, bias in biases.items():
            gate = self.router(L)
            olds[L] = gate.forward

            def fwd(*a, gate=gate, bias=bias, orig=gate.forward, **k):
                def linear(x, w, b=None):
                    out = real(x, w, b)
                    return out + bias if w.data_ptr() == gate.weight.data_ptr() and w.shape == gate.weight.shape else out

                F.linear = linear
                try:
                    out = orig(*a, **k)
                finally:
                    F.linear = real
                if seen is not None:
                    seen.append(out)
                return out

            gate.forward = fwd
        try:
            yield
        finally:
            for L, f in olds.items():
                self.router(L).forward = f

    def _register(self, L: int, hook: str, fn) -> list:
        """Hooks that replace the value x at (L, hook) by x + fn(x_full); x_full is the hook's
        value (for resid_mid: layer input + attention output)."""
        layer = self.model.model.layers[L]

        def first(out):
            return out[0] if isinstance(out, tuple) else out

        def replace(out, new):
            return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new

        if hook == "hook_resid_pre":
            def pre(mod, args, kwargs):
                if args:
                    return (args[0] + fn(args[0]),) + tuple(args[1:]), kwargs
                kwargs = dict(kwargs)
                kwargs["hidden_states"] = kwargs["hidden_states"] + fn(kwargs["hidden_states"])
                return args, kwargs

            return [layer.register_forward_pre_hook(pre, with_kwargs=True)]
        if hook in ("hook_attn_out", "hook_mlp_out", "hook_resid_post"):
            mod = {"hook_attn_out": _sub(layer, self.paths["attn_out"]), "hook_mlp_out": _sub(layer, self.paths["mlp_out"]),
                   "hook_resid_post": layer}[hook]
            return [mod.register_forward_hook(lambda m, a, out: replace(out, first(out) + fn(first(out))))]
        if hook == "hook_resid_mid":
            def mid(mod, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                x.add_(fn(x))  # in place: the layer's residual is this tensor too

            return [_sub(layer, self.paths["resid_mid"]).register_forward_pre_hook(mid, with_kwargs=True)]
        raise KeyError(hook)

    @torch.no_grad()
    def record(self, ids: list[int], reads: list[tuple[int, str]], deltas: dict | None = None,
               fns: dict | None = None) -> dict[tuple[int, str], np.ndarray]:
        """One forward over ``ids`` (prompt + generated[:-1]: the positions vLLM processed) with
        the same writes as :meth:`greedy`; returns the value at each ``(layer, hook)`` read,
        float32 ``[len(ids), d]``, seen after the writes at that hook (reads registered last).
        ``(L, "mlp.hook_router_logits")``: the router's logits ``[len(ids), n_experts]``."""
        got: dict = {}
        handles = self._writes(deltas, fns)
        for L, hook in reads:
            if hook == "mlp.hook_router_logits":
                gate = self.router(L)
                handles.append(gate.register_forward_hook(
                    lambda m, a, out, k=(L, hook): got.__setitem__(k, (out[0] if isinstance(out, tuple) else out)
                                                                   .reshape(len(ids), -1).float().numpy().copy())))
                continue

            def rec(x, k=(L, hook)):
                got[k] = x.reshape(len(ids), -1).float().numpy().copy()
                return torch.zeros_like(x)

            handles += self._register(L, hook, rec)
        try:
            self.model(torch.tensor([ids]))
        finally:
            for h in handles:
                h.remove()
        return got

    def _writes(self, deltas, fns) -> list:
        handles = []
        for key, d in (deltas or {}).items():
            L, hook = (key, "hook_resid_post") if isinstance(key, int) else key
            dt = torch.from_numpy(np.asarray(d, dtype=np.float32))
            handles += self._register(L, hook, lambda x, dt=dt: dt)
        for (L, hook), fl in (fns or {}).items():
            for f in fl:
                handles += self._register(L, hook, f)
        return handles

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], n: int, deltas: dict | None = None, fns: dict | None = None) -> list[int]:
        """``deltas``: {layer or (layer, hook): [d_model] array added}; ``fns``: {(layer, hook):
        [fn, ...]} with fn(x_full [.., d_model] tensor) -> delta, applied in order."""
        handles = self._writes(deltas, fns)
        try:
            ids = list(prompt_ids)
            for _ in range(n):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            return ids[len(prompt_ids):]
        finally:
            for h in handles:
                h.remove()


@pytest.fixture(scope="session")
def hf(tiny_llama) -> HFOracle:
    return HFOracle(tiny_llama)


PROMPTS = [
    [5, 17, 300, 42, 9],
    [100, 200, 300],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [900, 3, 450],
]


def make_llm(model: str, mode: str, **kw):
    from vllm import LLM

    args = dict(model=model, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
                enforce_eager=(mode == "eager"))
    args.update(kw)
    return LLM(**args)


def close_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@pytest.fixture(scope="module", params=["eager", pytest.param("compiled", marks=pytest.mark.one_version)])
def steer_llm(request, tiny_llama):
    """An engine with the 'happy' and 'sad' apps deployed, enforce_eager or torch.compile."""
    llm = make_llm(tiny_llama, request.param, additional_config=deployment())
    llm.mode = request.param
    yield llm
    close_llm(llm)


@contextlib.contextmanager
def running_server(args: list[str], log, env: dict | None = None, proc_out: list | None = None):
    """A vLLM OpenAI server started as ``python <args> --port P --host 127.0.0.1`` (its output
    in ``log``, a path; ``env``: variables set for it on top of this process's), yielding its URL
    once ``/health`` answers; stopped on exit (SIGTERM, then SIGKILL after 30 s). ``proc_out``: a
    list that receives the server's ``Popen`` (its pid, its exit status after the block).

    The port is a free one when chosen, but the server binds it only after its start-up (~10 s),
    and meanwhile another process (the other test worker's engine, its ZMQ and gloo sockets) can
    take it: a server that exits with ``Address already in use`` is started again on another port
    (three tries)."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}, **(env or {})}
    proc = None
    try:
        for attempt in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable] + args + ["--port", str(port), "--host", "127.0.0.1"]
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                if proc.poll() is not None:
                    out = open(log).read()
                    if "Address already in use" in out[-4000:] and attempt < 2:
                        break  # (the port was taken before the server bound it: another port)
                    raise RuntimeError(f"{' '.join(args[:3])} exited:\n" + out[-4000:])
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except Exception:
                    time.sleep(1)
            else:
                raise RuntimeError(f"{' '.join(args[:3])} did not come up:\n" + open(log).read()[-4000:])
            if proc.poll() is None:
                break
        if proc_out is not None:
            proc_out.append(proc)
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``one_version`` run only on the primary vLLM version (``PRIMARY_VLLM``, 0.26.x):
    on another tested version they are skipped, naming the marker (what runs there: every patched
    vLLM path at least once; CONTRIBUTING.md, Running the tests), unless ``XMIX_ALL_VERSIONS=1``."""
    from vllm_xmix._vllm_compat.core import PRIMARY_VLLM, version_series, vllm_version

    v = vllm_version()
    if version_series(v) == PRIMARY_VLLM or os.environ.get("XMIX_ALL_VERSIONS") == "1":
        return  # (XMIX_ALL_VERSIONS=1: the whole suite on any tested version)
    skip = pytest.mark.skip(reason=f"one_version: runs only on the primary vLLM {PRIMARY_VLLM[0]}.{PRIMARY_VLLM[1]}.x "
                                   f"(this is vLLM {v})")
    for item in items:
        if item.get_closest_marker("one_version") is not None:
            item.add_marker(skip)


def unserved_here(arch: str) -> str | None:
    """Why the installed vLLM does not serve HF architecture ``arch`` with its adapter's classes
    (``_vllm_compat.versions``), or None: the tests of that family are skipped with this reason."""
    from vllm_xmix._vllm_compat.core import vllm_version
    from vllm_xmix._vllm_compat.versions import table

    why = table().unserved_architectures.get(arch)
    return None if why is None else f"{arch} on vLLM {vllm_version()}: {why} (refusal: tests/test_plugin.py)"
