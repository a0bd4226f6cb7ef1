"""What differs between the tested vLLM versions, one module per version series, each a
:class:`VersionTable` that the component modules of :mod:`vllm_xmix._vllm_compat` consult
(:func:`table`) instead of testing versions themselves:

* :mod:`.v0_26` -- vLLM 0.26.x, the primary version (every difference is stated against it);
* :mod:`.v0_32` -- vLLM 0.32.x.

A wrapped function that is the same in every tested version is not mentioned here."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VersionTable:
    """The version-specific names and facts of one tested vLLM series.

    ``series``: ``(major, minor)``.
    ``unserved_architectures``: HF architectures of :data:`vllm_xmix.adapters.ADAPTERS` that this
    vLLM serves with other classes than the adapter's (e.g. through its Transformers backend): an
    app deployed on one is refused at engine start, and their adapters' classes are not patched.
    ``moe_block_calls_its_gate``: whether a MoE block that handed its gate to the ``FusedMoE``
    runner calls the gate itself once the runner has none (:mod:`.fused_moe`); where it does not,
    a pre-hook on the runner does.
    """

    series: tuple[int, int]
    unserved_architectures: dict[str, str] = field(default_factory=dict)
    moe_block_calls_its_gate: bool = True


def _tables() -> dict[tuple[int, int], VersionTable]:
    from . import v0_26, v0_32

    return {t.series: t for t in (v0_26.TABLE, v0_32.TABLE)}


@functools.lru_cache(maxsize=None)
def table(series: tuple[int, int] | None = None) -> VersionTable:
    """The table of ``series`` (default: the installed vLLM's).

    Raises:
        RuntimeError: no table for that series (not a tested vLLM: the plugin then applies only the
        refusal patch and never asks)."""
    from ..core import SUPPORTED_VLLM, version_series, vllm_version

    tables = _tables()
    assert set(tables) == set(SUPPORTED_VLLM), (sorted(tables), SUPPORTED_VLLM)
    if series is None:
        series = version_series(vllm_version())
    if series not in tables:
        raise RuntimeError(f"vllm_xmix: no patch table for vLLM {series}")
    return tables[series]


__all__ = ["VersionTable", "table"]
