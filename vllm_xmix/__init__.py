"""vllm-xmix: serving-native mechanistic-interpretability apps for vLLM.

Public API: :class:`MIApp` (builder), :func:`deploy` (``additional_config`` for ``LLM``/``vllm
serve``), :class:`SamplingParams` (per-request ``mi_apps``). The vLLM plugin itself is
:func:`vllm_xmix.plugin.register`, loaded by vLLM through the ``vllm.general_plugins`` entry point.
"""

from .spec import AppSpec, MIApp, XmixSpecError, deploy

__version__ = "0.1.0"

__all__ = ["MIApp", "AppSpec", "deploy", "SamplingParams", "XmixSpecError", "__version__"]


def __getattr__(name):  # importing vllm is slow: only when SamplingParams is asked for
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
