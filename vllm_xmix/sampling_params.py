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
            wire, canonical = _selection(self.mi_apps)
            # (a copy or a decoded clone already carries the same selection in extra_args)
            if self.extra_args and CONFIG_KEY in self.extra_args and self.extra_args[CONFIG_KEY] != wire:
                raise _given_twice("(or, if mi_apps was edited in place after construction, assign it a new "
                                   "list instead)")
            self._set_selection(wire, canonical)

    def __setattr__(self, name: str, value: Any) -> None:
        """``mi_apps`` assigned after construction replaces the selection it made (validated as
        on construction; None clears it), so that the request runs what the field says. A
        selection given as ``extra_args["xmix"]`` (no ``mi_apps``) is not replaced: assigning
        ``mi_apps`` beside it raises, as constructing with both does.

        Raises:
            ValueError: a malformed ``mi_apps`` (naming the field), or ``mi_apps`` beside a
                selection in ``extra_args["xmix"]``."""
        if name != "mi_apps":
            return super().__setattr__(name, value)
        ea = self.extra_args
        owned = self.mi_apps is not None  # the selection in extra_args is mi_apps' own
        if value is None:
            if owned and ea and CONFIG_KEY in ea:
                super().__setattr__("extra_args", {k: v for k, v in ea.items() if k != CONFIG_KEY} or None)
            return super().__setattr__("mi_apps", None)
        wire, canonical = _selection(value)
        if not owned and ea and CONFIG_KEY in ea and ea[CONFIG_KEY] != wire:
            raise _given_twice()
        self._set_selection(wire, canonical)

    def _set_selection(self, wire: dict, canonical: list[dict]) -> None:
        ea = dict(self.extra_args or {})
        ea[CONFIG_KEY] = wire
        super().__setattr__("extra_args", ea)
        super().__setattr__("mi_apps", canonical)


def _given_twice(hint: str = "") -> ValueError:
    """The error for ``mi_apps`` beside a different selection in ``extra_args["xmix"]``."""
    return ValueError(f"mi_apps: the selection is given twice, as mi_apps and as extra_args[{CONFIG_KEY!r}]; "
                      f"give one of them{' ' + hint if hint else ''}")


def _selection(mi_apps) -> tuple[dict, list[dict]]:
    """``mi_apps`` checked: (its wire form for ``extra_args["xmix"]``, its canonical spelling).

    Raises:
        ValueError: malformed, naming the field (``mi_apps[0].scale: ...``)."""
    apps = parse_request_apps(mi_apps, field="mi_apps")
    return request_to_wire(apps), [a.model_dump(exclude_none=True) for a in apps]
