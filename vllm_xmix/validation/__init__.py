"""Checks of deployments and requests against one engine (its ``VllmConfig``), between the spec
(:mod:`vllm_xmix.spec`: the data and its checks against model dimensions) and the runtime:

* :mod:`.engine` -- the deployment, when vLLM configures the engine;
* :mod:`.requests` -- a request's app selection, when the request is added;
* :mod:`.http` -- the same for the OpenAI server, before it answers.

Every check raises :class:`vllm_xmix.spec.XmixSpecError` (a ``ValueError``) naming the field.
"""

from .engine import envs_plugins_exclude_xmix, validate_engine_config
from .http import http_selection_check
from .requests import PROJ_SPAN, check_combined_magnitude, check_write_magnitude, validate_request, validate_selection

__all__ = ["PROJ_SPAN", "check_combined_magnitude", "check_write_magnitude", "envs_plugins_exclude_xmix", "http_selection_check",
           "validate_engine_config", "validate_request", "validate_selection"]
