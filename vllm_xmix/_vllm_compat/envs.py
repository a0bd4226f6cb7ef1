"""Environment: the plugin's variables are made known to ``vllm.envs`` (its
``environment_variables`` table), so that vLLM's check of the environment
(``envs.validate_environ``, run when an engine is configured) neither warns "Unknown vLLM
environment variable detected" about them nor, with ``--fail-on-environ-validation``, refuses
to start.

The graph-variant settings enter vLLM's torch.compile cache key with their values, as vLLM's own
variables do (``envs.compile_factors``); the admin key's value never does: its getter reports
only whether it is set (a secret must not decide, nor be derivable from, a cache directory)."""

from __future__ import annotations

import os

from .core import record

#: the plugin's environment variables -> whether their value may enter the compile cache key
PLUGIN_ENV = {
    "VLLM_XMIX_GRAPH_VARIANTS": True,
    "VLLM_XMIX_MAX_GRAPH_VARIANTS": True,
    "VLLM_XMIX_PIECEWISE_VARIANTS": True,
    "VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE": True,
    "VLLM_XMIX_ADMIN_KEY": False,
}


def _getter(name: str, value_in_key: bool):
    if value_in_key:
        return lambda: os.environ.get(name)
    return lambda: name in os.environ


def patch_envs() -> list[str]:
    """Add :data:`PLUGIN_ENV` to ``vllm.envs.environment_variables`` (idempotent); returns the
    names added."""
    import vllm.envs as envs

    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return []
    added = []
    for name, value_in_key in PLUGIN_ENV.items():
        if name not in table:
            table[name] = _getter(name, value_in_key)
            added.append(name)
    if added:
        record("vllm.envs.environment_variables")
    return added
