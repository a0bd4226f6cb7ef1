"""The model shipped with the package, where steering and probes visibly mean something.

``two_style`` (``vllm_xmix/models/two_style/``, card: ``MODEL_CARD.md`` there): a Llama of
1.57M parameters (d_model 128, 4 layers, 2 heads of 64, FFN 512, BPE vocabulary of 4096, tied
embeddings, float32) trained on the CPU with ``training/train.py`` on two styles of text:
Python standard-library source (``"code"``) and the King James Bible (``"prose"``). A
difference-of-means vector between the styles steers generations from one style to the other,
and a linear probe tells them apart per token. Random-weight models for the oracle tests are
:mod:`vllm_xmix.tiny`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

STYLES = ("code", "prose")
_DIR = Path(__file__).resolve().parent / "two_style"

#: a line that looks like Python: brackets, operators, decorators, indentation, keywords, self/None
CODE_LINE = re.compile(r"[=()\[\]{}_#@<>]|^\s{2,}\S|^\s*(def|class|import|from|return|if|elif|else|for|while|try|"
                       r"except|with|raise|yield|assert|pass|break|continue|lambda)\b|\bself\b|\bNone\b|\bTrue\b")


def two_style_path() -> str:
    """The shipped model's directory (config, ``model.safetensors``, tokenizer), for
    ``vllm.LLM(model=...)`` or ``transformers.AutoModelForCausalLM.from_pretrained``.

    Raises:
        FileNotFoundError: the package was installed without its data files."""
    if not (_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"the two_style model is missing from {_DIR} (installed without package data?)")
    return str(_DIR)


@lru_cache(maxsize=1)
def two_style_texts() -> dict[str, dict[str, list[str]]]:
    """Excerpts of the training corpus, ``{"code" | "prose": {"train" | "held": [text, ...]}}``
    (48 each, about 320 characters; ``held`` excerpts come from documents the model never saw),
    for extracting vectors and probes and for checking them on held-out text."""
    return json.loads((_DIR / "texts.json").read_text())


def looks_like_code(line: str) -> bool:
    """Whether one line of text looks like Python (:data:`CODE_LINE`). On the corpus it flags
    about 98% of the standard library's lines and under 1% of the King James Bible's."""
    return bool(CODE_LINE.search(line))


def code_share(text: str) -> float:
    """The style measure: the share (0..1) of ``text``'s non-space characters that sit in lines
    that look like code (:func:`looks_like_code`); 0.0 for text without any."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    total = sum(len(ln) for ln in lines)
    if not total:
        return 0.0
    return sum(len(ln) for ln in lines if looks_like_code(ln)) / total


__all__ = ["STYLES", "CODE_LINE", "two_style_path", "two_style_texts", "looks_like_code", "code_share"]
