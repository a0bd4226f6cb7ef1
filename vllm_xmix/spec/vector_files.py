"""Reading a vector: inline floats or a file (``.safetensors``, ``.pt``/``.pth``, ``.npy``) to
float32 numpy, with its range checks. Knows nothing of apps or models (:mod:`.vectors` checks an
op's vector against the model; :mod:`.model` hashes apps by their vectors' values)."""

from __future__ import annotations

import os

import numpy as np

from .errors import XmixSpecError


def _tensor_to_numpy(t, field: str, where: str = "") -> np.ndarray:
    """A real torch tensor as float32 numpy on the CPU.

    Raises:
        XmixSpecError: for a complex or bool tensor (``where``, e.g. ``" in v.pt"``, ends the message).
    """
    import torch

    if t.is_complex() or t.dtype == torch.bool:
        raise XmixSpecError(f"{field}: expected real numbers, got a {t.dtype} tensor{where}")
    return t.detach().float().cpu().numpy()


def _read_safetensors(path: str, key: str | None, field: str) -> np.ndarray:
    """The tensor ``key`` of a ``.safetensors`` file (``key`` optional when it holds one)."""
    from safetensors.numpy import load_file

    tensors = load_file(path)
    if key is None:
        if len(tensors) != 1:
            raise XmixSpecError(f"{field}.key: {path} holds {sorted(tensors)}; name one")
        return next(iter(tensors.values()))
    if key not in tensors:
        raise XmixSpecError(f"{field}.key: {key!r} not in {path} (has {sorted(tensors)})")
    return tensors[key]


def _read_torch(path: str, key: str | None, field: str) -> np.ndarray:
    """A ``.pt``/``.pth`` file holding a tensor, or a dict of them (``key`` names one)."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        if key is None or key not in obj:
            raise XmixSpecError(f"{field}.key: {key!r} not in {path} (has {sorted(obj)})")
        obj = obj[key]
    elif key is not None:
        raise XmixSpecError(f"{field}.key: {path} holds a single {type(obj).__name__}, not a dict of "
                            f"tensors: key {key!r} selects nothing (leave it out)")
    if not isinstance(obj, torch.Tensor):
        raise XmixSpecError(f"{field}.path: {path} holds a {type(obj).__name__}, not a tensor")
    return _tensor_to_numpy(obj, field, f" in {path}")


def _read_npy(path: str, key: str | None, field: str) -> np.ndarray:
    """A ``.npy`` file (one array, so no ``key``; no pickles)."""
    if key is not None:
        raise XmixSpecError(f"{field}.key: a .npy file holds one array: key {key!r} selects "
                            f"nothing in {path} (leave it out)")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:  # numpy suggests allow_pickle=True here: never for a vector file
        raise XmixSpecError(f"{field}.path: {path} is not a plain numeric .npy array ({e.__class__.__name__}: "
                            "object arrays and pickles are not read); save it with np.save(path, "
                            "vector.astype(np.float32))") from None


#: file suffix -> reader(path, key, field)
_READERS = {".safetensors": _read_safetensors, ".pt": _read_torch, ".pth": _read_torch, ".npy": _read_npy}


def _read_vector_file(ref, field: str) -> tuple[np.ndarray, str]:
    """The array a :class:`VectorFile` names (any dtype and shape), and its expanded path.

    Raises:
        XmixSpecError: missing file, unsupported suffix, unknown key, unreadable file.
    """
    path = os.path.expanduser(ref.path)
    if not os.path.exists(path):
        raise XmixSpecError(f"{field}.path: file not found: {path}")
    reader = next((r for suffix, r in _READERS.items() if path.endswith(suffix)), None)
    try:
        if reader is None:
            raise XmixSpecError(f"{field}.path: unsupported file type {path} (.safetensors, .pt, .npy)")
        return reader(path, ref.key, field), path
    except XmixSpecError:
        raise
    except Exception as e:  # corrupt file etc.
        raise XmixSpecError(f"{field}.path: cannot read {path}: {e}") from None


def load_vector(ref, field: str, allow_neg_inf: bool = False) -> np.ndarray:
    """Load a vector as float32 numpy ``[d]``.

    ``allow_neg_inf``: accept ``-inf`` entries (``router_bias`` masks).

    Raises:
        XmixSpecError: missing file, unknown key (or a key for a file without keys: ``.npy``, a
            ``.pt`` holding one tensor), not real numbers (bool, complex, strings), not 1-D,
            non-finite values.
    """
    if isinstance(ref, list):
        src = np.asarray(ref, dtype=np.float64)
    else:
        src, path = _read_vector_file(ref, field)
        src = np.asarray(src)
        if src.dtype.kind not in "fiu":  # bool, complex, strings: not a direction
            raise XmixSpecError(f"{field}: expected real numbers, got dtype {src.dtype} in {path}")
    big = np.isfinite(src) & (np.abs(src) > np.finfo(np.float32).max)
    if big.any():
        raise XmixSpecError(f"{field}: entry {int(np.flatnonzero(big)[0])} ({float(src[big][0]):.3g}) exceeds "
                            f"float32's range (+-{float(np.finfo(np.float32).max):.3g}); vectors are applied in float32")
    arr = src.astype(np.float32)
    if arr.size and not arr.any() and np.any(src):  # (a vector of zeros as given is the caller's choice)
        raise XmixSpecError(f"{field}: every entry underflows float32 (the largest, {float(np.abs(src).max()):.3g}, is "
                            f"below {float(np.finfo(np.float32).smallest_subnormal):.3g}): the vector would apply as "
                            "zeros; vectors are applied in float32")
    if arr.ndim != 1:
        raise XmixSpecError(f"{field}: expected a 1-D vector [d_model], got shape {list(arr.shape)}")
    bad = ~np.isfinite(arr)
    if allow_neg_inf:
        bad &= ~np.isneginf(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise XmixSpecError(f"{field}: {non_finite_entry(i, float(arr[i]), allow_neg_inf)}")
    return arr


def non_finite_entry(i: int, x: float, allow_neg_inf: bool) -> str:
    """The refusal of vector entry ``i``, the non-finite value ``x`` (inline vectors and vector
    files alike): ``allow_neg_inf`` where the vector may be a router_bias mask."""
    return f"entry {i} is {x}: " + ("of the non-finite values only -inf is allowed (a router_bias mask), never NaN "
                                    "or +inf" if allow_neg_inf else "NaN and inf are not allowed (-inf only in "
                                    "router_bias masks)")
