"""An op's vector checked against the model: its width (``d_model``, ``n_experts``), a direction
for projections, safe router masks, a read weight's norm (reading the vector itself:
:mod:`.vector_files`)."""

from __future__ import annotations

import numpy as np

from .errors import XmixSpecError
from .model import ReadOp, WriteOp
from .names import ROUTER_HOOK
from .vector_files import load_vector


def hook_width(hook: str, d_model: int, n_experts: int | None, field: str) -> int:
    """Last dimension of the value at ``hook``: ``n_experts`` at the router logits, else ``d_model``.

    Raises:
        XmixSpecError: ``{field}.hook`` at the router logits of a model without an MoE router.
    """
    if hook == ROUTER_HOOK:
        if n_experts is None:
            raise XmixSpecError(f"{field}.hook: this model has no MoE router")
        return n_experts
    return d_model


def _check_width(vec: np.ndarray, hook: str, width: int, field: str) -> None:
    """Raises XmixSpecError naming ``field`` if ``vec`` is not ``[width]`` (the hook's width)."""
    if vec.shape[0] != width:
        what = "n_experts" if hook == ROUTER_HOOK else "d_model"
        raise XmixSpecError(f"{field}: length {vec.shape[0]} != {what} {width} of this model")


#: largest L2 norm of a read's weight: with a residual stream the next RMSNorm's float32 sum of
#: squares can hold (norm <= sqrt(float32 max)), the float32 dot product stays below float32 max / 256
MAX_READ_WEIGHT_NORM = float(np.sqrt(np.finfo(np.float32).max)) / 256


def load_op_vector(op: WriteOp | ReadOp, field: str, d_model: int, n_experts: int | None) -> np.ndarray:
    """Load one op's vector (float32, as stored) and check it against the model: length
    ``d_model`` (``n_experts`` for ``router_bias`` and for reads at the router logits), a
    direction for ablate/clamp, safe masks, a read's weight norm at most
    :data:`MAX_READ_WEIGHT_NORM` (its float32 dot product with the stream stays finite). A
    capture has no vector: zeros of the hook's width.

    Raises:
        XmixSpecError: naming the field.
    """
    if op.primitive == "read":
        width = hook_width(op.hook, d_model, n_experts, field)
        if op.kind == "capture":
            return np.zeros(width, np.float32)
        w = load_vector(op.weight, field + ".weight")
        if op.kind == "cosine" and not np.any(w):
            raise XmixSpecError(f"{field}.weight: zero vector has no direction for a cosine similarity")
        _check_width(w, op.hook, width, field + ".weight")
        norm = float(np.linalg.norm(w.astype(np.float64)))
        if norm > MAX_READ_WEIGHT_NORM:
            raise XmixSpecError(
                f"{field}.weight: norm {norm:.3g} is too large: its dot product with an activation the next RMSNorm "
                f"can still normalise (norm up to sqrt(float32 max) = {np.sqrt(float(np.finfo(np.float32).max)):.3g}) "
                f"could overflow float32, giving inf/NaN {op.kind} values (and triggers that never fire); keep the "
                f"norm at most {MAX_READ_WEIGHT_NORM:.3g}")
        return w
    vec = load_vector(op.vector, field + ".vector", allow_neg_inf=op.kind == "router_bias")
    if op.kind == "router_bias":
        if np.isneginf(vec).all():
            raise XmixSpecError(f"{field}.vector: masks every expert (-inf everywhere)")
        if np.isneginf(vec).any() and op.scale < 0:
            raise XmixSpecError(f"{field}.scale: must be >= 0 for a router_bias with -inf masks")
    # a router_bias write is at the router logits (WriteOp checks), every other write is not
    _check_width(vec, op.hook, hook_width(op.hook, d_model, n_experts, field), field + ".vector")
    if op.kind in ("ablate", "clamp") and not np.any(vec):
        raise XmixSpecError(f"{field}.vector: zero vector has no direction to {op.kind}")
    return vec
