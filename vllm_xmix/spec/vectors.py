"""Loading an op's vector: inline floats or a file (``.safetensors``, ``.pt``/``.pth``,
``.npy``) to float32 numpy, and checking it against the model's widths (``d_model``,
``n_experts``)."""

from __future__ import annotations

import os

import numpy as np

from .errors import XmixSpecError
from .model import ReadOp, VectorFile, WriteOp
from .names import ROUTER_HOOK


def load_vector(ref: list[float] | VectorFile, field: str, allow_neg_inf: bool = False) -> np.ndarray:
    """Load a vector as float32 numpy ``[d]``.

    Raises:
        XmixSpecError: missing file, unknown key (or a key for a file without keys: ``.npy``, a
            ``.pt`` holding one tensor), not real numbers (bool, complex, strings), not 1-D,
            non-finite values.
    """
    if isinstance(ref, list):
        arr = np.asarray(ref, dtype=np.float32)
    else:
        path = os.path.expanduser(ref.path)
        if not os.path.exists(path):
            raise XmixSpecError(f"{field}.path: file not found: {path}")
        try:
            if path.endswith(".safetensors"):
                from safetensors.numpy import load_file

                tensors = load_file(path)
                if ref.key is None:
                    if len(tensors) != 1:
                        raise XmixSpecError(f"{field}.key: {path} holds {sorted(tensors)}; name one")
                    arr = next(iter(tensors.values()))
                elif ref.key not in tensors:
                    raise XmixSpecError(f"{field}.key: {ref.key!r} not in {path} (has {sorted(tensors)})")
                else:
                    arr = tensors[ref.key]
            elif path.endswith((".pt", ".pth")):
                import torch

                obj = torch.load(path, map_location="cpu", weights_only=True)
                if isinstance(obj, dict):
                    if ref.key is None or ref.key not in obj:
                        raise XmixSpecError(f"{field}.key: {ref.key!r} not in {path} (has {sorted(obj)})")
                    obj = obj[ref.key]
                elif ref.key is not None:
                    raise XmixSpecError(f"{field}.key: {path} holds a single {type(obj).__name__}, not a dict of "
                                        f"tensors: key {ref.key!r} selects nothing (leave it out)")
                if not isinstance(obj, torch.Tensor):
                    raise XmixSpecError(f"{field}.path: {path} holds a {type(obj).__name__}, not a tensor")
                if obj.is_complex() or obj.dtype == torch.bool:
                    raise XmixSpecError(f"{field}: expected real numbers, got a {obj.dtype} tensor in {path}")
                arr = obj.detach().float().numpy()
            elif path.endswith(".npy"):
                if ref.key is not None:
                    raise XmixSpecError(f"{field}.key: a .npy file holds one array: key {ref.key!r} selects "
                                        f"nothing in {path} (leave it out)")
                arr = np.load(path, allow_pickle=False)
            else:
                raise XmixSpecError(f"{field}.path: unsupported file type {path} (.safetensors, .pt, .npy)")
        except XmixSpecError:
            raise
        except Exception as e:  # corrupt file etc.
            raise XmixSpecError(f"{field}.path: cannot read {path}: {e}") from None
        arr = np.asarray(arr)
        if arr.dtype.kind not in "fiu":  # bool, complex, strings: not a direction
            raise XmixSpecError(f"{field}: expected real numbers, got dtype {arr.dtype} in {path}")
        arr = arr.astype(np.float32)
    if arr.ndim != 1:
        raise XmixSpecError(f"{field}: expected a 1-D vector [d_model], got shape {list(arr.shape)}")
    bad = ~np.isfinite(arr)
    if allow_neg_inf:
        bad &= ~np.isneginf(arr)
    if bad.any():
        raise XmixSpecError(f"{field}: contains NaN or inf")
    return arr


def hook_width(hook: str, d_model: int, n_experts: int | None, field: str) -> int:
    """Last dimension of the value at ``hook``: ``n_experts`` at the router logits, else ``d_model``."""
    if hook == ROUTER_HOOK:
        if n_experts is None:
            raise XmixSpecError(f"{field}.hook: this model has no MoE router")
        return n_experts
    return d_model


def load_op_vector(op: WriteOp | ReadOp, field: str, d_model: int, n_experts: int | None) -> np.ndarray:
    """Load one op's vector (float32, as stored) and check it against the model: length
    ``d_model`` (``n_experts`` for ``router_bias`` and for reads at the router logits), a
    direction for ablate/clamp, safe masks. A capture has no vector: zeros of the hook's width.

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
        if w.shape[0] != width:
            what = "n_experts" if op.hook == ROUTER_HOOK else "d_model"
            raise XmixSpecError(f"{field}.weight: length {w.shape[0]} != {what} {width} of this model")
        return w
    vec = load_vector(op.vector, field + ".vector", allow_neg_inf=op.kind == "router_bias")
    if op.kind == "router_bias":
        if np.isneginf(vec).all():
            raise XmixSpecError(f"{field}.vector: masks every expert (-inf everywhere)")
        if np.isneginf(vec).any() and op.scale < 0:
            raise XmixSpecError(f"{field}.scale: must be >= 0 for a router_bias with -inf masks")
        if n_experts is None:
            raise XmixSpecError(f"{field}.hook: this model has no MoE router")
        if vec.shape[0] != n_experts:
            raise XmixSpecError(f"{field}.vector: length {vec.shape[0]} != n_experts {n_experts} of this model")
        return vec
    if vec.shape[0] != d_model:
        raise XmixSpecError(f"{field}.vector: length {vec.shape[0]} != d_model {d_model} of this model")
    if op.kind in ("ablate", "clamp") and not np.any(vec):
        raise XmixSpecError(f"{field}.vector: zero vector has no direction to {op.kind}")
    return vec
