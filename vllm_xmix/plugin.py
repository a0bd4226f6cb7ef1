"""vLLM plugin entry point (``vllm.general_plugins`` -> ``vllm_xmix.plugin:register``).

vLLM calls :func:`register` in every process it starts (front end, engine core, workers, the
model-inspection subprocess). It is idempotent, applies every patch eagerly (with ``spawn`` the
child re-runs it; with ``fork`` the child inherits the patched classes), never initialises CUDA,
and logs one line saying what it patched.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.xmix")
_REGISTERED = False


def register() -> None:
    """Register the ``vllm_xmix`` custom ops and patch vLLM (see :mod:`vllm_xmix._vllm_compat`).

    On a vLLM version outside the tested ones it logs an error and patches only a guard that refuses to
    start an engine with ``additional_config["xmix"]`` (so apps are never silently ignored).
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from . import _vllm_compat as compat

    v = compat.vllm_version()
    if not compat.version_supported(v):
        logger.error("vllm_xmix: vLLM %s is not supported (tested: %s); xmix apps are disabled", v,
                     compat.supported_text())
        compat._patch_refusal(v)
        _REGISTERED = True
        return
    from .ops import register_ops

    register_ops()
    patched = compat.apply_patches()
    _REGISTERED = True
    from vllm.logger import init_logger

    init_logger("vllm.xmix").info("vllm_xmix: registered on vLLM %s; patched %s", v, ", ".join(patched))
