"""Tensor parallelism on CPU: real vLLM engines with ``tensor_parallel_size=2`` (eager, fp32, tiny
Llama and tiny Mixtral; two worker processes each, vLLM's CPU communicator) against the HF oracle
with plain hooks and, for Llama, against a one-rank engine with the same deployment.

What must hold at TP=2 (the residual stream, the sub-layer outputs after vLLM's all-reduce and
the router logits are replicated on every rank, and every rank applies the same writes to its
replica):
- every write kind at every hook point gives HF's tokens (a write applied once per rank, i.e.
  twice, gives other tokens: checked against HF with the doubled vector);
- probes, captures, SEAL and CAST conditions, latches and their trigger records equal HF / the
  one-rank engine;
- read values come back once per request (one value per processed position), from one rank:
  the other rank takes no snapshot;
- every rank checked that its hook sites see the whole, replicated tensor
  (``runtime.replicas``); an app replaced through ``collective_rpc("xmix_admin")`` reaches both
  ranks;
- Mixtral: router biases, router-logit reads and an add at mlp_out (after ``FusedMoE``'s
  all-reduce) equal HF;
- pipeline parallelism is refused at engine configuration.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import WORKER_BIND, close_llm, make_llm, unit_rms
from test_conditions import PROMPTS as COND_PROMPTS
from test_conditions import deployment as cond_deployment
from test_conditions import ref as cond_ref
from test_conditions import thresholds  # noqa: F401  (fixture)
from test_hooks import HOOKS, PROJ, PROMPTS, READS, check_reads, close, deltas, hook_apps, proj_fns
from test_latch import LAYER as LATCH_LAYER
from test_latch import SCALE as LATCH_SCALE
from test_latch import V as LATCH_V
from test_latch import WRITE_LAYERS as LATCH_WRITE_LAYERS
from test_latch import hf_latch, new_maximum, peaking_direction

from vllm_xmix._vllm_compat.introspection import EXTENSION

pytestmark = [pytest.mark.tp, pytest.mark.one_version]

N = 8
LATCH_PROMPT = [int(x) for x in np.random.default_rng(21).integers(3, 1000, size=37)]
LATCH_N = 16
NEW_ATTN = unit_rms(77)  # the vector "attn" gets through the admin call


@pytest.fixture(scope="module")
def latch_case(hf):
    """A probe direction at blocks.1.hook_resid_post whose values on LATCH_PROMPT's greedy
    continuation first cross a threshold at a generated position (test_latch's construction)."""
    P = len(LATCH_PROMPT)
    w, vals, plain = peaking_direction(hf, LATCH_PROMPT, LATCH_N)
    q, thr = new_maximum(vals, P + 2, len(vals))
    gen, probe, q_hf = hf_latch(hf, LATCH_PROMPT, w, thr, n=LATCH_N)
    assert q_hf == q and gen != plain
    return dict(w=w, thr=float(thr), q=q, gen=gen, probe=probe, plain=plain)


def deployment(thr, latch):
    """Every write kind at every hook point, probes and captures at every hook point
    (``test_hooks``), SEAL and CAST apps (``test_conditions``), a latched add, one spare copy per
    app (``reserve.versions``) for the admin call."""
    from vllm_xmix import MIApp, deploy

    la = MIApp("latch")
    la.read("linear_probe", weight=latch["w"], name="probe").layers([LATCH_LAYER]).on(">", latch["thr"],
                                                                                      action="latch")
    la.write("add", vector=LATCH_V, scale=LATCH_SCALE).layers(LATCH_WRITE_LAYERS).cond(latch="probe")
    cond_apps = cond_deployment(*thr)["xmix"]["apps"]
    cfg = deploy(*hook_apps(), la, fused_writes="auto")
    cfg["xmix"]["apps"] += cond_apps
    cfg["xmix"]["reserve"] = {"versions": 1}
    return cfg


@pytest.fixture(scope="module")
def tp_env():
    """vLLM's CPU workers bind their OpenMP threads per rank: one core each (the default, 'auto',
    wants one NUMA node per rank). A binding the user set is kept; a pytest-xdist worker's
    one-core binding (conftest.WORKER_BIND) is replaced, since it would give two ranks one list."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if old is None or old == WORKER_BIND:
        n = os.cpu_count() or 2
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if n >= 2 else "nobind"
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


@pytest.fixture(scope="module")
def one_rank(tiny_llama, thresholds, latch_case):  # noqa: F811
    """Results of the one-rank engine for the cases compared with TP=2 (the engine is closed
    before the two-rank one starts)."""
    llm = make_llm(tiny_llama, "eager", additional_config=deployment(thresholds, latch_case))
    try:
        return {"latch": run(llm, [LATCH_PROMPT], ["latch"], LATCH_N),
                "all": run(llm, PROMPTS, list(READS) + ["rd_pos", "pre", "attn", "mid", "mlp", "post"])}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def tp(tiny_llama, thresholds, latch_case, one_rank, tp_env):  # noqa: F811
    llm = make_llm(tiny_llama, "eager", additional_config=deployment(thresholds, latch_case),
                   tensor_parallel_size=2, worker_extension_cls=EXTENSION)
    yield llm
    close_llm(llm)


def run(llm, prompts, apps, n=N):
    from vllm_xmix import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, mi_apps=apps)
    return llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)


def toks(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_is_two_ranks_and_every_rank_checked_its_sites(tp):
    pc = tp.llm_engine.vllm_config.parallel_config
    assert pc.tensor_parallel_size == 2
    assert tp.llm_engine.vllm_config.additional_config["xmix"]["fused_writes"] == "none"  # auto under TP
    run(tp, PROMPTS[:1], None, 2)  # the check runs at the first forward
    counts = tp.collective_rpc("xmix_counts")
    assert len(counts) == 2 and all(c["deployed"] for c in counts)
    assert [c["replicas_checked"] for c in counts] == [1, 1]


def test_each_write_at_each_hook_point_equals_hf_once(tp, hf):
    """Adds at every hook point, ablations and clamps: HF's tokens. An add applied on each rank
    before the reduction would count twice: HF with twice the vector gives other tokens here."""
    plain = [hf.greedy(p, N) for p in PROMPTS]
    assert toks(run(tp, PROMPTS, None)) == plain
    for name in HOOKS:
        want = [hf.greedy(p, N, deltas([name])) for p in PROMPTS]
        assert toks(run(tp, PROMPTS, [name])) == want, name
        assert want != plain, f"{name}: the write must change this tiny model's output"
        if name in ("attn", "mlp"):  # the sub-layer outputs vLLM all-reduces
            twice = [hf.greedy(p, N, deltas([name], 2 * 3.0)) for p in PROMPTS]
            assert twice != want, f"{name}: a doubled write must change the output too"
    for name in PROJ:
        want = [hf.greedy(p, N, fns=proj_fns([name])) for p in PROMPTS]
        assert toks(run(tp, PROMPTS, [name])) == want, name
        assert want != plain, name


def test_reads_equal_hf_and_one_rank_and_come_back_once(tp, hf, one_rank):
    """Probes and captures at every hook point beside adds at every hook point, in one request:
    HF's values; the one-rank engine's tokens and values; one value per processed position (the
    other rank's values never travel: it took no snapshot)."""
    names = list(READS) + ["rd_pos", "pre", "attn", "mid", "mlp", "post"]
    before = tp.collective_rpc("xmix_counts")
    outs = run(tp, PROMPTS, names)
    after = tp.collective_rpc("xmix_counts")
    d = deltas(["pre", "attn", "mid", "mlp", "post"])
    assert toks(outs) == [hf.greedy(p, N, d) for p in PROMPTS] == toks(one_rank["all"])
    for o, q, o1 in zip(outs, PROMPTS, one_rank["all"]):
        check_reads(o, q, hf, list(READS), d)  # lengths: P + N - 1 values per probe and capture
        assert o.mi_results["rd_pos"]["gen"].shape == (N, 64)
        assert o.mi_results["rd_pos"]["last"].shape == (64,)
        assert o.mi_results.keys() == o1.mi_results.keys()
        for app, reads in o.mi_results.items():
            for read, v in reads.items():
                for L, arr in (v.items() if isinstance(v, dict) else [(None, v)]):
                    ref = o1.mi_results[app][read]
                    ref = ref[L] if L is not None else ref
                    assert arr.shape == ref.shape, (app, read, L)
                    close(arr.reshape(len(arr), -1) if arr.ndim else arr[None],
                          ref.reshape(len(ref), -1) if ref.ndim else ref[None], f"{app}.{read}@{L}")
    taken = [a["snapshots_taken"] - b["snapshots_taken"] for a, b in zip(after, before)]
    assert taken[0] > 0 and taken[1] == 0, taken
    idle = tp.collective_rpc("xmix_counts")
    assert all(c["snapshots_pending"] == 0 and c["step_reads"] == 0 for c in idle)


@pytest.mark.parametrize("name", ["seal", "seal_prev", "seal_gen", "cast", "cast_tok"])
def test_conditions_equal_hf(tp, hf, thresholds, name):  # noqa: F811
    want = [cond_ref(hf, name, p, thresholds) for p in COND_PROMPTS]
    outs = run(tp, COND_PROMPTS, [name], 10)
    assert toks(outs) == want
    assert want != [cond_ref(hf, None, p, thresholds) for p in COND_PROMPTS], name


def test_latch_equals_hf_and_one_rank(tp, latch_case, one_rank):
    o = run(tp, [LATCH_PROMPT], ["latch"], LATCH_N)[0]
    o1 = one_rank["latch"][0]
    assert list(o.outputs[0].token_ids) == latch_case["gen"] == list(o1.outputs[0].token_ids)
    got = o.mi_results["latch"]["probe"]
    assert len(got) == len(LATCH_PROMPT) + LATCH_N - 1
    close(got[:, None], np.asarray(latch_case["probe"])[:, None], "latch.probe")
    trig, trig1 = o.mi_results["latch"]["triggers"], o1.mi_results["latch"]["triggers"]
    assert [{k: v for k, v in t.items() if k != "value"} for t in trig] == \
        [{k: v for k, v in t.items() if k != "value"} for t in trig1]
    assert [t["position"] for t in trig] == [latch_case["q"]] and trig[0]["action"] == "latch"
    # the value at the crossing: fp32 sums in another order (the all-reduce) from the one rank's
    np.testing.assert_allclose(trig[0]["value"], trig1[0]["value"], rtol=1e-5)


def test_admin_change_reaches_every_rank(tp, hf):
    """An app replaced through vLLM's ``collective_rpc("xmix_admin")`` (what ``POST
    /v1/mi/apps/{name}`` sends) is applied by both workers; requests after it run the new vector
    on both ranks: HF's tokens with it."""
    from vllm_xmix.validation.admin import commit_change, prepare_change

    cfg = tp.llm_engine.vllm_config
    app = next(a for a in cfg.additional_config["xmix"]["apps"] if a["name"] == "attn")
    body = {"ops": [{**op, "vector": NEW_ATTN.tolist()} for op in app["ops"]]}
    ch = prepare_change(cfg, "replace", "attn", body)
    results = tp.collective_rpc("xmix_admin", args=({**ch.payload, "live": []},))
    assert len(results) == 2 and all(r.get("ok") for r in results), results
    commit_change(cfg, ch)
    layers = HOOKS["attn"][1]
    want = [hf.greedy(p, N, {(L, "hook_attn_out"): np.float32(3.0) * NEW_ATTN for L in layers}) for p in PROMPTS]
    assert toks(run(tp, PROMPTS, ["attn"])) == want
    assert want != [hf.greedy(p, N, deltas(["attn"])) for p in PROMPTS]
    counts = tp.collective_rpc("xmix_counts")
    assert counts[0]["versions_held"] == counts[1]["versions_held"]


def test_pipeline_parallelism_is_refused(tiny_llama):
    from vllm_xmix import MIApp, XmixSpecError, deploy

    a = MIApp("a")
    a.write("add", vector=unit_rms(1), scale=1.0).layers([1])
    with pytest.raises(XmixSpecError, match="pipeline parallelism"):
        make_llm(tiny_llama, "eager", additional_config=deploy(a), pipeline_parallel_size=2)


# ---------------------------------------------------------------- the replica check itself


def _stats(x: torch.Tensor) -> list[float]:
    x = x.double()
    return [float(x.shape[-1]), float(x.sum()), float(x.square().sum()), float(x.abs().sum())]


def test_replica_check_compares_every_site():
    """``runtime.replicas.compare_replicas`` on the records of two ranks: identical replicas (and
    a rounding difference) pass; a partial sum (each rank's half of an all-reduce), a sharded
    width, and values finite on one rank only are refused, naming the site."""
    from vllm_xmix.runtime.replicas import compare_replicas

    g = torch.Generator().manual_seed(0)
    full = torch.randn(7, 64, generator=g)
    half = torch.randn(7, 64, generator=g)
    names = {0: "blocks.1.hook_attn_out", 1: "blocks.2.hook_resid_post"}

    def two(a0, a1, b0, b1):
        return torch.tensor([[_stats(a0), _stats(b0)], [_stats(a1), _stats(b1)]], dtype=torch.float64)

    compare_replicas(two(full, full, half, half), [64, 64], names)
    compare_replicas(two(full, full * (1 + 1e-7), half, half), [64, 64], names)
    with pytest.raises(RuntimeError, match=r"blocks\.2\.hook_resid_post.*different values"):
        compare_replicas(two(full, full, half, full - half), [64, 64], names)
    with pytest.raises(RuntimeError, match=r"blocks\.1\.hook_attn_out.*widths \[32, 32\]"):
        compare_replicas(two(full[:, :32], full[:, 32:], half, half), [64, 64], names)
    nan = full.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite on some ranks"):
        compare_replicas(two(nan, full, half, half), [64, 64], names)
    compare_replicas(two(nan, nan, half, half), [64, 64], names)  # a model's NaN, alike on both
    unrecorded = two(full, full, half, half)
    unrecorded[:, 1] = 0.0
    compare_replicas(unrecorded, [64, 64], names)


# ---------------------------------------------------------------- MoE: the router hook at TP=2


MOE_MLP = unit_rms(88)


@pytest.fixture(scope="module")
def moe_tp(tmp_path_factory, tp_env):
    """Tiny Mixtral at TP=2 (each expert's MLP sharded over the ranks, ``FusedMoE`` reduces its
    output; the gate is replicated): router biases, router-logit reads, an add at mlp_out."""
    from conftest import HFOracle
    from test_router import deployment as router_deployment

    from vllm_xmix import MIApp, deploy
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model("mixtral", root=tmp_path_factory.mktemp("mixtral") / "tiny-mixtral")
    cfg = router_deployment()
    a = MIApp("moe_out")
    a.write("add", vector=MOE_MLP, scale=3.0).layers([1, 2]).submodule("hook_mlp_out")
    cfg["xmix"]["apps"] += deploy(a)["xmix"]["apps"]
    llm = make_llm(model, "eager", additional_config=cfg, tensor_parallel_size=2, worker_extension_cls=EXTENSION)
    yield llm, HFOracle(model)
    close_llm(llm)


def test_moe_router_bias_reads_and_mlp_out_equal_hf(moe_tp):
    from test_router import BOOST, MASK, hf_router_bias

    llm, hf = moe_tp
    plain = [hf.greedy(p, N) for p in PROMPTS]
    assert toks(run(llm, PROMPTS, None)) == plain
    with hf_router_bias(hf.model, {L: torch.tensor(MASK) for L in range(4)}):
        want_mask = [hf.greedy(p, N) for p in PROMPTS]
    with hf_router_bias(hf.model, {L: torch.tensor(BOOST) for L in (1, 2)}):
        want_boost = [hf.greedy(p, N) for p in PROMPTS]
    assert toks(run(llm, PROMPTS, ["mask2"])) == want_mask != plain
    assert toks(run(llm, PROMPTS, ["boost"])) == want_boost != plain
    d = {(L, "hook_mlp_out"): np.float32(3.0) * MOE_MLP for L in (1, 2)}
    want = [hf.greedy(p, N, d) for p in PROMPTS]
    twice = [hf.greedy(p, N, {k: 2 * v for k, v in d.items()}) for p in PROMPTS]
    assert toks(run(llm, PROMPTS, ["moe_out"])) == want != plain
    assert twice != want
    outs = run(llm, PROMPTS, ["rlog"])
    assert toks(outs) == plain
    for o, q in zip(outs, PROMPTS):
        ids = list(q) + list(o.outputs[0].token_ids)[:-1]
        rec = hf.record(ids, [(L, "mlp.hook_router_logits") for L in (1, 3)])
        for L in (1, 3):
            got = o.mi_results["rlog"]["logits"][L]
            assert got.shape == (len(ids), 4)
            close(got, rec[(L, "mlp.hook_router_logits")], f"router logits @{L}")
    counts = llm.collective_rpc("xmix_counts")
    assert [c["replicas_checked"] for c in counts] == [1, 1]
