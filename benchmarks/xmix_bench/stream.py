"""profile stream: the front end's host time per streamed chunk of a request with a probe.

The OpenAI server streams one ``data: {...}`` chunk per token; for a request with reads the
plugin adds the chunk's ``mi_results`` (``_vllm_compat.openai_server._with_reads``: the values new
in that chunk, ``results.StreamDelta``; the final chunk also ``mi_results_complete``). This runs
on the server's event loop for every token of every such request, beside the engine's outputs
of all the others, so its microseconds per chunk multiply by the tokens per second served.

Measured without a server: vLLM's own completion stream chunks (``CompletionStreamResponse``,
serialized as vLLM's server does, ``exclude_unset=True``),
a request with one probe (``--prompt`` prompt values with the first token, then one value per
token, as the engine core sends them; ``--layers``: read at that many layers, a value of each), ``--tokens`` chunks; the median over ``--repeats``
streams of the mean microseconds per chunk, of the decode chunks alone (neither the first,
which carries the prompt's values, nor the last), and of the last chunk (all the values,
assembled: ``mi_results_complete``), each also as its minimum over the streams (on a busy
machine the median moves with the load, the minimum much less). Host CPU time of this machine:
compare lines of one machine only.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from . import common


def stream_cost(prompt: int = 256, tokens: int = 128, repeats: int = 20, layers: int = 1) -> dict:
    """``{"us_per_chunk": median, "runs": [...], ...}`` for streams of one probe's values
    (``layers`` > 1: the probe read at that many layers, one value of each per token)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    from vllm_xmix._vllm_compat.openai_server import _with_reads
    from vllm_xmix.results import ReadResults

    rng = np.random.default_rng(0)

    def one() -> tuple[float, float, float]:
        acc, deltas, spent, decode, last = ReadResults(prompt), {}, 0.0, 0.0, 0.0
        acc.add([("probe_one", "probe", 16 + k, "probe", 0, prompt, 1, rng.random((prompt, 1), np.float32).tobytes())
                 for k in range(layers)])
        for i in range(tokens):
            if i:
                acc.add([("probe_one", "probe", 16 + k, "probe", prompt + i - 1, 1, 1,
                          rng.random((1, 1), np.float32).tobytes()) for k in range(layers)])
            ch = CompletionStreamResponse(id="cmpl-0", created=1, model="m", choices=[CompletionResponseStreamChoice(
                index=0, text=" tok", finish_reason=None if i < tokens - 1 else "length")])
            s = f"data: {ch.model_dump_json(exclude_unset=True)}\n\n"
            view = acc.view(None)
            t0 = time.perf_counter()
            _with_reads(s, view, deltas)
            dt = time.perf_counter() - t0
            spent += dt
            if 0 < i < tokens - 1:
                decode += dt
            last = dt
        return spent / tokens * 1e6, decode / max(tokens - 2, 1) * 1e6, last * 1e6

    for _ in range(3):  # warm-up
        one()
    each = [one() for _ in range(repeats)]
    runs, dec, fin = ([round(r[k], 2) for r in each] for k in range(3))
    return {"us_per_chunk": statistics.median(runs), "us_per_chunk_min": min(runs), "runs": runs,
            "us_per_decode_chunk": statistics.median(dec), "us_per_decode_chunk_min": min(dec), "decode_runs": dec,
            "us_final_chunk": statistics.median(fin), "us_final_chunk_min": min(fin), "final_runs": fin,
            "prompt": prompt, "tokens": tokens, "layers": layers,
            "commit": common.git_commit(), "date": common.today(), "command": common.command_line()}
