"""Property-based fuzzing (hypothesis) of deployments and per-request selections.

Deployments (no engine): hypothesis builds ``additional_config["xmix"]`` dicts with apps, ops,
write and read kinds, layers, hooks, vectors (right and wrong widths, NaN, inf, -inf, entries
beyond float32, strings, bools), conditions, reads and triggers; each carries at most one planted
defect whose field the test knows. Every one goes through vLLM's engine configuration with the
plugin (``EngineArgs.create_engine_config``: where ``LLM(...)`` and ``vllm serve`` check a
deployment) and must be accepted exactly when nothing was planted, with the runtime's tables then
built as the spec says (one entry per app, op and layer, the vector as given), or refused with an
``XmixSpecError`` naming the planted field. Unconstrained values anywhere (any JSON) must give
acceptance or an ``XmixSpecError``, never another exception.

Selections (one real engine, eager, float32 tiny Llama): hypothesis builds per-request
selections (names, unknown names, scales of every type including NaN, inf, strings, bools and
integers beyond float range, layer subsets, undeployed layers, extra keys, duplicates, ``n``),
given as ``mi_apps`` or as ``extra_args["xmix"]``, several per batch beside a plain request.
Accepted requests equal HF's greedy tokens with the same adds and their probe values equal HF's;
refused ones raise an ``XmixSpecError`` naming the item (``mi_apps[i]...``, or
``extra_args.xmix[i]...``). After every example
the engine serves a plain request equal to HF, and the runtime and the scheduler hold nothing of
the example's requests.

Bounded for CI (about 2 minutes on 2 cores): 300 + 300 deployments, 50 batches of selections,
the same examples every run; ``XMIX_FUZZ_RANDOM=1`` draws new ones, ``XMIX_FUZZ_SCALE=k`` runs k
times as many.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from conftest import D_MODEL, HAPPY_LAYERS, N_LAYERS, app_deltas, close_llm, deployment, make_llm, unit_rms
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.fuzz, pytest.mark.one_version]

#: deterministic examples by default (CI: the same inputs every run, bounded time);
#: XMIX_FUZZ_RANDOM=1 draws new ones each run, XMIX_FUZZ_SCALE=k runs k times as many
RANDOM = os.environ.get("XMIX_FUZZ_RANDOM") == "1"
SCALE = int(os.environ.get("XMIX_FUZZ_SCALE", "1"))

GOOD = [float(x) for x in unit_rms(81)]
HOOKS = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"]
VOCAB = 1024


# ------------------------------------------------------------------------ deployments

def f32(lo, hi):
    """Scalars an op applies in float32 (scale, clamp target, bias): float32 values without its
    subnormals, which the spec refuses as underflowing (0 itself is drawn)."""
    return st.floats(lo, hi, allow_nan=False, width=32, allow_subnormal=False)


def vec(draw, width=D_MODEL):
    return [float(x) for x in np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(width)]


#: planted defects: field -> (bad value, text the error must contain besides the op's path)
WRITE_DEFECTS = {
    "vector": [([1.0] * (D_MODEL - 1), "vector: length 63"), ([1.0] * (D_MODEL + 1), "vector: length 65"),
               ([float("nan")] + GOOD[1:], "vector"), ([float("inf")] + GOOD[1:], "vector"),
               ([-float("inf")] + GOOD[1:], "vector"), ([1e39] + GOOD[1:], "vector"),
               (["a"] * D_MODEL, "vector"), ([True] * D_MODEL, "vector"), ([], "vector"),
               ([GOOD], "vector"), ("happy.npy", "vector"), ([10**400] + GOOD[1:], "vector")],
    "layers": [([N_LAYERS], "layers"), ([-1], "layers"), ([], "layers"), ([1, 1], "layers"), ("some", "layers"),
               ([1.5], "layers"), (3, "layers")],
    "hook": [("hook_bogus", "hook"), ("blocks.2.hook_resid_post", "hook"), (7, "hook")],
    "kind": [("bogus", "kind"), ("steer", "kind"), (None, "kind")],
    "scale": [(float("nan"), "scale"), (float("inf"), "scale"), ("x", "scale"), (True, "scale"), (10**400, "scale"),
              (1e30, "scale")],
    "extra": [(1, "unexpected: Extra inputs")],
}
READ_DEFECTS = {
    "weight": [([1.0] * (D_MODEL + 1), "weight: length 65"), ([float("nan")] * D_MODEL, "weight"), (None, "weight"),
               ([0.0] * D_MODEL, "weight"), ([1e39] * D_MODEL, "weight")],
    "layers": [([N_LAYERS + 2], "layers"), ([], "layers")],
    "bias": [(float("inf"), "bias"), ("b", "bias")],
    "name": [("bad name", "name"), ("triggers", "name")],
    "on": [({"threshold": float("nan")}, "on.threshold"), ({"threshold": 0.5, "action": "explode"}, "on.action"),
           ({"op": "!=", "threshold": 0.5}, "on.op")],
    "positions": [("bogus", "positions"), ("last", "positions")],
}


@st.composite
def write_op(draw):
    kind = draw(st.sampled_from(["add", "add", "ablate", "clamp"]))
    op = {"kind": kind, "vector": vec(draw), "hook": draw(st.sampled_from(HOOKS)),
          "scale": draw(f32(-8, 8))}
    if kind == "clamp":
        op["value"] = draw(f32(-4, 4))
    if draw(st.booleans()):
        op["layers"] = sorted(draw(st.sets(st.integers(0, N_LAYERS - 1), min_size=1)))
    if draw(st.integers(0, 3)) == 0:
        key = draw(st.sampled_from(["tokens", "tokens_prev"]))
        op["cond"] = {key: sorted(draw(st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))}
        if draw(st.booleans()):
            op["cond"]["positions"] = "generated"
    return op


@st.composite
def read_op(draw, i):
    kind = draw(st.sampled_from(["linear_probe", "cosine", "capture"]))
    op = {"primitive": "read", "kind": kind, "name": f"r{i}", "hook": draw(st.sampled_from(HOOKS)),
          "layers": sorted(draw(st.sets(st.integers(0, N_LAYERS - 1), min_size=1, max_size=2)))}
    if kind == "capture":
        op["positions"] = draw(st.sampled_from(["all", "generated", "last"]))
        return op
    op["weight"] = vec(draw)
    if kind == "linear_probe" and draw(st.booleans()):
        op["bias"], op["sigmoid"] = draw(f32(-2, 2)), draw(st.booleans())
    if draw(st.integers(0, 2)) == 0:
        op["on"] = {"op": draw(st.sampled_from([">", ">=", "<", "<="])), "threshold": draw(st.floats(-1, 1)),
                    "action": draw(st.sampled_from(["stop", "flag"]))}
    return op


@st.composite
def cast_ops(draw):
    """A condition read at layer a and a write conditioned on it at later layers."""
    a = draw(st.integers(0, N_LAYERS - 2))
    read = {"primitive": "read", "kind": draw(st.sampled_from(["cosine", "linear_probe"])), "weight": vec(draw),
            "buffer": "c", "scope": draw(st.sampled_from(["token", "request"])), "layers": [a]}
    write = {"kind": "add", "vector": vec(draw), "layers": sorted(draw(st.sets(st.integers(a + 1, N_LAYERS - 1),
                                                                               min_size=1))),
             "cond": {"buffer": "c", "op": draw(st.sampled_from([">", "<"])), "threshold": draw(st.floats(-1, 1))}}
    return [read, write]


@st.composite
def deployments(draw):
    """(raw deployment, planted defect or None): ``defect`` = (app index or None, op index or
    None, texts the error must contain)."""
    apps = []
    for ai in range(draw(st.integers(1, 3))):
        ops = []
        for oi in range(draw(st.integers(1, 3))):
            x = draw(st.integers(0, 5))
            if x == 0 and not any("buffer" in o for o in ops):
                ops += draw(cast_ops())
            elif x <= 2:
                ops.append(draw(read_op(oi)))
            else:
                ops.append(draw(write_op()))
        apps.append({"name": f"app{ai}", "ops": ops})
    raw = {"apps": apps, "fused_writes": draw(st.sampled_from(["auto", "none", "norm", "adds", "all"]))}
    defect = None
    what = draw(st.sampled_from(range(10)))  # (uniform: integers() favours small values)
    if what >= 3:  # one planted defect in 7 of 10
        ai = draw(st.integers(0, len(apps) - 1))
        ops = apps[ai]["ops"]
        oi = draw(st.integers(0, len(ops) - 1))
        op = ops[oi]
        if what == 9:  # app-level
            kind, text = draw(st.sampled_from([("name", "name"), ("dup", "duplicate app names"), ("ops", "ops")]))
            if kind == "name":
                apps[ai]["name"] = draw(st.sampled_from(["", "a b", "x" * 80, "1abc"]))
            elif kind == "dup":
                apps.append(json.loads(json.dumps(apps[ai])))
            else:
                apps[ai]["ops"] = []
            return raw, (None if kind == "dup" else ai, None, [text])
        table = READ_DEFECTS if op.get("primitive") == "read" else WRITE_DEFECTS
        if op.get("buffer") or op.get("cond", {}).get("buffer"):  # (layers of a CAST pair are checked together)
            table = {k: v for k, v in table.items() if k in ("vector", "weight", "extra")}
        field = draw(st.sampled_from(sorted(table)))  # (uniform over fields, then over their bad values)
        bad, text = draw(st.sampled_from(table[field]))
        if op.get("primitive") == "read" and op["kind"] == "capture" and field in ("weight", "bias", "on"):
            field, bad, text = "positions", "bogus", "positions"
        if field == "weight" and bad == [0.0] * D_MODEL and op["kind"] != "cosine":
            bad = [1.0] * (D_MODEL + 1)  # (a zero probe weight is a valid probe: the zero function)
        if field == "positions" and op["kind"] == "capture":
            bad = "bogus"
        if op.get("primitive") != "read" and field == "kind" and op["kind"] == "clamp":
            op.pop("value")
        if field == "extra":
            op["unexpected"] = bad
        elif bad is None:
            op.pop(field, None)
            if field == "kind":
                op["kind"] = None
        else:
            op[field] = bad
        if field == "scale" and bad == 1e30:
            text = "would write values up to"  # refused against the dtype (engine configuration)
            if op["kind"] in ("ablate", "clamp"):
                text = "would write values up to"
        defect = (ai, oi, [text])
    return raw, defect


def engine_config(model: str, raw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                      additional_config={"xmix": raw}).create_engine_config()


@pytest.fixture(scope="module")
def plugin():
    from vllm_xmix.plugin import register

    register()


def check_lowering(cfg, raw) -> None:
    """The runtime's tables of an accepted deployment: one entry per (app, op, layer), in order,
    each with its op's vector (unit length for ablate, clamp and cosine), scale and app."""
    import torch

    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment, resolve_layers

    dep = parse_deployment(cfg.additional_config["xmix"])
    st_ = XmixState.build(dep, N_LAYERS, D_MODEL, torch.device("cpu"), max_tokens=64, max_slots=9, vocab_size=VOCAB,
                          max_model_len=128)
    want = []
    for app in raw["apps"]:
        for oi, op in enumerate(app["ops"]):
            for L in resolve_layers(op.get("layers", "all"), N_LAYERS, "layers"):
                v = np.asarray(op.get("vector", op.get("weight", np.zeros(D_MODEL))), dtype=np.float32)
                if op["kind"] in ("ablate", "clamp", "cosine"):
                    v = v / np.linalg.norm(v.astype(np.float64))
                scale = 1.0 if op.get("primitive") == "read" else op.get("scale", 1.0)
                want.append((app["name"], oi, L, op.get("hook", "hook_resid_post"), scale, v))
    got = st_.layout.entries
    assert len(got) == len(want), (len(got), len(want))
    vectors = st_.layout.vectors.numpy()
    for i, (e, (app, oi, L, hook, scale, v)) in enumerate(zip(got, want)):
        assert (e.app, e.op, e.layer, e.hook) == (app, oi, L, hook), (i, e, want[i])
        assert np.float32(e.default_scale) == np.float32(scale), (i, e, scale)
        np.testing.assert_allclose(vectors[i, :D_MODEL], v, rtol=1e-6, atol=1e-7)


@settings(max_examples=300 * SCALE, deadline=None, derandomize=not RANDOM,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=deployments())
def test_deployments_are_accepted_or_refused_naming_the_field(plugin, tiny_llama, case):
    from vllm_xmix import XmixSpecError

    raw, defect = case
    event("planted: " + ("nothing" if defect is None else defect[2][0].split(":")[0]))
    try:
        cfg = engine_config(tiny_llama, json.loads(json.dumps(raw)) if _jsonable(raw) else raw)
    except XmixSpecError as e:
        msg = str(e)
        assert defect is not None, f"refused a deployment without a defect: {msg}\n{raw}"
        ai, oi, texts = defect
        assert msg.startswith("additional_config.xmix"), msg
        assert ai is None or f"apps.{ai}" in msg, (msg, defect)
        if oi is not None:
            assert f"ops.{oi}" in msg, (msg, defect)
        assert any(t in msg for t in texts), (msg, defect)
        return
    assert defect is None, f"accepted a deployment with a planted defect {defect}:\n{raw}"
    check_lowering(cfg, raw)


ALL_DEFECTS = [("write", f, bad, text) for f, vals in WRITE_DEFECTS.items() for bad, text in vals] + \
              [("read", f, bad, text) for f, vals in READ_DEFECTS.items() for bad, text in vals]


@pytest.mark.parametrize("prim,field,bad,text", ALL_DEFECTS,
                         ids=[f"{p}-{f}-{i}" for i, (p, f, _, _) in enumerate(ALL_DEFECTS)])
def test_every_planted_defect_is_refused_naming_its_field(plugin, tiny_llama, prim, field, bad, text):
    """Each defect of the tables above, planted in op 1 of app 1 of a valid deployment, whatever
    hypothesis happens to draw: refused when the engine is configured, naming that op and field."""
    from vllm_xmix import XmixSpecError

    probe = {"primitive": "read", "kind": "linear_probe", "weight": GOOD, "name": "p"}
    op = dict(probe, name="q") if prim == "read" else {"kind": "add", "vector": GOOD, "layers": [1, 2]}
    if field == "extra":
        op["unexpected"] = bad
    elif bad is None:
        op.pop(field, None)
        if field == "kind":
            op["kind"] = None
    else:
        op[field] = bad
    if (field, bad) == ("weight", [0.0] * D_MODEL):
        op["kind"] = "cosine"  # (a zero probe weight is a valid probe)
    if field == "positions" and bad == "last":
        op["kind"] = "linear_probe"
    raw = {"apps": [{"name": "a", "ops": [{"kind": "add", "vector": GOOD}]},
                    {"name": "b", "ops": [dict(probe), op]}]}
    if field == "scale" and bad == 1e30:
        text = "would write values up to"
    with pytest.raises(XmixSpecError) as e:
        engine_config(tiny_llama, raw)
    msg = str(e.value)
    assert msg.startswith("additional_config.xmix.apps.1") and "ops.1" in msg and text in msg, msg


def _jsonable(raw) -> bool:
    try:
        json.dumps(raw, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["add", "read", "write", "all", "hook_resid_post", "linear_probe", "capture", "tokens"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "ops", "kind", "vector", "layers", "hook", "scale", "cond", "primitive", "weight",
                         "buffer", "on", "threshold", "tokens", "apps", "x"]), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300 * SCALE, deadline=None, derandomize=not RANDOM, suppress_health_check=[HealthCheck.too_slow])
@given(case=deployments(), where=st.integers(0, 3), junk=json_values)
def test_any_value_anywhere_is_accepted_or_refused(plugin, tiny_llama, case, where, junk):
    """Unconstrained JSON values in place of a deployment, an app, an op or an op's field: an
    ``XmixSpecError`` naming ``additional_config.xmix``, or acceptance, never another error."""
    from vllm_xmix import XmixSpecError

    raw, _ = case
    ops = raw["apps"][0]["ops"]
    if not ops:
        ops.append({"kind": "add", "vector": GOOD})
    if where == 0:
        raw = junk
    elif where == 1:
        raw["apps"][0] = junk
    elif where == 2:
        ops[0] = junk
    elif isinstance(junk, dict):
        ops[0].update(junk)
    try:
        engine_config(tiny_llama, raw)
    except XmixSpecError as e:
        assert str(e).startswith("additional_config.xmix"), str(e)


# ------------------------------------------------------------------------ selections on a real engine

W = unit_rms(82) / 8
N = 4
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def sel_llm(tiny_llama):
    """One eager engine: happy (add at layers 1-2), sad (add at every layer), probe (a linear
    probe at layer 2), with the read-only introspection call of the worker."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix._vllm_compat.introspection import EXTENSION

    dep = deployment()
    p = MIApp("probe")
    p.read("linear_probe", weight=W, bias=0.25).layers([2]).submodule("hook_resid_post")
    dep["xmix"]["apps"] += deploy(p)["xmix"]["apps"]
    llm = make_llm(tiny_llama, "eager", additional_config=dep, max_num_seqs=4, max_model_len=64,
                   worker_extension_cls=EXTENSION)
    yield llm
    close_llm(llm)


DEPLOYED_LAYERS = {"happy": HAPPY_LAYERS, "sad": list(range(N_LAYERS)), "probe": [2]}


#: when a selection's checks run: 0 its structure (spec.parse_request_apps, item by item, with
#: duplicates), 1 each item against the deployment (name, scale of a read-only app, layers),
#: 2 write magnitudes (validation.check_write_magnitude), 3 reads with n > 1
STRUCTURE, DEPLOYMENT, MAGNITUDE = 0, 1, 2


@st.composite
def selection_item(draw):
    """(item, problems): problems = [(stage, text its error contains after ``mi_apps[i]``)]."""
    name = draw(st.sampled_from(["happy", "sad", "probe"]))
    x = draw(st.integers(0, 14))
    if x == 0:
        return name, []
    if x == 1:
        return draw(st.sampled_from(["nope", "", "HAPPY", "happy "])), [(DEPLOYMENT, ".name: unknown app")]
    if x == 2:
        return draw(st.sampled_from([3, None, 2.5, ["happy"]])), [(STRUCTURE, ": expected an app name")]
    item: dict = {"name": name}
    problems = []
    if draw(st.booleans()):
        if name == "probe":
            item["scale"] = draw(st.sampled_from([0, 0.0, 1.0, -1.0]))
            if item["scale"] != 0:
                problems.append((DEPLOYMENT, ".scale: app 'probe' has no writes"))
        else:
            s = draw(st.one_of(st.floats(-8, 8, allow_nan=False), st.integers(-8, 8),
                               st.sampled_from([float("nan"), float("inf"), -float("inf"), "2", True, False, 1e30,
                                                -1e30, 10**400, [1.0], {"v": 1}])))
            item["scale"] = s
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                problems.append((STRUCTURE, ".scale: expected a number"))
            elif (isinstance(s, int) and abs(s) > 1e300) or not math.isfinite(s):
                problems.append((STRUCTURE, ".scale: must be finite"))
            elif s != 0 and abs(s) < float(np.finfo(np.float32).tiny):  # applied in float32: it would be 0
                problems.append((STRUCTURE, ".scale: "))
            elif abs(s) > 1e17:  # would overflow the next RMSNorm's float32 sum of squares
                problems.append((MAGNITUDE, ".scale: app"))
    if draw(st.booleans()):
        deployed = DEPLOYED_LAYERS[name]
        y = draw(st.integers(0, 5))
        if y <= 2:
            item["layers"] = sorted(draw(st.sets(st.sampled_from(deployed), min_size=1)))
        elif y == 3:
            item["layers"] = [draw(st.sampled_from([L for L in range(N_LAYERS + 2) if L not in deployed]))]
            problems.append((DEPLOYMENT, ".layers: layer"))
        elif y == 4:
            item["layers"] = draw(st.sampled_from([[], [1, 1], "all", [-1], [1.5]]))
            problems.append((STRUCTURE, ".layers"))
        else:
            item["layers"] = [draw(st.sampled_from(deployed))]
    if draw(st.integers(0, 9)) == 0:
        item["colour"] = "red"
        problems.append((STRUCTURE, ".colour"))
    return item, problems


@st.composite
def selections(draw):
    """(raw selection, n, texts one of which the error must contain, or None)."""
    form = draw(st.integers(0, 11))
    if form == 0:
        raw = draw(st.sampled_from([5, "happy", {"happy": 1}, 2.5, True]))
        return raw, 1, ["mi_apps: "]
    items = draw(st.lists(selection_item(), max_size=3))
    raw = [it for it, _ in items]
    by_stage: dict[int, list[str]] = {}
    names = []
    for i, (it, problems) in enumerate(items):  # the first item with a problem, per stage
        structure = [t for stg, t in problems if stg == STRUCTURE]
        if not structure:  # an item that parses: its name counts for duplicates
            nm = it if isinstance(it, str) else it["name"]
            if nm in names:
                structure = [f".name: app {nm!r} listed twice"]
            names.append(nm)
        for stg, texts in ((STRUCTURE, structure), (DEPLOYMENT, [t for g, t in problems if g == DEPLOYMENT]),
                           (MAGNITUDE, [t for g, t in problems if g == MAGNITUDE])):
            if texts and stg not in by_stage:
                by_stage[stg] = [f"mi_apps[{i}]{t}" for t in texts]
    n = draw(st.sampled_from([1, 1, 1, 2]))
    if not by_stage and n > 1:
        probe_on = any((it == "probe") or (isinstance(it, dict) and it["name"] == "probe" and it.get("scale", 1) != 0)
                       for it in raw)
        if probe_on:
            by_stage[3] = ["has reads; reads with n > 1"]
    if form == 1:
        raw = {"apps": raw}
    return raw, n, by_stage[min(by_stage)] if by_stage else None


def expected(raw) -> tuple[list[dict], bool]:
    """The adds of an accepted selection (conftest.app_deltas form) and whether the probe is on."""
    items = raw["apps"] if isinstance(raw, dict) else raw
    adds, probe = [], False
    for it in items:
        it = {"name": it} if isinstance(it, str) else it
        if it["name"] == "probe":
            probe = probe or it.get("scale", 1) != 0
            continue
        a = {"name": it["name"]}
        if "scale" in it:
            a["scale"] = float(it["scale"])
        if "layers" in it:
            a["layers"] = it["layers"]
        adds.append(a)
    return adds, probe


def run(llm, reqs):
    """Add ``(rid, prompt, params)`` requests and step the engine until they finish; outputs by id."""
    eng = llm.llm_engine
    for rid, p, sp in reqs:
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def idle_counts(llm) -> None:
    """Nothing of earlier requests is held: worker runtime counts and the scheduler's xmix state."""
    (c,) = llm.collective_rpc("xmix_counts")
    held = {k: v for k, v in c.items() if k not in ("deployed", "slots_total", "slots_free", "snapshot_pool", "row_cache",
                                                   "versions_held", "entries_held", "spare_total", "spare_free",
                                                   "reserved_total", "reserved_free", "snapshots_taken",
                                                   "replicas_checked") and v}
    assert not held and c["slots_free"] == c["slots_total"], c
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert not sched.__dict__.get("_xmix_pending"), sched.__dict__.get("_xmix_pending")
    assert not sched.__dict__.get("_xmix_armed_ids")


_example = [0]


@settings(max_examples=50 * SCALE, deadline=None, derandomize=not RANDOM,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(selections(), st.sampled_from(range(len(PROMPTS))), st.booleans()),
                      min_size=1, max_size=3))
def test_request_selections_are_served_as_hf_or_refused_naming_the_field(sel_llm, hf, batch):
    import vllm
    from vllm.sampling_params import RequestOutputKind

    from vllm_xmix import SamplingParams, XmixSpecError

    _example[0] += 1
    want = {}
    for j, ((raw, n, problem), pi, via_extra_args) in enumerate(batch):
        rid = f"f{_example[0]}-{j}"
        # greedy where n is 1 (compared with HF); vLLM samples n > 1 (seeded, not compared)
        kw = dict(max_tokens=N, ignore_eos=True, n=n, temperature=0 if n == 1 else 1.0, seed=j,
                  output_kind=RequestOutputKind.FINAL_ONLY)  # (as LLM.generate: one output with all n)
        try:
            if via_extra_args:  # the wire form: checked when the engine adds the request
                sp = vllm.SamplingParams(extra_args={"xmix": raw}, **kw)
            else:  # the offline form: the structure is checked when the params are built
                sp = SamplingParams(mi_apps=raw, **kw)
            sel_llm.llm_engine.add_request(rid, {"prompt_token_ids": PROMPTS[pi]}, sp)
        except XmixSpecError as e:
            event("refused")
            assert problem is not None, f"refused {raw!r} (n={n}): {e}"
            # (errors name the selection as it was given: extra_args.xmix or mi_apps)
            texts = [t.replace("mi_apps", "extra_args.xmix", 1) for t in problem] if via_extra_args else problem
            assert any(t in str(e) for t in texts), (texts, str(e))
            continue
        event("accepted")
        assert problem is None, f"accepted {raw!r} (n={n}), expected an error with {problem!r}"
        want[rid] = (raw, n, PROMPTS[pi])
    outs = run(sel_llm, [])
    assert set(outs) == set(want), (set(outs), set(want))
    for rid, (raw, n, prompt) in want.items():
        adds, probe = expected(raw)
        toks = hf.greedy(prompt, N, app_deltas(adds))
        o = outs[rid]
        assert len(o.outputs) == n and all(len(c.token_ids) == N for c in o.outputs)
        if n > 1:
            continue
        assert list(o.outputs[0].token_ids) == toks, (raw, list(o.outputs[0].token_ids), toks)
        if probe:
            ids = list(prompt) + toks[:-1]
            x = hf.record(ids, [(2, "hook_resid_post")], app_deltas(adds))[(2, "hook_resid_post")]
            np.testing.assert_allclose(o.mi_results["probe"]["probe"], x.astype(np.float64) @ W + 0.25,
                                       rtol=1e-4, atol=1e-4)
        else:
            assert o.mi_results is None or "probe" not in o.mi_results
    # the engine still serves a plain request (this step also tells the worker which requests
    # finished), and nothing of this example's requests is left
    plain = run(sel_llm, [(f"plain{_example[0]}", PROMPTS[0], vllm.SamplingParams(temperature=0, max_tokens=N,
                                                                                 ignore_eos=True))])
    assert list(plain[f"plain{_example[0]}"].outputs[0].token_ids) == hf.greedy(PROMPTS[0], N)
    idle_counts(sel_llm)
