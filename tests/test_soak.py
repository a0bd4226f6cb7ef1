"""Soak: a real OpenAI server (``python -m vllm.entrypoints.openai.api_server``, CPU, tiny Llama,
float32, apps deployed) under concurrent mixed load with faults, on loopback, for a bounded time.

Load: ``CONCURRENCY`` clients send requests drawn from a fixed pool of distinct requests
(completions and chat; apps off, steering adds, token- and activation-conditioned writes, probe
reads, a probe-triggered stop; streamed or not). Faults among them: aborts (the client gives up on a
non-streaming request and closes the connection: vLLM aborts the request), disconnects in the
middle of a stream, refused selections (HTTP 400), and preemption with recompute (the KV cache
holds 10 blocks of 32 tokens for 8 running requests of up to 72 tokens). Between rounds a
separate step may change apps' parameters (:class:`ParameterUpdates`, off for now).

Checked:
- every completed response equals its solo reference (the same request sent alone to the same
  server before the load: tokens, finish and stop reasons exactly, read values to 1e-4), streamed
  ones chunk by chunk; the references of plain and steered requests equal HF's greedy tokens;
- nothing leaks: after each round the worker's MI runtime (slots, registered rows, read snapshots,
  the per-token device rows pointing at requests; ``XmixWorkerExtension.xmix_counts``) is back at
  the idle engine's counts, and the resident memory of the server's processes is flat;
- the server logged no traceback, and, stopped with ``--shutdown-timeout``, no leaked shared
  memory or semaphore (see README, "Stopping a server": the warning at exit with vLLM's default
  ``--shutdown-timeout 0`` is vLLM's own, with or without the plugin).

``XMIX_SOAK_SECONDS`` sets the load time of the measured rounds (default 60; a warm-up round
of 15 s comes first).
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
from conftest import app_deltas, deployment, running_server, unit_rms

pytestmark = pytest.mark.soak

CONCURRENCY = 12  # clients; more than max_num_seqs (8), so requests also wait in the queue
LOAD_S = float(os.environ.get("XMIX_SOAK_SECONDS", "60"))
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


def soak_deployment() -> dict:
    """happy/sad (adds, conftest) + a probe, SEAL (token-conditioned add), CAST (request-scope
    condition read at layer 1, adds at 2-3, and the same cosine returned so the test can see
    the decision), a probe with a stop trigger."""
    from vllm_xmix import MIApp, deploy

    dep = deployment()
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
    return dep


SELECTIONS = [None, ["happy"], [{"name": "sad", "scale": -1.5}], ["happy", "sad"], ["probe"], ["probe", "happy"],
              ["seal"], ["cast"], ["cast", "probe"], ["guard"], [{"name": "happy", "layers": [1]}],
              ["seal", "probe", "sad"]]
#: refused selections: (mi_apps, text the HTTP 400 must contain)
BAD = [(["nope"], "mi_apps[0].name: unknown app 'nope'"), ([{"name": "happy", "scale": "x"}], "mi_apps[0].scale"),
       ([{"name": "happy", "layers": [3]}], "mi_apps[0].layers"), ([{"name": "happy", "scale": 1e30}], "mi_apps[0]"),
       ([{"name": "probe", "scale": 2.0}], "mi_apps[0].scale"),
       ([{"name": "happy", "scale": 10**400}], "mi_apps[0].scale: must be finite")]
CHAT_TEXTS = ["The cat sat on", "Tell me about the probe", "a steering vector in each layer", "Hello"]


def make_pool(seed: int = 0) -> list[dict]:
    """The distinct requests: every selection with two prompts (3-48 token ids) and 4-24 tokens
    to generate, plus a few chat requests."""
    rng = random.Random(seed)
    pool = []
    for sel in SELECTIONS:
        for _ in range(2):
            n = rng.choice([3, 5, 9, 17, 30, 48])
            pool.append(dict(kind="cmpl", prompt=[rng.randrange(3, 1000) for _ in range(n)], sel=sel,
                             max_tokens=rng.choice([4, 8, 16, 24])))
    for i, text in enumerate(CHAT_TEXTS):
        pool.append(dict(kind="chat", text=text, sel=SELECTIONS[i % 4], max_tokens=8))
    for i, r in enumerate(pool):
        r["id"] = i
    return pool


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


def check(res: dict, ref: dict, r: dict) -> None:
    assert res["tokens"] == ref["tokens"], (r, res["tokens"], ref["tokens"])
    assert (res["finish"], res["stop"]) == (ref["finish"], ref["stop"]), r
    assert_close(res["mi"], ref["mi"])


# ----------------------------------------------------------------------------- client side


class Client:
    """aiohttp against one server; every outcome is counted in ``stats``."""

    def __init__(self, session, url: str, refs: dict):
        self.s, self.url, self.refs = session, url, refs
        self.stats: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    async def post(self, path: str, b: dict) -> tuple[int, dict]:
        async with self.s.post(self.url + path, json=b) as resp:
            return resp.status, await resp.json(content_type=None)

    async def complete(self, r: dict) -> None:
        status, resp = await self.post(*body(r))
        assert status == 200, (r, status, resp)
        check(result_of(resp), self.refs[r["id"]], r)
        self.count("completed")

    async def abort(self, r: dict, after: float) -> None:
        """The client gives up after ``after`` seconds (the connection closes: vLLM aborts the
        request); a response that came first is checked."""
        try:
            status, resp = await asyncio.wait_for(self.post(*body(r)), after)
        except asyncio.TimeoutError:
            self.count("aborted")
            return
        assert status == 200, (r, status, resp)
        check(result_of(resp), self.refs[r["id"]], r)
        self.count("completed")

    async def stream(self, r: dict, stop_after: int | None = None) -> None:
        """A streamed request, read to the end and checked chunk by chunk against the solo
        reference, or dropped after ``stop_after`` chunks (the client disconnects)."""
        path, b = body(r, stream=True)
        toks, finish, stop, final, n = [], None, None, None, 0
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
                if stop_after is not None and n >= stop_after:
                    resp.close()  # the client goes away mid-stream
                    self.count("disconnected")
                    return
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
        ref = self.refs[r["id"]]
        check(dict(tokens=toks, finish=finish, stop=stop, mi=final), ref, r)
        for (app, name), vals in values.items():  # the chunks' values are the final ones
            assert_close(vals, ref["mi"][app][name], f"stream {app}.{name}")
        self.count("streamed")

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


class ParameterUpdates:
    """Parameter updates between soak rounds: change deployed apps' parameters on the running
    server (runtime app management, ``POST /v1/mi/apps/...``) and return the names of the apps
    that changed; the soak then takes the solo references of the requests that use them again
    before the next round, so every response of a round is compared with the deployment that
    served it.

    Off: runtime app management does not exist in this version, so :meth:`apply` changes
    nothing. To switch it on, override :meth:`apply` (and ``enabled``) in the
    ``parameter_updates`` fixture."""

    enabled = False

    async def apply(self, session, url: str, round_no: int) -> set[str]:
        return set()


@pytest.fixture
def parameter_updates() -> ParameterUpdates:
    return ParameterUpdates()


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
            "--max-model-len", "128", "--enforce-eager", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--block-size", "32", "--num-gpu-blocks-override", "10", "--worker-extension-cls", EXTENSION,
            "--shutdown-timeout", "10", "--additional-config", json.dumps(soak_deployment())]
    procs: list = []
    # VLLM_SERVER_DEV_MODE: vLLM's development endpoints (/collective_rpc) on loopback, for the counts
    with running_server(args, log, env={"VLLM_SERVER_DEV_MODE": "1"}, proc_out=procs) as url:
        yield url, tiny_llama, procs[0], log
    time.sleep(2)  # the resource tracker reports after the last process holding it exits
    text = log.read_text()
    assert procs[0].returncode == 0, text[-3000:]
    assert "leaked" not in text, text[-3000:]


def test_soak_mixed_load_with_faults(soak_server, hf, parameter_updates):
    import aiohttp

    url, model, proc, log = soak_server
    pool = make_pool()

    async def main():
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64)) as s:
            refs: dict[int, dict] = {}

            async def references(rs):
                for r in rs:  # alone on the server: one request at a time
                    status, resp = await Client(s, url, refs).post(*body(r))
                    assert status == 200, (r, resp)
                    refs[r["id"]] = result_of(resp)

            await references(pool)
            # the references are right: plain and steered tokens equal HF's
            for r in pool:
                if r["kind"] == "cmpl" and r["sel"] in (None, ["happy"], ["happy", "sad"]):
                    sel = [{"name": n} for n in r["sel"] or []]
                    assert refs[r["id"]]["tokens"] == hf.greedy(r["prompt"], r["max_tokens"], app_deltas(sel)), r
            # no knife edges: a decision within 1e-3 of its threshold could flip between batch
            # shapes (float32 sums in another order); such requests leave the pool
            def knife_edge(r) -> bool:
                mi = refs[r["id"]]["mi"] or {}
                if "cast" in mi and r["kind"] == "cmpl":
                    mean = np.array(mi["cast"]["sim_seen"], dtype=np.float64)[:len(r["prompt"])].mean()
                    if abs(mean - CAST_THRESHOLD) < 1e-3:
                        return True
                return "guard" in mi and min(abs(v - GUARD_THRESHOLD) for v in mi["guard"]["probe"]) < 1e-3

            edges = [r["id"] for r in pool if knife_edge(r)]
            pool[:] = [r for r in pool if r["id"] not in edges]
            print("requests at a knife edge, left out:", edges)
            assert len(edges) <= 3 and any(r["sel"] == ["cast"] for r in pool), edges
            fired = [r for r in pool if (refs[r["id"]]["stop"] or "").startswith("xmix:guard")]
            assert fired, "the guard's stop trigger should fire on some requests"

            start = await settle(s, url, pool)
            assert_idle(start, start)
            m0 = await metrics(s, url)
            stats: dict[str, int] = {}

            async def load(seconds: float, seed: int) -> None:
                clients = [Client(s, url, refs) for _ in range(CONCURRENCY)]
                until = time.monotonic() + seconds
                await asyncio.gather(*(c.worker(pool, seed * 1000 + i, until) for i, c in enumerate(clients)))
                for c in clients:
                    for k, v in c.stats.items():
                        stats[k] = stats.get(k, 0) + v

            await load(WARMUP_S, 0)  # warm-up: lazily built caches and buffers, allocator high-water marks
            assert_idle(await settle(s, url, pool), start)
            rss0 = rss_mib(proc.pid)
            for k in range(ROUNDS):
                if k:  # parameter updates between rounds (off until runtime app management exists)
                    changed = await parameter_updates.apply(s, url, k)
                    if changed:
                        await references([r for r in pool if {a if isinstance(a, str) else a["name"]
                                                              for a in r["sel"] or []} & changed])
                await load(LOAD_S / ROUNDS, k + 1)
                assert_idle(await settle(s, url, pool), start)
            rss1 = rss_mib(proc.pid)
            m1 = await metrics(s, url)
            return stats, m0, m1, rss0, rss1, refs

    stats, m0, m1, rss0, rss1, refs = asyncio.run(main())
    print("soak:", stats, "preemptions", m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"])
    print("rss MiB before", rss0, "after", rss1)
    # the load had every kind of fault in it
    assert stats.get("completed", 0) > 50 and stats.get("streamed", 0) > 20, stats
    assert stats.get("aborted", 0) > 5 and stats.get("disconnected", 0) > 5 and stats.get("refused", 0) > 5, stats
    assert m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"] > 0, (m0, m1)
    # memory flat (same processes before and after)
    assert set(rss0) == set(rss1), (rss0, rss1)
    growth = sum(rss1.values()) - sum(rss0.values())
    assert growth < RSS_TOLERANCE_MIB, (growth, rss0, rss1)
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
