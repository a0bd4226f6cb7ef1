"""Where a served request's time to first token goes, from vLLM's own metrics (``/metrics``).

vLLM's front end records, per finished request, timestamps that split its time to first token
(TTFT) into three parts (``vllm.v1.metrics.stats``):

* **queue**: from the engine core queuing the request to the scheduler first scheduling it
  (``vllm:request_queue_time_seconds``);
* **prefill**: from that scheduling to the engine core's timestamp of the output that carries
  the first token (``vllm:request_prefill_time_seconds``): the prefill step(s), and under async
  scheduling the step that was running when it was scheduled;
* **front end**: the rest of the TTFT the front end measured from the request's arrival
  (``vllm:time_to_first_token_seconds``): input processing in the API server, the request's
  trip to the engine core, and the first output's trip back and its processing.

:class:`MetricsMeter` reads ``/metrics`` at the start and at the end of a benchmark run and
returns the run's means of those histograms (sums and counts differenced: the run's own
requests only, on a server that served others before), in ms, with the front-end part as TTFT
minus queue minus prefill; also the mean tokens per engine step
(``vllm:iteration_tokens_total``), prefix-cache queries and hits (tokens) and preemptions.
Parsed with ``prometheus_client``'s text parser (a vLLM dependency).
"""

from __future__ import annotations

import time
import urllib.request

#: histograms whose run means are reported (key -> vLLM metric family)
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
}
#: counters whose increase over the run is reported (key -> vLLM metric family)
COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "preemptions": "vllm:num_preemptions",
}


def parse(text: str) -> dict[str, float]:
    """Prometheus exposition text -> ``{"<family>_sum" / "<family>_count": value}`` for the
    :data:`HISTOGRAMS` and ``{"<family>": value}`` for the :data:`COUNTERS`, each summed over
    its label sets (engines, models). Families absent from ``text`` are absent from the result."""
    from prometheus_client.parser import text_string_to_metric_families

    want_h, want_c = set(HISTOGRAMS.values()), set(COUNTERS.values())
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in want_h:
            for s in fam.samples:
                if s.name in (fam.name + "_sum", fam.name + "_count"):
                    out[s.name] = out.get(s.name, 0.0) + float(s.value)
        elif fam.name in want_c:
            for s in fam.samples:
                if s.name in (fam.name, fam.name + "_total"):
                    out[fam.name] = out.get(fam.name, 0.0) + float(s.value)
    return out


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """:func:`parse` of ``<base_url>/metrics``.

    Raises:
        OSError (``urllib.error.URLError``): the server did not answer."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


def difference(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's share of two :func:`parse` results: per histogram key of :data:`HISTOGRAMS`
    its mean (``<key>_ms``, ms; ``step_tokens``: tokens) and count (``<key>_n``), the
    ``front_end_ms`` part of TTFT (mean TTFT - mean queue - mean prefill, when all three were
    recorded for the same number of requests), the split of a request's whole time (when e2e,
    queue, prefill and decode were recorded for the same requests): ``engine_ms`` (mean queue +
    prefill + decode: from the engine core having the request to its last token, by the engine
    core's timestamps) and ``front_end_total_ms`` (mean e2e - ``engine_ms``: the API server's part
    at both ends, the input processing and the trip to the engine core before, the last
    output's processing after; under load, the wait of the outputs of earlier steps for the
    API server's event loop), and each counter's increase. A histogram without new observations
    is left out."""
    out: dict = {}
    for key, fam in HISTOGRAMS.items():
        n = after.get(fam + "_count", 0.0) - before.get(fam + "_count", 0.0)
        if n <= 0:
            continue
        total = after.get(fam + "_sum", 0.0) - before.get(fam + "_sum", 0.0)
        scale = 1.0 if key == "step_tokens" else 1e3
        out[f"{key}_{'mean' if key == 'step_tokens' else 'ms'}"] = round(total / n * scale, 4)
        out[f"{key}_n"] = int(round(n))
    if all(f"{k}_n" in out for k in ("ttft", "queue", "prefill")) and out["ttft_n"] == out["queue_n"] == out["prefill_n"]:
        out["front_end_ms"] = round(out["ttft_ms"] - out["queue_ms"] - out["prefill_ms"], 4)
    out.update(whole_time_split(out))
    for key, fam in COUNTERS.items():
        if fam in after:
            out[key] = int(round(after[fam] - before.get(fam, 0.0)))
    return out


def whole_time_split(parts: dict) -> dict:
    """``engine_ms`` and ``front_end_total_ms`` of a run's :func:`difference` (see there) from its
    e2e, queue, prefill and decode means, when all four were recorded for the same number of
    requests; else {}."""
    counts = [parts.get(f"{k}_n") for k in ("e2e", "queue", "prefill", "decode")]
    if None in counts or len(set(counts)) != 1:
        return {}
    engine = round(parts["queue_ms"] + parts["prefill_ms"] + parts["decode_ms"], 4)
    return {"engine_ms": engine, "front_end_total_ms": round(parts["e2e_ms"] - engine, 4)}


class MetricsMeter:
    """Reads a server's ``/metrics`` now; :meth:`stop` reads it again and returns
    :func:`difference` (``{"error": ...}`` alone when either read failed: a run's numbers are
    never lost to its metrics)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        try:
            self.before: dict[str, float] | None = scrape(base_url)
            self.error = None
        except Exception as e:  # noqa: BLE001 - reported with the run
            self.before, self.error = None, f"{type(e).__name__}: {e}"

    def stop(self, expect: int | None = None, wait_s: float = 3.0) -> dict:
        """The run's :func:`difference`. ``expect``: the requests the run finished; the front end
        records a request's latencies just after answering it, so the read is repeated (for up
        to ``wait_s``) until that many were recorded."""
        if self.before is None:
            return {"error": self.error}
        deadline = time.monotonic() + wait_s
        try:
            while True:
                out = difference(self.before, scrape(self.base_url))
                if expect is None or out.get("e2e_n", 0) >= expect or time.monotonic() > deadline:
                    return out
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}


def summary(parts: dict) -> str:
    """One line of a run's :func:`difference`: TTFT and its parts (ms), tokens per step."""
    if not parts or "ttft_ms" not in parts:
        return parts.get("error", "no metrics") if parts else "no metrics"
    got = [f"ttft {parts['ttft_ms']:.2f}"] + [f"{k} {parts[k + '_ms']:.2f}" for k in ("queue", "prefill")
                                             if k + "_ms" in parts]
    if "front_end_ms" in parts:
        got.append(f"front end {parts['front_end_ms']:.2f}")
    line = " / ".join(got) + " ms"
    if "step_tokens_mean" in parts:
        line += f", {parts['step_tokens_mean']:.1f} tokens/step"
    return line


#: summary.md's columns of the TTFT parts table: (key in :func:`difference`, header)
TABLE = [("ttft_ms", "TTFT (ms)"), ("front_end_ms", "front end (ms)"), ("queue_ms", "queue (ms)"),
         ("prefill_ms", "prefill (ms)"), ("step_tokens_mean", "tokens per step"),
         ("prefix_cache_hits", "prefix-cache hit tokens")]


#: summary.md's columns of the request-time table: (key in :func:`difference`, header)
E2E_TABLE = [("e2e_ms", "e2e (ms)"), ("engine_ms", "engine core: queue + prefill + decode (ms)"),
             ("decode_ms", "decode (ms)"), ("front_end_total_ms", "front end, both ends (ms)")]


def e2e_rows(by_config: dict[str, list[dict]], api_us_per_token: dict[str, list[float]] | None = None) -> list[str]:
    """Markdown rows (with header) of where a request's whole time went, per configuration: the
    median over its runs of :data:`E2E_TABLE`'s means, and (``api_us_per_token``: configuration
    -> per run) the API server's CPU microseconds per output token; [] when no run has the split."""
    import numpy as np

    by_config = {c: [{**p, **whole_time_split(p)} for p in runs] for c, runs in by_config.items()}  # (older runs)
    if not any("engine_ms" in p for runs in by_config.values() for p in runs):
        return []
    api = api_us_per_token or {}
    with_api = any(api.values())
    head = [h for _, h in E2E_TABLE] + (["API server CPU per output token (us)"] if with_api else [])
    rows = ["| config | " + " | ".join(head) + " |", "|---" * (1 + len(head)) + "|"]
    for c, runs in by_config.items():
        cells = _median_cells(runs, [k for k, _ in E2E_TABLE], ".1f")
        if with_api:
            cells.append(f"{np.median(api[c]):.1f}" if api.get(c) else "-")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return rows


def _median_cells(runs: list[dict], keys: list[str], fmt: str) -> list[str]:
    """Per key, the median over the runs that have it (formatted with ``fmt``), else "-"."""
    import numpy as np

    return [format(np.median(xs), fmt) if xs else "-" for xs in ([p[k] for p in runs if k in p] for k in keys)]


def table_rows(by_config: dict[str, list[dict]]) -> list[str]:
    """Markdown rows (with header) of the TTFT parts of each configuration: the median over its
    runs' :func:`difference` results (``by_config``: configuration -> those results); [] when
    no run has them."""
    if not any("ttft_ms" in p for runs in by_config.values() for p in runs):
        return []
    rows = ["| config | " + " | ".join(h for _, h in TABLE) + " |", "|---" * (1 + len(TABLE)) + "|"]
    for c, runs in by_config.items():
        rows.append(f"| {c} | " + " | ".join(_median_cells(runs, [k for k, _ in TABLE], ".2f")) + " |")
    return rows
