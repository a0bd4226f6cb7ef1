"""The fixed vocabulary of the spec language: the config key, hook names, op kinds, capture
positions, and the normalisation of a user's hook name to a TransformerLens hook name."""

from __future__ import annotations

import re

from .errors import XmixSpecError


#: Key under ``additional_config`` (deployment) and ``SamplingParams.extra_args`` (request).
CONFIG_KEY = "xmix"

#: TransformerLens hook names (per decoder layer) that the runtime can attach ops to; which of
#: them a model has is its adapter's ``HOOKS`` (checked at engine start).
SUPPORTED_HOOKS: tuple[str, ...] = (
    "hook_resid_pre",
    "hook_attn_out",
    "hook_resid_mid",
    "hook_mlp_out",
    "hook_resid_post",
    "mlp.hook_router_logits",
)
KNOWN_HOOKS = SUPPORTED_HOOKS
ROUTER_HOOK = "mlp.hook_router_logits"
SUPPORTED_WRITE_KINDS: tuple[str, ...] = ("add", "ablate", "clamp", "router_bias")
KNOWN_WRITE_KINDS: tuple[str, ...] = ("add", "ablate", "clamp", "router_bias")
KNOWN_READ_KINDS: tuple[str, ...] = ("capture", "linear_probe", "cosine")
#: capture positions: every processed position, the positions that predicted a generated token,
#: or only the last prompt token (the one that predicted the first generated token)
CAPTURE_POSITIONS: tuple[str, ...] = ("all", "generated", "last")


def _hook_name(hook: str) -> str:
    """Normalise ``"resid_post"``, ``"hook_resid_post"`` or ``"blocks.{L}.hook_resid_post"``."""
    if not isinstance(hook, str):
        raise XmixSpecError(f"submodule: expected a hook name string, got {type(hook).__name__}")
    m = re.match(r"^blocks\.(\d+)\.", hook.strip())
    if m:
        raise XmixSpecError(
            f"submodule: {hook!r} names layer {m.group(1)}; give layers with .layers([...]) and the hook "
            f"as 'blocks.{{L}}.{hook.strip()[m.end():]}' or {hook.strip()[m.end():]!r}"
        )
    h = re.sub(r"^blocks\.\{L\}\.", "", hook.strip())
    if h in KNOWN_HOOKS:
        return h
    if "hook_" + h in KNOWN_HOOKS:
        return "hook_" + h
    raise XmixSpecError(
        f"submodule: unknown hook {hook!r}; known TransformerLens hook names: {', '.join(KNOWN_HOOKS)}"
    )
