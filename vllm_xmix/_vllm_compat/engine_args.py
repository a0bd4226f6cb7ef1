"""Engine arguments: ``EngineArgs.create_engine_config`` is wrapped so that the deployment in
``additional_config["xmix"]`` is checked against the model and the engine
(:func:`vllm_xmix.validation.validate_engine_config`) when the engine is configured, in the
front-end process, before any worker starts; on an unsupported vLLM the same function refuses an
engine with apps deployed instead of silently ignoring them."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY
from ..validation import validate_engine_config
from .core import SUPPORTED_VLLM, mark


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            validate_engine_config(cfg)
            return cfg

        return create_engine_config

    mark("EngineArgs.create_engine_config", EngineArgs, "create_engine_config", wrap)


def patch_refusal(v: str) -> None:
    """On an unsupported vLLM: patch only the config check, so that an engine with apps deployed
    refuses to start instead of silently ignoring them."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            add = cfg.additional_config
            if isinstance(add, dict) and CONFIG_KEY in add:
                raise RuntimeError(
                    f"vllm-xmix supports vLLM >= {'.'.join(map(str, SUPPORTED_VLLM[0]))}, < "
                    f"{'.'.join(map(str, SUPPORTED_VLLM[1]))}; this is vLLM {v}. Apps in "
                    "additional_config.xmix cannot run."
                )
            return cfg

        return create_engine_config

    mark("EngineArgs.create_engine_config (refusal)", EngineArgs, "create_engine_config", wrap)
