"""Deployments: parsing ``additional_config["xmix"]`` into a :class:`DeploymentConfig`, and
checking it against the model the engine loaded (layer range, vector lengths, condition
layers, token ids)."""

from __future__ import annotations

from typing import Any

from .errors import XmixSpecError, _json, _validated
from .model import DeploymentConfig
from .vectors import load_op_vector


def parse_deployment(raw: Any) -> DeploymentConfig:
    """Parse ``additional_config["xmix"]`` (a dict, an :class:`MIApp` list, or a JSON string).

    Raises:
        XmixSpecError: naming the offending field (``xmix.apps.0.ops.0.vector: ...``).
    """
    if isinstance(raw, str):
        raw = _json(raw, "additional_config.xmix")
    if isinstance(raw, DeploymentConfig):
        return raw
    return _validated(DeploymentConfig, raw, "additional_config.xmix")


def resolve_layers(layers: list[int] | str, n_layers: int, field: str) -> list[int]:
    """An op's layers as decoder-layer indices: ``"all"`` -> ``0 .. n_layers - 1``.

    Raises:
        XmixSpecError: ``{field}: layer index ... out of range`` for an index >= ``n_layers``.
    """
    if layers == "all":
        return list(range(n_layers))
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise XmixSpecError(f"{field}: layer index {bad[0]} out of range [0, {n_layers}) for this model")
    return list(layers)


def validate_deployment(dep: DeploymentConfig, n_layers: int, d_model: int, n_experts: int | None = None,
                        vocab_size: int | None = None) -> None:
    """Check a deployment against the model (layer range, vector size, finiteness).

    Raises:
        XmixSpecError: naming the field, e.g. ``xmix.apps[0](happy).ops[0].vector: length 63 != d_model 64``.
    """
    for ai, app in enumerate(dep.apps):
        for oi, op in enumerate(app.ops):
            f = f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}"
            layers = resolve_layers(op.layers, n_layers, f + ".layers")
            load_op_vector(op, f, d_model, n_experts)
            cond = getattr(op, "cond", None) if op.primitive == "write" else None
            if cond is None:
                continue
            if cond.buffer is not None:
                src = app.buffer_read(cond.buffer)
                a = src.layers[0]
                if min(layers) <= a:
                    raise XmixSpecError(
                        f"{f}.layers: a write conditioned on buffer {cond.buffer!r} (read at layer {a}) must be at "
                        f"later layers (got {min(layers)}): the condition is computed on the way up")
                if src.scope == "request" and cond.positions != "all":
                    raise XmixSpecError(f"{f}.cond.positions: a request-scope condition already applies to "
                                        "generated tokens only; leave positions at 'all'")
            if cond.latch is not None:
                src = app.latch_read(cond.latch)
                src_layers = resolve_layers(src.layers, n_layers, f"{f}.cond.latch")
                if min(layers) <= max(src_layers):
                    raise XmixSpecError(
                        f"{f}.layers: a write latched on read {cond.latch!r} (layers {src_layers}) must be at later "
                        f"layers than all of the read's (got {min(layers)}): the latch is set on the way up, so "
                        "that it holds for every token of a step before any latched write runs")
            ids = cond.tokens if cond.tokens is not None else cond.tokens_prev
            if ids is not None and vocab_size is not None and max(ids) >= vocab_size:
                raise XmixSpecError(f"{f}.cond: token id {max(ids)} >= vocab size {vocab_size} of this model")
