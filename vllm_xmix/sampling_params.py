"""``vllm_xmix.SamplingParams``: vLLM's SamplingParams plus ``mi_apps``.

``SamplingParams(mi_apps=[...], temperature=0, ...)`` is a ``vllm.SamplingParams`` (it works with
``LLM.generate``); the selection is validated on construction and travels in
``extra_args["xmix"]``, so plain ``vllm.SamplingParams(extra_args={"xmix": {"apps": [...]}})``
is equivalent (that is also what the OpenAI server's ``vllm_xargs`` fills).
"""

from __future__ import annotations

from typing import Any

import vllm

from .plugin import register
from .spec import CONFIG_KEY, parse_request_apps, request_to_wire

# Using the API implies the plugin in this process (idempotent; vLLM normally does it through
# the entry point). Engines still refuse to start if VLLM_PLUGINS keeps it out of their workers.
register()


class SamplingParams(vllm.SamplingParams):
    """vLLM ``SamplingParams`` with per-request MI app selection.

    Args:
        mi_apps: apps to switch on for this request, each an app name, an ``MIApp``, or a dict
            ``{"name": str, "scale": float (optional), "layers": [int] (optional)}``.
            ``scale`` multiplies the app's vector(s) (default: the deployed scale);
            ``layers`` restricts the app to a subset of its deployed layers.
        **kwargs: every ``vllm.SamplingParams`` argument.

    Raises:
        ValueError: malformed ``mi_apps``, or ``mi_apps`` beside ``extra_args["xmix"]`` (the message names the field, e.g.
            ``mi_apps[0].scale: expected a number, got str``). Names unknown to the engine are
            reported when the request is added (``LLM.generate`` raises ``ValueError``).
    """

    mi_apps: list[Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mi_apps is not None:
            apps = parse_request_apps(self.mi_apps, field="mi_apps")
            wire = request_to_wire(apps)
            # (a copy or a decoded clone already carries the same selection in extra_args)
            if self.extra_args and CONFIG_KEY in self.extra_args and self.extra_args[CONFIG_KEY] != wire:
                raise ValueError(f"mi_apps: the selection is given twice, as mi_apps and as "
                                 f"extra_args[{CONFIG_KEY!r}]; give one of them")
            ea = dict(self.extra_args or {})
            ea[CONFIG_KEY] = wire
            self.extra_args = ea
            self.mi_apps = [a.model_dump(exclude_none=True) for a in apps]
