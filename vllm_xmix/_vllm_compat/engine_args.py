"""Engine arguments: ``EngineArgs.create_engine_config`` is wrapped so that the deployment in
``additional_config["xmix"]`` is checked against the model and the engine
(:func:`vllm_xmix.validation.validate_engine_config`) when the engine is configured, in the
front-end process, before any worker starts (an architecture this vLLM serves with other classes
than its adapter's, :attr:`.versions.VersionTable.unserved_architectures`, is refused there too);
on an untested vLLM the same function refuses an engine with apps deployed instead of silently
ignoring them."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY, XmixSpecError
from ..validation import validate_engine_config
from .core import mark, supported_text, vllm_version
from .versions import table


def _check_served(cfg) -> None:
    """Refuse apps on an architecture this vLLM does not serve with the adapter's classes."""
    add = cfg.additional_config
    if not (isinstance(add, dict) and CONFIG_KEY in add):
        return
    mc = cfg.model_config
    archs = list(getattr(mc, "architectures", None) or getattr(mc.hf_config, "architectures", []) or [])
    unserved = table().unserved_architectures
    for a in archs:
        if a in unserved:
            raise XmixSpecError(f"additional_config.xmix: architecture {a} is not supported by vllm-xmix on "
                                f"vLLM {vllm_version()}: {unserved[a]}")


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            _check_served(cfg)
            validate_engine_config(cfg)
            return cfg

        return create_engine_config

    mark("EngineArgs.create_engine_config", EngineArgs, "create_engine_config", wrap)


def patch_refusal(v: str) -> None:
    """On an untested vLLM: patch only the config check, so that an engine with apps deployed
    refuses to start instead of silently ignoring them."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            add = cfg.additional_config
            if isinstance(add, dict) and CONFIG_KEY in add:
                raise RuntimeError(
                    f"vllm-xmix is tested on vLLM {supported_text()} only; this is vLLM {v}. Apps in "
                    "additional_config.xmix cannot run."
                )
            return cfg

        return create_engine_config

    mark("EngineArgs.create_engine_config (refusal)", EngineArgs, "create_engine_config", wrap)
