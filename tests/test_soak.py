"""Soak: a real OpenAI server (``python -m vllm.entrypoints.openai.api_server``, CPU, tiny Llama,
float32, apps deployed) under concurrent mixed load with faults, on loopback, for a bounded time.

Load: ``CONCURRENCY`` clients send requests drawn from a fixed pool of distinct requests
(completions and chat; apps off, steering adds, token- and activation-conditioned writes, probe
reads, a probe-triggered stop; streamed or not). Faults among them: aborts (the client gives up on a
non-streaming request and closes the connection: vLLM aborts the request), disconnects in the
middle of a stream, refused selections (HTTP 400), and preemption with recompute (the KV cache
holds 10 blocks of 32 tokens for 8 running requests of up to 72 tokens).

Apps change on the running server (:class:`ParameterUpdates`; the deployment reserves a spare
copy of every app and reserved add and probe entries, and the server has an admin key): before
each measured round, happy's vector, the probe's weight and bias, sad's default scale are
replaced and an app is added into reserved entries (later rounds select it) and replaced; during
each measured round one app is replaced while requests that use it stream. After the last round
happy and sad get their deployed parameters back and one more app is added.

Checked:
- every completed response equals its solo reference (the same request sent alone to the same
  server, with the apps' parameters it ran: tokens, finish and stop reasons exactly, read values
  to 1e-4), streamed ones chunk by chunk; the references of requests whose apps HF can express
  (adds, probes) equal HF's greedy tokens and probe values with those parameters. Which
  parameters a request ran: a change counts from just before its call is sent until its answer
  came; a request sent after the answer ran the new ones, a request whose first output came
  before the call was sent the old ones, and one in between must equal one of them (counted).
  References of parameters set during a round are taken solo after the round, and the responses
  that need them are checked then. Requests streaming when a change is sent (its answer lists
  their version as in flight) equal the old parameters' reference, the same requests sent after
  the answer the new one, and the two references differ;
- nothing leaks: after each round the worker's MI runtime (slots, registered rows, read snapshots,
  the per-token device rows pointing at requests; ``XmixWorkerExtension.xmix_counts``) is back at
  the idle engine's counts, and the resident memory of the server's processes is flat; app
  versions: a change on the idle server lists no version in flight (the front end keeps no state
  of finished, aborted or disconnected requests), and after it the worker holds exactly the
  listed apps' current versions plus at most the changed app's previous one (kept until the next
  change: requests the front end stamped while the change was on its way may still run it),
  whose entries, spare copies and reserved entries, are free again after the next change;
- the server logged no traceback, and, stopped with ``--shutdown-timeout``, no leaked shared
  memory or semaphore (see README, "Stopping a server": the warning at exit with vLLM's default
  ``--shutdown-timeout 0`` is vLLM's own, with or without the plugin).

``XMIX_SOAK_SECONDS`` sets the load time of the measured rounds (default 60; a warm-up round
of 15 s comes first). On a GPU (the same test, same checks; see benchmarks/README.md, "Soak on
the H200"): ``XMIX_SOAK_COMPILED=1`` serves in vLLM's default compiled mode (torch.compile and
CUDA graphs, the plugin's graph variants) instead of ``--enforce-eager``,
``XMIX_SOAK_CONCURRENCY`` sets the number of clients (default 12), ``XMIX_SOAK_SERVER_ARGS``
adds server arguments (e.g. ``--gpu-memory-utilization 0.1 --attention-backend FLEX_ATTENTION``:
vLLM's default float32 backend on CUDA, TRITON_ATTN, computes in TF32, 2e-3 away from the float32
HF oracle); there the worker's CUDA memory
(allocated and reserved by PyTorch) must also be flat over the measured rounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import numpy as np
import pytest
from conftest import N_LAYERS, app_deltas, deployment, running_server, unit_rms

pytestmark = [pytest.mark.soak, pytest.mark.one_version]

#: clients; more than max_num_seqs (8), so requests also wait in the queue
CONCURRENCY = int(os.environ.get("XMIX_SOAK_CONCURRENCY", "12"))
LOAD_S = float(os.environ.get("XMIX_SOAK_SECONDS", "60"))
COMPILED = os.environ.get("XMIX_SOAK_COMPILED", "0") == "1"
EXTRA_SERVER_ARGS = os.environ.get("XMIX_SOAK_SERVER_ARGS", "").split()
ROUNDS = 2  # measured rounds (LOAD_S / ROUNDS each); ParameterUpdates.apply runs between rounds
WARMUP_S = 15.0
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 read values: batched against solo GEMM shapes
W = unit_rms(71) / 8
C = unit_rms(72)
V = unit_rms(73)
SEAL_SET = [int(x) for x in np.random.default_rng(3).choice(np.arange(3, 1000), size=120, replace=False)]
CAST_THRESHOLD = 0.0
GUARD_THRESHOLD = 0.0  # the probe "guard" stops a request at its first value below this
#: memory growth allowed over the measured rounds, all server processes together (RSS). The
#: runtime's buffers are allocated at start-up and the warm-up round has run every kind of
#: request, so what may still move is allocator noise (glibc arenas and Python's free lists keep
#: high-water marks that concurrency shifts): +1.9 MiB over ~4500 requests when this was written.
#: A leak of something a request carries would grow with the number of requests: a slot row, a
#: read snapshot (>= 64 rows x 4 bytes) or a RequestOutput with its values kept per request is
#: >= 1 KiB, so >= 4 MiB per kind here, and a leaked pinned or device-sized buffer far more.
#: The bound sits ~8x above the noise; the per-request counts catch the small leaks it cannot.
RSS_TOLERANCE_MIB = 16
#: CUDA memory growth allowed over the measured rounds (GPU only): the KV cache and the graphs'
#: pool are allocated at start-up, so steady load moves nothing but the caching allocator's
#: rounding; one leaked snapshot or row per request would be >= 1 MiB here.
DEVICE_TOLERANCE_MIB = 1
ADMIN_KEY = "soak-admin-key"
V2, V3 = unit_rms(74), unit_rms(75)  # happy's vector before round 0 / while round 0 streams
W2 = unit_rms(76) / 8  # the probe's weight from round 0 on (bias -0.25)
V_FRESH, W_FRESH = unit_rms(77), unit_rms(78) / 8  # the added app "fresh"
V_FRESH2, V_FRESH3 = unit_rms(79), unit_rms(80)  # fresh's vector before round 1 / while round 1 streams
W_LATE = unit_rms(81) / 8  # the probe added after the last round


def soak_deployment() -> dict:
    """happy/sad (adds, conftest) + a probe, SEAL (token-conditioned add), CAST (request-scope
    condition read at layer 1, adds at 2-3, and the same cosine returned so the test can see
    the decision), a probe with a stop trigger; reserved: one spare copy of every app, two add
    and two probe entries at every hooked site (the resid_post of every layer)."""
    from vllm_xmix import MIApp, deploy

    dep = deployment()
    dep["xmix"].pop("fused_writes")  # ("adds" bakes the set of adds into the compiled graph: no reserve)
    probe = MIApp("probe")
    probe.read("linear_probe", weight=W, bias=0.5).layers([2]).submodule("hook_resid_post")
    seal = MIApp("seal")
    seal.write("add", vector=V, scale=4.0).layers([1, 2]).cond(tokens=SEAL_SET)
    cast = MIApp("cast")
    cast.read("cosine", weight=C, buffer="sim", scope="request").layers([1]).submodule("hook_resid_post")
    cast.read("cosine", weight=C, name="sim_seen").layers([1]).submodule("hook_resid_post")
    cast.write("add", vector=V, scale=4.0).layers([2, 3]).cond(buffer="sim", op=">", threshold=CAST_THRESHOLD)
    guard = MIApp("guard")
    guard.read("linear_probe", weight=W).layers([3]).submodule("hook_resid_post").on("<", GUARD_THRESHOLD,
                                                                                     action="stop")
    dep["xmix"]["apps"] += deploy(probe, seal, cast, guard)["xmix"]["apps"]
    dep["xmix"]["reserve"] = {"versions": 1, "add": 2, "linear_probe": 2}
    return dep


FRESH = {"name": "fresh", "ops": [
    {"primitive": "write", "kind": "add", "hook": "hook_resid_post", "layers": [0, 3],
     "vector": [float(x) for x in V_FRESH], "scale": 2.0},
    {"primitive": "read", "kind": "linear_probe", "name": "score", "hook": "hook_resid_post", "layers": [3],
     "weight": [float(x) for x in W_FRESH], "bias": 0.1}]}
LATE = {"name": "late", "ops": [{"primitive": "read", "kind": "linear_probe", "name": "probe",
                                 "hook": "hook_resid_post", "layers": [1], "weight": [float(x) for x in W_LATE],
                                 "bias": -0.5}]}


SELECTIONS = [None, ["happy"], [{"name": "sad", "scale": -1.5}], ["happy", "sad"], ["probe"], ["probe", "happy"],
              ["seal"], ["cast"], ["cast", "probe"], ["guard"], [{"name": "happy", "layers": [1]}],
              ["seal", "probe", "sad"]]
#: refused selections: (mi_apps, text the HTTP 400 must contain)
BAD = [(["nope"], "mi_apps[0].name: unknown app 'nope'"), ([{"name": "happy", "scale": "x"}], "mi_apps[0].scale"),
       ([{"name": "happy", "layers": [3]}], "mi_apps[0].layers"), ([{"name": "happy", "scale": 1e30}], "mi_apps[0]"),
       ([{"name": "probe", "scale": 2.0}], "mi_apps[0].scale"),
       ([{"name": "happy", "scale": 10**400}], "mi_apps[0].scale: must be finite")]
#: selections of the added app "fresh" (in the pool once it is added)
FRESH_SELECTIONS = [["fresh"], ["fresh", "happy"], [{"name": "fresh", "scale": -1.0}, "probe"]]
CHAT_TEXTS = ["The cat sat on", "Tell me about the probe", "a steering vector in each layer", "Hello"]


def make_pool(seed: int = 0, selections=SELECTIONS, first_id: int = 0, chat: bool = True) -> list[dict]:
    """The distinct requests: every selection with two prompts (3-48 token ids) and 4-24 tokens
    to generate, plus a few chat requests; ids from ``first_id``."""
    rng = random.Random(seed)
    pool = []
    for sel in selections:
        for _ in range(2):
            n = rng.choice([3, 5, 9, 17, 30, 48])
            pool.append(dict(kind="cmpl", prompt=[rng.randrange(3, 1000) for _ in range(n)], sel=sel,
                             max_tokens=rng.choice([4, 8, 16, 24])))
    for i, text in enumerate(CHAT_TEXTS if chat else []):
        pool.append(dict(kind="chat", text=text, sel=SELECTIONS[i % 4], max_tokens=8))
    for i, r in enumerate(pool):
        r["id"] = first_id + i
    return pool


def watched(app: str, other: str, first_id: int) -> list[dict]:
    """Two long requests of ``app`` (one with ``other`` too), streaming while ``app`` changes."""
    rng = random.Random(first_id)
    return [dict(kind="cmpl", prompt=[rng.randrange(3, 1000) for _ in range(n)], sel=sel, max_tokens=56,
                 id=first_id + i) for i, (n, sel) in enumerate([(5, [app]), (9, [app, other])])]


def apps_of(r: dict) -> set[str]:
    return {a if isinstance(a, str) else a["name"] for a in r["sel"] or []}


def body(r: dict, stream: bool = False, sel="same") -> tuple[str, dict]:
    sel = r["sel"] if sel == "same" else sel
    b = {"max_tokens": r["max_tokens"], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if sel is not None:
        b["mi_apps"] = sel
    if stream:
        b["stream"] = True
    if r["kind"] == "chat":
        return "/v1/chat/completions", {**b, "messages": [{"role": "user", "content": r["text"]}]}
    return "/v1/completions", {**b, "prompt": r["prompt"]}


def result_of(resp: dict) -> dict:
    """What a non-streaming response is compared on."""
    ch = resp["choices"][0]
    return dict(tokens=list(ch["token_ids"]), finish=ch["finish_reason"], stop=ch.get("stop_reason"),
                mi=resp.get("mi_results"))


def assert_close(got, want, where="mi_results"):
    """JSON values equal: dict keys, list lengths, ints and strings exactly, floats to TOL (None:
    a non-finite value, equal only to None)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, str):
        assert got is not None and np.isclose(got, want, **TOL), (where, got, want)
    else:
        assert got == want, (where, got, want)


def check(res: dict, ref: dict, r: dict, values: dict | None = None) -> None:
    """A response equals its reference; ``values``: a stream's read values gathered chunk by
    chunk, {(app, read): [value per position]}, equal to the reference's too."""
    assert res["tokens"] == ref["tokens"], (r, res["tokens"], ref["tokens"])
    assert (res["finish"], res["stop"]) == (ref["finish"], ref["stop"]), r
    assert_close(res["mi"], ref["mi"])
    for (app, name), vals in (values or {}).items():  # the chunks' values are the final ones
        assert_close(vals, ref["mi"][app][name], f"stream {app}.{name}")


class Refs:
    """The solo references of the requests per parameter epoch (epoch e: the apps' parameters
    after the e-th group of changes; ``epochs[e][request id]``), and the check of a response
    against the epochs it may have run.

    A group counts as ``sent`` from just before its first call and ``done`` once its last answer
    came. A request sent when ``done == lo`` whose first output (first streamed chunk, or the
    whole response) came when ``sent == hi`` ran epoch lo..hi: one epoch when lo == hi (epochs
    whose references are equal for it count as one); otherwise it must equal one of them
    (``stats["ambiguous"]``). A response that needs a reference not taken yet (parameters set
    during a round) is kept and checked by :meth:`flush`."""

    def __init__(self) -> None:
        self.epochs: list[dict[int, dict]] = [{}]
        self.sent = self.done = 0
        self.deferred: list[tuple] = []
        self.stats: dict[str, int] = {}

    def begin(self, apps: set[str]) -> None:
        """A group of changes of ``apps`` starts: the next epoch keeps the references of the
        requests that select none of them."""
        self.epochs.append({k: v for k, v in self.epochs[-1].items() if not apps & v["apps"]})
        self.sent += 1

    def end(self) -> None:
        self.done += 1

    def put(self, r: dict, ref: dict) -> None:
        self.epochs[-1][r["id"]] = {**ref, "apps": apps_of(r)}

    def verify(self, r: dict, res: dict, values: dict | None, lo: int, hi: int) -> tuple[int, int]:
        refs = [self.epochs[e].get(r["id"]) for e in range(lo, hi + 1)]
        if any(x is None for x in refs):
            self.deferred.append((r, res, values, lo, hi))
            return lo, hi
        distinct = [x for i, x in enumerate(refs) if all(x is not y for y in refs[:i])]
        if len(distinct) == 1:
            check(res, distinct[0], r, values)
            return lo, hi
        self.stats["ambiguous"] = self.stats.get("ambiguous", 0) + 1
        errors = []
        for ref in distinct:
            try:
                check(res, ref, r, values)
                return lo, hi
            except AssertionError as e:
                errors.append(e)
        raise AssertionError(f"request {r['id']} ran epochs {lo}..{hi} and equals none of their references: {errors}")

    def flush(self) -> None:
        """Check the kept responses (their references are taken now)."""
        kept, self.deferred = self.deferred, []
        for r, res, values, lo, hi in kept:
            assert all(r["id"] in self.epochs[e] for e in range(lo, hi + 1)), (r, lo, hi)
            self.verify(r, res, values, lo, hi)
        self.stats["deferred"] = self.stats.get("deferred", 0) + len(kept)


# ----------------------------------------------------------------------------- client side


class Client:
    """aiohttp against one server; every outcome is counted in ``stats``."""

    def __init__(self, session, url: str, refs: Refs):
        self.s, self.url, self.refs = session, url, refs
        self.stats: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    async def post(self, path: str, b: dict) -> tuple[int, dict]:
        async with self.s.post(self.url + path, json=b) as resp:
            return resp.status, await resp.json(content_type=None)

    async def complete(self, r: dict) -> tuple[int, int]:
        lo = self.refs.done
        status, resp = await self.post(*body(r))
        hi = self.refs.sent
        assert status == 200, (r, status, resp)
        self.count("completed")
        return self.refs.verify(r, result_of(resp), None, lo, hi)

    async def abort(self, r: dict, after: float) -> None:
        """The client gives up after ``after`` seconds (the connection closes: vLLM aborts the
        request); a response that came first is checked."""
        lo = self.refs.done
        try:
            status, resp = await asyncio.wait_for(self.post(*body(r)), after)
        except asyncio.TimeoutError:
            self.count("aborted")
            return
        hi = self.refs.sent
        assert status == 200, (r, status, resp)
        self.refs.verify(r, result_of(resp), None, lo, hi)
        self.count("completed")

    async def stream(self, r: dict, stop_after: int | None = None,
                     started: asyncio.Event | None = None) -> tuple[int, int] | None:
        """A streamed request, read to the end and checked chunk by chunk against the solo
        reference, or dropped after ``stop_after`` chunks (the client disconnects). ``started``
        is set at the first chunk. The epochs it may have run."""
        path, b = body(r, stream=True)
        toks, finish, stop, final, n, lo, hi = [], None, None, None, 0, self.refs.done, None
        values: dict[tuple, list] = {}
        async with self.s.post(self.url + path, json=b) as resp:
            assert resp.status == 200, (r, resp.status, await resp.text())
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                d = json.loads(line[len(b"data: "):])
                if not d.get("choices"):
                    continue
                n += 1
                if n == 1:
                    hi = self.refs.sent
                    if started is not None:
                        started.set()
                if stop_after is not None and n >= stop_after:
                    resp.close()  # the client goes away mid-stream
                    self.count("disconnected")
                    return None
                ch = d["choices"][0]
                toks += ch.get("token_ids") or (ch.get("delta") or {}).get("token_ids") or []
                finish = ch.get("finish_reason") or finish
                stop = ch.get("stop_reason") or stop
                for app, reads in (ch.get("mi_results") or {}).items():
                    for name, v in reads.items():
                        if isinstance(v, dict) and "pos0" in v:  # one layer: {"pos0", "values"}
                            seen = values.setdefault((app, name), [])
                            assert v["pos0"] == len(seen), (r, app, name, v["pos0"], len(seen))
                            seen += v["values"]
                if ch.get("finish_reason") is not None:
                    final = ch.get("mi_results_complete")
        self.count("streamed")
        return self.refs.verify(r, dict(tokens=toks, finish=finish, stop=stop, mi=final), values, lo, hi)

    async def bad(self, r: dict, rng: random.Random) -> None:
        sel, msg = rng.choice(BAD)
        status, resp = await self.post(*body(r, stream=rng.random() < 0.5, sel=sel))
        assert status == 400 and msg in json.dumps(resp), (sel, status, resp)
        self.count("refused")

    async def worker(self, pool: list[dict], seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            r = rng.choice(pool)
            x = rng.random()
            if x < 0.35:
                await self.complete(r)
            elif x < 0.60:
                await self.stream(r)
            elif x < 0.75:
                await self.stream(r, stop_after=rng.randint(1, 4))
            elif x < 0.93:
                await self.abort(r, rng.uniform(0.01, 0.4))
            else:
                await self.bad(r, rng)


# ----------------------------------------------------------------------------- server side


def _json(x):
    """A copy of JSON data, numpy arrays as lists of floats."""
    return json.loads(json.dumps(x, default=lambda v: [float(f) for f in v]))


class ParameterUpdates:
    """Apps changed on the running server (``POST /v1/mi/apps/{name}``: replace parameters;
    ``POST /v1/mi/apps``: add into reserved entries; README, "Apps on a running server"), with
    the apps as the server has them now (``apps``: name -> app JSON; HF's parameters come from
    it) and their versions.

    The schedule: :meth:`before` measured round k, :meth:`during` round k (one replace while
    requests that use the app stream), :meth:`after` the last round (happy and sad back to their
    deployed parameters, one more app added). A group of calls goes through :meth:`group`, which
    tells ``refs`` when it starts and ends and checks every answer and the listing after it."""

    def __init__(self, refs: Refs) -> None:
        self.refs = refs
        self.deployed = {a["name"]: _json(a) for a in soak_deployment()["xmix"]["apps"]}
        self.apps = _json(self.deployed)
        self.versions = {name: 0 for name in self.apps}
        self.previous: tuple[str, int] | None = None  # the app version the last replace superseded
        self.listing: dict = {}

    def replaced(self, name: str, ops: dict[int, dict]) -> dict:
        app = _json(self.apps[name])
        for i, fields in ops.items():
            app["ops"][i].update(_json(fields))
        return app

    def before(self, k: int) -> list[tuple[dict, bool]]:
        """(app JSON, added?) changed before measured round ``k``."""
        if k == 0:
            return [(self.replaced("happy", {0: dict(vector=V2)}), False),
                    (self.replaced("probe", {0: dict(weight=W2, bias=-0.25)}), False), (_json(FRESH), True)]
        return [(self.replaced("fresh", {0: dict(vector=V_FRESH2), 1: dict(bias=-0.3)}), False),
                (self.replaced("sad", {0: dict(scale=1.0)}), False)]

    def during(self, k: int) -> tuple[str, str, dict]:
        """(app, another app the watched requests select, its new JSON) changed during round ``k``."""
        if k == 0:
            return "happy", "probe", self.replaced("happy", {0: dict(vector=V3)})
        return "fresh", "sad", self.replaced("fresh", {0: dict(vector=V_FRESH3)})

    def after(self) -> list[tuple[dict, bool]]:
        return [(self.deployed["happy"], False), (self.deployed["sad"], False), (_json(LATE), True)]

    async def group(self, s, url: str, changes: list[tuple[dict, bool]]) -> list[dict]:
        """Apply ``changes`` as one group; the answers. Each answer names the app, its new
        version and origin; the listing after the group has every app at its version."""
        self.refs.begin({app["name"] for app, _ in changes})
        answers = []
        try:
            for app, add in changes:
                name = app["name"]
                path = "/v1/mi/apps" if add else f"/v1/mi/apps/{name}"
                async with s.post(url + path, json=app, headers={"X-Admin-Key": ADMIN_KEY}) as resp:
                    out = await resp.json(content_type=None)
                    assert resp.status == (201 if add else 200), (path, resp.status, out)
                assert out["name"] == name and out["version"] == self.versions.get(name, 0) + 1, out
                assert out["origin"] == ("deployment" if name in self.deployed else "added"), out
                self.previous = None if add else (name, self.versions[name])
                self.versions[name], self.apps[name] = out["version"], app
                answers.append(out)
        finally:
            self.refs.end()
        async with s.get(url + "/v1/mi/apps") as resp:
            assert resp.status == 200
            self.listing = await resp.json()
        assert {a["name"]: a["version"] for a in self.listing["data"]} == self.versions, self.listing
        return answers

    def entries(self, name: str) -> int:
        """Entries one version of app ``name`` holds: one per (op, layer), from the listing."""
        (a,) = [a for a in self.listing["data"] if a["name"] == name]
        return sum(len(op["layers"]) for op in a["ops"])

    def assert_versions(self, counts: dict) -> None:
        """On an idle server after a change: the worker holds the listed apps' current versions
        and the version the last replace superseded (kept until the next change), nothing else;
        reserved entries are held by the added apps (and that version, if its app was added),
        spare copies by the deployed apps at odd versions (two copies: each replace takes the
        one its app's current version does not hold)."""
        prev_entries = self.entries(self.previous[0]) if self.previous else 0
        added = [a["name"] for a in self.listing["data"] if a["origin"] == "added"]
        reserved = sum(self.entries(n) for n in added) + (prev_entries if self.previous and self.previous[0] in added
                                                          else 0)
        spare = sum(self.entries(n) for n, v in self.versions.items() if n in self.deployed and v % 2) + \
            (prev_entries if self.previous and self.previous[0] in self.deployed and self.previous[1] % 2 else 0)
        want = dict(versions_held=len(self.versions) + bool(self.previous),
                    versions_superseded=int(bool(self.previous)),
                    entries_held=sum(self.entries(n) for n in self.versions) + prev_entries,
                    reserved_used=reserved, spare_used=spare)
        got = dict(versions_held=counts["versions_held"], versions_superseded=counts["versions_superseded"],
                   entries_held=counts["entries_held"],
                   reserved_used=counts["reserved_total"] - counts["reserved_free"],
                   spare_used=counts["spare_total"] - counts["spare_free"])
        assert got == want, (got, want, self.previous, self.versions)


def hf_check(hf, r: dict, ref: dict, apps: dict) -> bool:
    """``ref`` (a completions request's solo response) equals HF with the parameters of ``apps``
    (app JSON by name): greedy tokens, and linear-probe values at the positions vLLM computed.
    False (nothing checked) for chat requests and apps HF cannot express here (conditions,
    triggers)."""
    if r["kind"] != "cmpl":
        return False
    deltas: dict[int, np.ndarray] = {}
    reads = []
    for item in r["sel"] or []:
        item = {"name": item} if isinstance(item, str) else item
        for op in apps[item["name"]]["ops"]:
            layers = list(range(N_LAYERS)) if op["layers"] == "all" else op["layers"]
            layers = [L for L in layers if L in item.get("layers", layers)]
            if op["hook"] != "hook_resid_post" or op.get("cond") or op.get("on") or op.get("buffer"):
                return False
            if op["primitive"] == "write" and op["kind"] == "add":
                for L in layers:
                    deltas[L] = deltas.get(L, 0) + np.float32(item.get("scale", op["scale"])) * \
                        np.asarray(op["vector"], dtype=np.float32)
            elif op["kind"] == "linear_probe" and not op.get("sigmoid") and len(layers) == 1:
                reads.append((item["name"], op["name"], layers[0], np.asarray(op["weight"], dtype=np.float32),
                              np.float32(op["bias"])))
            else:
                return False
    toks = hf.greedy(r["prompt"], r["max_tokens"], deltas)
    assert ref["tokens"] == toks, (r, ref["tokens"], toks)
    if reads:
        got = hf.record(r["prompt"] + toks[:-1], [(L, "hook_resid_post") for _, _, L, _, _ in reads], deltas)
        for app, name, L, w, b in reads:
            want = got[(L, "hook_resid_post")] @ w + b
            assert_close(ref["mi"][app][name], [float(x) for x in want], f"HF {app}.{name}")
    return True


async def metrics(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for name in ("vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


async def xmix_counts(session, url: str) -> dict:
    async with session.post(url + "/collective_rpc", json={"method": "xmix_counts"}) as resp:
        assert resp.status == 200, await resp.text()
        (counts,) = (await resp.json())["results"]
    return counts


async def settle(session, url: str, pool: list[dict]) -> dict:
    """Wait until the server has no request left (disconnects are noticed when the server next
    writes), then send one app-free request: vLLM tells the worker which requests finished in the
    next step's scheduler output, so the worker's counts are final after it. The counts."""
    deadline = time.monotonic() + 120
    while True:
        m = await metrics(session, url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        await asyncio.sleep(0.2)
    plain = next(r for r in pool if r["sel"] is None and r["kind"] == "cmpl")
    async with session.post(url + "/v1/completions", json=body(plain)[1]) as resp:
        assert resp.status == 200
    return await xmix_counts(session, url)


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of the server process and its children (engine core, worker), MiB."""
    import psutil

    p = psutil.Process(pid)
    return {f"{q.name()}:{q.pid}": q.memory_info().rss / 2**20 for q in [p] + p.children(recursive=True)}


PER_REQUEST = ("slots_held", "rows_registered", "reads_registered", "fused_rows", "prompt_lengths", "prompts_staged",
               "preempted", "pending_rows", "step_positions", "variant_requests", "step_reads", "snapshots_pending",
               "high_water", "tok_slot_rows", "tok_fc_rows")


def assert_idle(counts: dict, start: dict, distinct_selections: int = len(SELECTIONS)) -> None:
    """Nothing per request is held; the row cache holds at most one row per distinct selection."""
    assert counts["deployed"], counts
    for k in PER_REQUEST:
        assert counts[k] == 0, (k, counts)
    assert counts["slots_free"] == counts["slots_total"] == start["slots_total"], counts
    assert counts["snapshot_pool"] <= 4 and counts["row_cache"] <= distinct_selections, counts


@pytest.fixture(scope="module")
def soak_server(tiny_llama, tmp_path_factory):
    from vllm_xmix._vllm_compat.introspection import EXTENSION

    log = tmp_path_factory.mktemp("soak") / "server.log"
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", tiny_llama, "--dtype", "float32",
            "--max-model-len", "128", *([] if COMPILED else ["--enforce-eager"]), "--max-num-seqs", "8",
            "--max-num-batched-tokens", "64", "--block-size", "32", "--num-gpu-blocks-override", "10",
            "--worker-extension-cls", EXTENSION, "--shutdown-timeout", "10",
            "--additional-config", json.dumps(soak_deployment()), *EXTRA_SERVER_ARGS]
    procs: list = []
    # VLLM_SERVER_DEV_MODE: vLLM's development endpoints (/collective_rpc) on loopback, for the counts;
    # the admin key: the routes that change apps
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_XMIX_ADMIN_KEY": ADMIN_KEY}
    with running_server(args, log, env=env, proc_out=procs) as url:
        yield url, tiny_llama, procs[0], log
    time.sleep(2)  # the resource tracker reports after the last process holding it exits
    text = log.read_text()
    assert procs[0].returncode == 0, text[-3000:]
    assert "leaked" not in text, text[-3000:]


def test_soak_mixed_load_with_faults(soak_server, hf):
    import aiohttp

    url, model, proc, log = soak_server
    pool = make_pool()
    refs = Refs()
    updates = ParameterUpdates(refs)
    fresh_pool = make_pool(1, FRESH_SELECTIONS, first_id=1000, chat=False)  # in the pool once "fresh" is added
    watch = {0: watched("happy", "probe", 2000), 1: watched("fresh", "sad", 2100)}  # streaming during a change
    watched_ids = {w["id"] for ws in watch.values() for w in ws}
    round_s = LOAD_S / ROUNDS
    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"[soak {time.monotonic() - t0:5.1f} s] {what}")

    async def main():
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64)) as s:

            async def references(rs, hf_all: bool = False):
                """Solo references of ``rs`` for the current epoch; those HF can express equal HF
                (all of them, or, for time, as HF recomputes every step, the shortest request of
                each selection but the watched ones, whose selections other requests share)."""
                for r in rs:  # alone on the server: one request at a time
                    status, resp = await Client(s, url, refs).post(*body(r))
                    assert status == 200, (r, resp)
                    refs.put(r, result_of(resp))
                first: dict[str, dict] = {}
                for r in sorted(rs, key=lambda r: len(r.get("prompt", ())) + r["max_tokens"]):
                    if r["id"] in watched_ids:
                        continue
                    first.setdefault(str(r["id"]) if hf_all else json.dumps(r["sel"]) + r["kind"], r)
                ref_of = refs.epochs[-1]
                # (in a thread: the event loop keeps noticing connections the server closed after
                # its keep-alive time, which a blocked loop would hand out again)
                n = await asyncio.to_thread(lambda: sum(hf_check(hf, r, ref_of[r["id"]], updates.apps)
                                                        for r in first.values()))
                assert n >= len(first) // 3, (n, len(first))
                return n

            n_hf = await references(pool, hf_all=True)
            phase("references")
            print("references equal to HF:", n_hf, "of", len(pool))
            # no knife edges: a decision within 1e-3 of its threshold could flip between batch
            # shapes (float32 sums in another order); such requests leave the pool (the apps that
            # change on the server decide no condition or trigger, so no new edge appears later)
            def knife_edge(r) -> bool:
                mi = refs.epochs[0][r["id"]]["mi"] or {}
                if "cast" in mi and r["kind"] == "cmpl":
                    mean = np.array(mi["cast"]["sim_seen"], dtype=np.float64)[:len(r["prompt"])].mean()
                    if abs(mean - CAST_THRESHOLD) < 1e-3:
                        return True
                return "guard" in mi and min(abs(v - GUARD_THRESHOLD) for v in mi["guard"]["probe"]) < 1e-3

            edges = [r["id"] for r in pool if knife_edge(r)]
            pool[:] = [r for r in pool if r["id"] not in edges]
            print("requests at a knife edge, left out:", edges)
            assert len(edges) <= 3 and any(r["sel"] == ["cast"] for r in pool), edges
            fired = [r for r in pool if (refs.epochs[0][r["id"]]["stop"] or "").startswith("xmix:guard")]
            assert fired, "the guard's stop trigger should fire on some requests"

            start = await settle(s, url, pool)
            assert_idle(start, start)
            assert start["versions_held"] == len(updates.apps) and start["versions_superseded"] == 0, start
            assert start["reserved_free"] == start["reserved_total"] > 0, start
            assert start["spare_free"] == start["spare_total"] > 0, start
            async with s.get(url + "/v1/mi/apps") as resp:
                hashes = {a["name"]: a["content_hash"] for a in (await resp.json())["data"]}
            m0 = await metrics(s, url)
            stats: dict[str, int] = {}

            def row_bound(rs, name: str) -> int:
                """Distinct selections of ``rs``; those of app ``name``, replaced during the round,
                twice (requests that waited in the queue during the change register rows of the
                old version after it)."""
                sels = {json.dumps(r["sel"]): apps_of(r) for r in rs if r["sel"]}
                return len(sels) + sum(name in a for a in sels.values())

            async def load(seconds: float, seed: int, during=None) -> None:
                clients = [Client(s, url, refs) for _ in range(CONCURRENCY)]
                until = time.monotonic() + seconds
                await asyncio.gather(*(c.worker(pool, seed * 1000 + i, until) for i, c in enumerate(clients)),
                                     *([during] if during is not None else []))
                for c in clients:
                    for k, v in c.stats.items():
                        stats[k] = stats.get(k, 0) + v

            async def change_while_streaming(k: int, delay: float) -> None:
                """The watched requests stream (first chunk seen) when app ``name`` is replaced; the
                same requests sent after the answer run the new parameters."""
                await asyncio.sleep(delay)
                name, _, app = updates.during(k)
                c = Client(s, url, refs)
                started = [asyncio.Event() for _ in watch[k]]

                async def old_one(w, ev):
                    got = await c.stream(w, started=ev)
                    return got, refs.done

                old = [asyncio.create_task(old_one(w, ev)) for w, ev in zip(watch[k], started)]
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 120)
                e_old = refs.sent
                (answer,) = await updates.group(s, url, [(app, False)])
                assert [name, updates.versions[name] - 1] in answer["in_flight_versions"], answer
                new = await asyncio.gather(c.complete(watch[k][0]), c.stream(watch[k][1]))
                for (lo, hi), done_at_end in await asyncio.gather(*old):
                    # ran the old parameters, and was still streaming when the answer came
                    assert lo == hi == e_old and done_at_end == e_old + 1, (lo, hi, e_old, done_at_end)
                assert all(lo == hi == e_old + 1 for lo, hi in new), (new, e_old)
                stats["watched"] = stats.get("watched", 0) + len(old) + len(new)

            await load(WARMUP_S, 0)  # warm-up: lazily built caches and buffers, allocator high-water marks
            dev0 = await settle(s, url, pool)
            assert_idle(dev0, start)
            phase("warm-up round")
            rss0 = rss_mib(proc.pid)
            for k in range(ROUNDS):
                # apps change between rounds (the server is idle: no version is in flight)
                answers = await updates.group(s, url, updates.before(k))
                assert all(a["in_flight_versions"] == [] for a in answers), answers
                updates.assert_versions(await xmix_counts(s, url))
                if k == 0:
                    pool.extend(fresh_pool)
                changed = {a["name"] for a in answers}
                await references([r for r in pool + watch[k] if apps_of(r) & changed])
                phase(f"changes before round {k}, references")
                # and one app changes while requests that use it stream
                await load(round_s, k + 1, during=change_while_streaming(k, 0.3 * round_s))
                counts = await settle(s, url, pool)
                assert_idle(counts, start, row_bound(pool + watch[k], updates.during(k)[0]))
                phase(f"round {k}")
                updates.assert_versions(counts)  # (the version the in-flight requests ran: until the next change)
                # references of the parameters set during the round; the responses that need them
                name = updates.during(k)[0]
                await references([r for r in pool + watch[k] if name in apps_of(r)])
                for w in watch[k]:  # the watched requests could tell the two versions apart
                    assert refs.epochs[-1][w["id"]]["tokens"] != refs.epochs[-2][w["id"]]["tokens"], w
                refs.flush()
                phase(f"references of the change during round {k}")
            rss1 = rss_mib(proc.pid)
            dev1 = await settle(s, url, pool)
            m1 = await metrics(s, url)
            # happy and sad back to their deployed parameters, one more app added: every superseded
            # version released, the restored apps' content hashes (prefix-cache salts) as deployed
            answers = await updates.group(s, url, updates.after())
            assert all(a["in_flight_versions"] == [] for a in answers), answers
            counts = await settle(s, url, pool)
            assert counts["versions_superseded"] == 0, counts
            updates.assert_versions(counts)
            assert {a["name"]: a["content_hash"] for a in answers[:2]} == {n: hashes[n] for n in ("happy", "sad")}
            last = dict(kind="cmpl", prompt=[5, 17, 300, 42, 9], sel=["happy", "late", "sad"], max_tokens=8, id=3000)
            status, resp = await Client(s, url, refs).post(*body(last))
            assert status == 200 and hf_check(hf, last, result_of(resp), updates.apps), resp
            return stats, m0, m1, rss0, rss1, dev0, dev1

    stats, m0, m1, rss0, rss1, dev0, dev1 = asyncio.run(main())
    stats.update(refs.stats)
    print("soak:", stats, "preemptions", m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"])
    print("rss MiB before", rss0, "after", rss1)
    device = {k: (dev0[k] / 2**20, dev1[k] / 2**20) for k in ("device_allocated_bytes", "device_reserved_bytes")
              if k in dev0}
    print("soak settings: seconds", LOAD_S, "clients", CONCURRENCY, "compiled", COMPILED, "server args",
          EXTRA_SERVER_ARGS, "device MiB before/after", device)
    # the load had every kind of fault in it
    assert stats.get("completed", 0) > 50 and stats.get("streamed", 0) > 20, stats
    assert stats.get("aborted", 0) > 5 and stats.get("disconnected", 0) > 5 and stats.get("refused", 0) > 5, stats
    assert m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"] > 0, (m0, m1)
    # and responses checked against parameters set during a round
    assert stats["watched"] == 4 * ROUNDS and stats.get("deferred", 0) >= 2 * ROUNDS, stats
    # memory flat (same processes before and after)
    assert set(rss0) == set(rss1), (rss0, rss1)
    growth = sum(rss1.values()) - sum(rss0.values())
    assert growth < RSS_TOLERANCE_MIB, (growth, rss0, rss1)
    for k, (before, after) in device.items():  # on a GPU
        assert after - before < DEVICE_TOLERANCE_MIB, (k, before, after)
    text = log.read_text()
    assert "Traceback" not in text, text[text.index("Traceback") - 2000:][:6000]


# ----------------------------------------------------------------------------- HTTP selections, fuzzed

def _http_item():
    from hypothesis import strategies as st

    name = st.sampled_from(["happy", "sad", "probe", "seal", "cast", "guard", "nope", ""])
    scale = st.one_of(st.floats(-4, 4), st.integers(-3, 3), st.sampled_from([1e30, 10**400, "1", True, None]))
    layers = st.one_of(st.lists(st.integers(-1, 5), max_size=3), st.sampled_from(["all", 1]))
    obj = st.fixed_dictionaries({"name": name}, optional={"scale": scale, "layers": layers, "x": st.integers()})
    junk = st.one_of(st.none(), st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=2))
    return st.one_of(name, obj, junk)


def _http_selection():
    from hypothesis import strategies as st

    return st.one_of(st.lists(_http_item(), max_size=3), st.sampled_from([5, "happy", {}, {"apps": ["happy"]}]))


def test_http_selections_fuzzed_answer_200_or_400_naming_the_field(soak_server, hf):
    """Selections drawn by hypothesis (names, unknown names, scales of every type and size, layer
    lists, extra keys, junk items), sent as ``mi_apps`` or ``vllm_xargs.xmix`` (a list or its JSON
    text), to completions or chat, streamed or not: each is answered 200, or 400 whose message
    names the field as sent (an HTTP 400 before any byte of a stream); a 200 for a selection of
    the add apps equals HF; after every example a plain request still equals HF."""
    import urllib.error
    import urllib.request

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url, model, _, _ = soak_server
    prompt = [5, 17, 300, 42, 9]
    plain = hf.greedy(prompt, 4)

    def post(path, b):
        req = urllib.request.Request(url + path, data=json.dumps(b).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    @settings(max_examples=40, deadline=None, derandomize=os.environ.get("XMIX_FUZZ_RANDOM") != "1",
              suppress_health_check=[HealthCheck.too_slow])
    @given(sel=_http_selection(), via=st.sampled_from(["mi_apps", "xargs", "xargs_json"]), chat=st.booleans(),
           stream=st.booleans())
    def check_one(sel, via, chat, stream):
        b = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
             "stream": stream}
        if via == "mi_apps":
            b["mi_apps"], field = sel, "mi_apps"
        else:
            b["vllm_xargs"], field = {"xmix": json.dumps(sel) if via == "xargs_json" else sel}, "vllm_xargs"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if chat:
            b["messages"] = [{"role": "user", "content": "The cat"}]
        else:
            b["prompt"] = prompt
        status, text = post(path, b)
        assert status in (200, 400), (status, text[:500], b)
        if status == 400:
            assert field in text, (field, text[:500])
        elif not stream and not chat and isinstance(sel, list) and all(isinstance(x, str) for x in sel) \
                and set(sel) <= {"happy", "sad"}:  # the add apps at their deployed scales: HF
            toks = json.loads(text)["choices"][0]["token_ids"]
            assert toks == hf.greedy(prompt, 4, app_deltas([{"name": x} for x in sel])), sel
        s2, t2 = post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True})
        assert s2 == 200 and json.loads(t2)["choices"][0]["token_ids"] == plain

    check_one()

    async def idle():  # and nothing of those requests is left in the worker's runtime
        import aiohttp

        async with aiohttp.ClientSession() as s:
            counts = await settle(s, url, make_pool())
            assert_idle(counts, counts, distinct_selections=4096)  # (slots.SlotRegistry's bound)

    asyncio.run(idle())
