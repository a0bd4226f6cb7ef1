"""Router steering (SteerMoE-style) on Mixtral: ``router_bias`` at ``blocks.{L}.mlp.hook_router_logits``
on real vLLM (CPU, fp32, eager and compiled) against HF transformers with the bias added to the
router logits before softmax/top-k."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from conftest import PROMPTS, close_llm, make_llm

N = 8
MASK = [0.0, 0.0, -math.inf, 0.0]  # expert 2 off
BOOST = [4.0, 0.0, 0.0, -1.0]
PROBE_W = [0.5, -1.0, 0.25, 2.0]


def deployment(files=None):
    """The apps on the Mixtral engine; ``files`` (a folder): two more masks read from files, a
    .npy and a .safetensors, which together mask every expert at layer 3."""
    from vllm_xmix import MIApp, deploy

    m = MIApp("mask2")
    m.write("router_bias", vector=MASK).layers("all").submodule("mlp.hook_router_logits")
    b = MIApp("boost")
    b.write("router_bias", vector=BOOST, scale=1.0).layers([1, 2]).submodule("blocks.{L}.mlp.hook_router_logits")
    rest = MIApp("mask013")  # with mask2, every expert would be masked
    rest.write("router_bias", vector=[-math.inf, -math.inf, 0.0, -math.inf]).layers([3]).submodule("mlp.hook_router_logits")
    r = MIApp("rlog")  # reads of the router logits: capture and a probe over experts
    r.read("capture", name="logits").layers([1, 3]).submodule("mlp.hook_router_logits")
    r.read("linear_probe", weight=PROBE_W, bias=0.5).layers([1, 3]).submodule("mlp.hook_router_logits")
    more = []
    if files is not None:
        import numpy as np
        from safetensors.numpy import save_file

        np.save(files / "m01.npy", np.array([-math.inf, -math.inf, 0.0, 0.0], dtype=np.float32))
        save_file({"mask": np.array([0.0, 0.0, -math.inf, -math.inf], dtype=np.float32)}, str(files / "m23.safetensors"))
        f01, f23 = MIApp("file01"), MIApp("file23")
        f01.write("router_bias", vector=str(files / "m01.npy")).layers([3]).submodule("mlp.hook_router_logits")
        f23.write("router_bias", vector=str(files / "m23.safetensors"), key="mask").layers([3]) \
            .submodule("mlp.hook_router_logits")
        more = [f01, f23]
    return deploy(m, b, rest, r, *more)


@contextlib.contextmanager
def hf_router_bias(model, biases: dict[int, torch.Tensor], seen: list | None = None):
    """Replace each MixtralTopKRouter.forward by the same computation with ``logits + bias``."""
    import torch.nn.functional as F

    olds = {}
    for L, b in biases.items():
        gate = model.model.layers[L].mlp.gate
        olds[L] = gate.forward

        def fwd(hidden_states, gate=gate, b=b):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden_states, gate.weight) + b
            probs = torch.softmax(logits.float(), dim=-1)
            top_v, top_i = torch.topk(probs, gate.top_k, dim=-1)
            top_v /= top_v.sum(dim=-1, keepdim=True)
            if seen is not None:
                seen.append(top_i)
            return logits, top_v, top_i

        gate.forward = fwd
    try:
        yield
    finally:
        for L, f in olds.items():
            model.model.layers[L].mlp.gate.forward = f


@pytest.fixture(scope="module", params=["eager", pytest.param("compiled", marks=pytest.mark.one_version)])
def moe(request, tmp_path_factory):
    from conftest import HFOracle

    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model("mixtral", root=tmp_path_factory.mktemp("mixtral") / "tiny-mixtral")
    llm = make_llm(model, request.param, additional_config=deployment(tmp_path_factory.mktemp("masks")))
    yield llm, HFOracle(model)
    close_llm(llm)


def _gen(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _sp(apps):
    from vllm_xmix import SamplingParams

    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=apps)


def test_router_bias_equals_hf(moe):
    llm, hf = moe
    plain = [hf.greedy(p, N) for p in PROMPTS]
    mask = {L: torch.tensor(MASK) for L in range(4)}
    boost = {L: torch.tensor(BOOST) for L in (1, 2)}
    seen = []
    with hf_router_bias(hf.model, mask, seen):
        want_mask = [hf.greedy(p, N) for p in PROMPTS]
    assert all(not (t == 2).any() for t in seen), "oracle: a -inf expert must never be in the top-k"
    with hf_router_bias(hf.model, boost):
        want_boost = [hf.greedy(p, N) for p in PROMPTS]
    assert _gen(llm, _sp(None)) == plain
    assert _gen(llm, _sp(["mask2"])) == want_mask
    assert _gen(llm, _sp(["boost"])) == want_boost
    assert want_mask != plain and want_boost != plain


def test_masked_and_unmasked_requests_share_a_batch(moe):
    llm, hf = moe
    mask = {L: torch.tensor(MASK) for L in range(4)}
    with hf_router_bias(hf.model, mask):
        want_mask = [hf.greedy(p, N) for p in PROMPTS]
    plain = [hf.greedy(p, N) for p in PROMPTS]
    params = [_sp(["mask2"] if i % 2 else None) for i in range(len(PROMPTS))]
    got = _gen(llm, params)
    assert got == [want_mask[i] if i % 2 else plain[i] for i in range(len(PROMPTS))]


def test_router_bias_errors(tiny_llama):
    from vllm_xmix import MIApp, XmixSpecError, deploy

    a = MIApp("r")
    a.write("router_bias", vector=MASK).layers("all").submodule("hook_resid_post")
    with pytest.raises(XmixSpecError, match=r"hook: a 'router_bias' write goes to 'mlp.hook_router_logits' \(got 'hook_resid_post'\)"):
        deploy(a)
    b = MIApp("r")
    b.write("add", vector=[1.0] * 4).submodule("mlp.hook_router_logits")
    with pytest.raises(XmixSpecError, match=r"kind: only 'router_bias' writes at 'mlp.hook_router_logits' \(got 'add'\)"):
        deploy(b)
    c = MIApp("r")
    c.write("add", vector=[-math.inf] + [0.0] * 63)
    with pytest.raises(XmixSpecError, match=r"vector: contains -inf \(allowed only in router_bias masks\)"):
        deploy(c)
    # a dense model has no router: an error at engine start, not a no-op
    d = MIApp("r")
    d.write("router_bias", vector=MASK).submodule("mlp.hook_router_logits")
    with pytest.raises(ValueError, match=r"hook: 'mlp.hook_router_logits' is not available on LlamaForCausalLM"):
        make_llm(tiny_llama, "eager", additional_config=deploy(d))


def test_router_requests_that_would_produce_nan_are_refused(moe):
    """A negative scale on a -inf mask, or masks that together cover every expert, would give NaN
    router weights (and NaN in the KV cache that later requests reuse): refused when added."""
    llm, hf = moe
    plain = [hf.greedy(p, N) for p in PROMPTS]
    with pytest.raises(ValueError, match=r"mi_apps\[0\]\.scale: must be >= 0 for app 'mask2'"):
        _gen(llm, _sp([{"name": "mask2", "scale": -1.0}]))
    with pytest.raises(ValueError, match=r"mi_apps: the selected apps mask every expert at layer 3"):
        _gen(llm, _sp(["mask2", "mask013"]))
    # each alone is fine; on other layers they do not overlap
    assert _gen(llm, _sp([{"name": "mask2", "layers": [0, 1, 2]}, "mask013"])) != plain
    assert _gen(llm, _sp(None)) == plain  # and the engine still serves, unpolluted
    # masks read from files are checked as inline ones are (.npy and .safetensors)
    with pytest.raises(ValueError, match=r"mi_apps: the selected apps mask every expert at layer 3"):
        _gen(llm, _sp(["file01", "file23"]))
    with pytest.raises(ValueError, match=r"mi_apps\[0\]\.scale: must be >= 0 for app 'file23'"):
        _gen(llm, _sp([{"name": "file23", "scale": -1.0}]))
    assert _gen(llm, _sp(["file01"])) != plain and _gen(llm, _sp(["file23"])) != plain
    assert _gen(llm, _sp(None)) == plain


def test_router_deployment_errors():
    from vllm_xmix import MIApp, XmixSpecError, deploy

    a = MIApp("r")
    a.write("router_bias", vector=[-math.inf] * 4).submodule("mlp.hook_router_logits")
    with pytest.raises(XmixSpecError, match=r"vector: masks every expert"):
        deploy(a)
    b = MIApp("r")
    b.write("router_bias", vector=MASK, scale=-1.0).submodule("mlp.hook_router_logits")
    with pytest.raises(XmixSpecError, match=r"scale: must be >= 0 for a router_bias with -inf masks"):
        deploy(b)


def test_router_logit_reads_equal_hf(moe):
    """Reads at mlp.hook_router_logits see the logits after the router writes (boost at layer 1,
    none at layer 3), one row per processed token, within 1e-4 relative of HF."""
    import numpy as np
    from test_hooks import close

    llm, hf = moe
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _sp(["boost", "rlog"]), use_tqdm=False)
    boost = {L: torch.tensor(BOOST) for L in (1, 2)}
    for o, p in zip(outs, PROMPTS):
        ids = list(p) + list(o.outputs[0].token_ids)[:-1]
        with hf_router_bias(hf.model, boost):
            assert list(o.outputs[0].token_ids) == hf.greedy(p, N)
            rec = hf.record(ids, [(1, "mlp.hook_router_logits"), (3, "mlp.hook_router_logits")])
        for L in (1, 3):
            x = rec[(L, "mlp.hook_router_logits")]
            assert x.shape == (len(ids), 4)
            close(o.mi_results["rlog"]["logits"][L], x, f"logits@{L}")
            close(o.mi_results["rlog"]["probe"][L], x.astype(np.float64) @ np.array(PROBE_W) + 0.5, f"probe@{L}")
