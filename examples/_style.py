"""Shared by the examples: the shipped two-style model and its style direction, extracted on vLLM.

Each example imports this from its own folder (``python examples/<name>.py``)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm_xmix.models import code_share, two_style_path, two_style_texts  # noqa: E402

MODEL = two_style_path()
TEXTS = two_style_texts()
PROSE = ["And he said unto them,", "Blessed are the", "In the beginning"]
CODE = ["def get(self, key):\n", "import os\n", "class Foo:\n"]


def engine(**kw):
    """A vLLM engine on the shipped model (float32, CPU-sized)."""
    from vllm import LLM

    return LLM(model=MODEL, dtype="float32", max_model_len=512, max_num_seqs=32, seed=0,
               kv_cache_memory_bytes=256 << 20, **kw)


def style_direction(layers) -> dict:
    """``{layer: mean(code) - mean(prose)}`` of ``blocks.{layer}.hook_resid_post`` over the
    shipped training excerpts, captured with a capture app on vLLM (one short-lived engine)."""
    from vllm_xmix import deploy
    from vllm_xmix.extract import capture_app, collect_activations, diff_of_means

    llm = engine(enforce_eager=True, additional_config=deploy(capture_app(layers)))
    code = collect_activations(llm, TEXTS["code"]["train"])
    prose = collect_activations(llm, TEXTS["prose"]["train"])
    del llm
    return diff_of_means(code, prose)


def style_of(llm, prompts, apps=None, n=8, max_tokens=40) -> list[float]:
    """Per prompt, the mean code share of ``n`` sampled continuations (temperature 0.8)."""
    from vllm_xmix import SamplingParams

    sps = [SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=i, mi_apps=apps or None)
           for _ in prompts for i in range(n)]
    outs = llm.generate([p for p in prompts for _ in range(n)], sps, use_tqdm=False)
    return [sum(code_share(o.outputs[0].text) for o in outs[i * n:(i + 1) * n]) / n for i in range(len(prompts))]


def show(text: str, n: int = 70) -> str:
    t = text.strip().replace("\n", "\u21b5")
    return (t if len(t) <= n else t[: n - 1] + "\u2026") or "(blank lines)"
