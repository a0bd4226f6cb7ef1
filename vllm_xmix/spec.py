"""MI app specifications: the builder users write, the plain data it lowers to, validation.

An *app* is plain data (pydantic models, JSON-serialisable): a name and a list of ops. The
builder (``MIApp("name").write("add", vector=v).layers([3, 5]).submodule("hook_resid_post")``)
follows the xMIx paper's programming interface (Blum et al., section 4.1) and produces that data.
Apps are *deployed* when the engine starts (``LLM(..., additional_config=deploy(app, ...))``), so
the set of hook sites is part of vLLM's config hash and therefore of the torch.compile cache key.
Requests then only *switch* deployed apps on, with their own scale
(``SamplingParams(mi_apps=[{"name": "happy", "scale": 4.0}])``).

Supported now: the write kinds ``add`` (activation addition, Turner et al. 2023), ``ablate``
(directional ablation, Arditi et al. 2024), ``clamp`` and ``router_bias`` (SteerMoE, Fayyaz et
al. 2026) and the read kinds ``linear_probe`` and ``capture`` at the TransformerLens hook points
of :data:`SUPPORTED_HOOKS` (see docs/hooks.md). Conditions are part of the spec language but are
rejected with a clear ``ValueError`` until they are implemented: a declared op never silently
does nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool, StrictFloat,
                      StrictInt, Tag, ValidationError, field_validator, model_validator)

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

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")


class XmixSpecError(ValueError):
    """A bad app spec or request: the message names the offending field."""


def _finite_number(v) -> float:
    """Any real number (Python or numpy), not bool, not a string; finite."""
    import numbers

    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"must be finite, got {v}")
    return v


def _layer_list(v) -> list[int]:
    """A non-empty sequence of distinct non-negative ints (list, tuple, range, numpy ints)."""
    import numbers

    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
        raise ValueError(f"expected a list of layer indices, got {type(v).__name__} {v!r}")
    out = []
    for x in v:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise ValueError(f"layer indices must be integers, got {type(x).__name__} {x!r}")
        out.append(int(x))
    if not out:
        raise ValueError("empty list")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate layer indices in {out}")
    if any(x < 0 for x in out):
        raise ValueError(f"negative layer index in {out}")
    return sorted(out)


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


#: decoder-layer indices of an op: ``"all"`` or distinct non-negative ints (range, numpy ok)
Layers = Annotated[Union[list[int], Literal["all"]], BeforeValidator(lambda v: v if v == "all" else _layer_list(v))]


#: an entry of an inline vector: a real number (JSON number; bools and numeric strings refused)
Number = Union[StrictFloat, StrictInt]


class VectorFile(BaseModel):
    """A vector stored in a file: ``.safetensors`` (``key`` names the tensor; optional when the
    file holds one), ``.pt``/``.pth`` (a tensor, or a dict with ``key``) or ``.npy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    key: str | None = None


class Cond(BaseModel):
    """The predicate of a conditional write (xMIx section 3: a write guarded by a predicate
    computed on the GPU). Exactly one of:

    * ``tokens``: token ids; the write applies at a position whose *current* (input) token is in
      the set (SEAL, Chen et al. 2025: steer at ``"\\n\\n"``-like tokens);
    * ``tokens_prev``: the write applies at a position whose *previous* token is in the set;
    * ``buffer``: the name of a condition read of the same app (``read(..., buffer=name)``),
      compared with ``threshold`` by ``op``. Its ``scope`` decides what is compared: ``"token"``:
      the value at the same position (same forward); ``"request"``: the mean of the value over
      the request's prompt tokens, decided once the prompt is processed, and the write then
      applies at every position from the last prompt token on, i.e. to every generated token
      (CAST, Lee et al. 2025). Identical for every chunking of the prompt.

    ``positions="generated"`` restricts a token or per-token condition to positions of generated
    tokens (the prompt's KV is then untouched and keeps sharing the prefix cache).
    """

    model_config = ConfigDict(extra="forbid")
    tokens: list[int] | None = None
    tokens_prev: list[int] | None = None
    buffer: str | None = None
    op: Literal[">", ">=", "<", "<="] | None = None  # buffer conditions; default ">"
    threshold: float | None = None
    positions: Literal["all", "generated"] = "all"

    @field_validator("tokens", "tokens_prev", mode="before")
    @classmethod
    def _ids(cls, v):
        if v is None:
            return v
        import numbers

        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            raise ValueError(f"expected a list of token ids, got {type(v).__name__}")
        out = []
        for x in v:
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) or x < 0:
                raise ValueError(f"token ids must be non-negative integers, got {x!r}")
            out.append(int(x))
        if not out:
            raise ValueError("empty token set")
        return sorted(set(out))

    @field_validator("threshold", mode="before")
    @classmethod
    def _thr(cls, v):
        return None if v is None else _finite_number(v)

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("tokens", "tokens_prev", "buffer") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of tokens, tokens_prev, buffer (got {given or 'none'})")
        if self.buffer is not None and self.threshold is None:
            raise ValueError("threshold: a buffer condition needs a threshold")
        if self.buffer is None and (self.threshold is not None or self.op is not None):
            raise ValueError("threshold/op: only a buffer condition takes them")
        if self.buffer is not None and self.op is None:
            self.op = ">"
        return self

    def kind(self) -> str:
        return "tokens" if self.tokens is not None else "tokens_prev" if self.tokens_prev is not None else "buffer"


class WriteOp(BaseModel):
    """One write: ``kind`` applied at ``blocks.{L}.{hook}`` for every ``L`` in ``layers``.

    Fields:
        kind: for every token ``t`` of a request that has the app on (prompt and generated):
            ``"add"``: ``h[t] += scale * vector`` (activation addition, Turner et al. 2023);
            ``"ablate"``: ``h[t] -= scale * (h[t] . r) r`` with ``r = vector / |vector|``
            (directional ablation, Arditi et al. 2024; scale 1 removes the direction);
            ``"clamp"``: ``h[t] += scale * (value - h[t] . r) r`` (scale 1 sets the projection
            on ``r`` to ``value``). For ``hook_resid_*`` hooks ``h`` is the whole residual stream.
            ``"router_bias"`` (only at ``mlp.hook_router_logits``): ``logits[t] += scale * bias``
            with ``bias`` ``[n_experts]`` before top-k; ``-inf`` masks an expert (SteerMoE,
            Fayyaz et al. 2026). Use a positive scale with ``-inf`` entries.
        hook: TransformerLens hook name (``hook_resid_post``: the residual stream after layer L,
            i.e. what layer L+1 reads; on vLLM's fused stream that is ``hidden + residual``).
        layers: decoder-layer indices (0-based) or ``"all"``.
        vector: float values, length ``d_model`` (the model's hidden size), or a ``VectorFile``.
        scale: default coefficient; a request may override it (0 = off).
        value: clamp target (projection on ``r``, in the activation's units); required for
            ``clamp`` and refused for the other kinds.
        cond: optional :class:`Cond`: the write applies only where the predicate holds.
    """

    model_config = ConfigDict(extra="forbid")
    primitive: Literal["write"] = "write"
    kind: str = "add"
    hook: str = "hook_resid_post"
    layers: Layers = "all"
    vector: Union[list[Number], VectorFile]
    scale: float = 1.0
    value: float | None = None
    cond: Cond | None = None

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KNOWN_WRITE_KINDS:
            raise ValueError(f"unknown write kind {v!r}; known: {', '.join(KNOWN_WRITE_KINDS)}")
        if v not in SUPPORTED_WRITE_KINDS:
            raise ValueError(f"write kind {v!r} is not yet supported (supported: {', '.join(SUPPORTED_WRITE_KINDS)})")
        return v

    @field_validator("hook")
    @classmethod
    def _hook(cls, v: str) -> str:
        h = _hook_name(v)
        if h not in SUPPORTED_HOOKS:
            raise ValueError(f"hook {h!r} is not yet supported for writes (supported: {', '.join(SUPPORTED_HOOKS)})")
        return h

    @field_validator("vector", mode="before")
    @classmethod
    def _vector(cls, v):
        if isinstance(v, (list, tuple)):
            if len(v) == 0:
                raise ValueError("empty")
            vals = []
            for x in v:
                if isinstance(x, float) and x == -math.inf:
                    vals.append(x)  # allowed for router_bias (masks an expert); checked below
                else:
                    vals.append(_finite_number(x) if not isinstance(x, float) else x)
            if any(math.isnan(x) or x == math.inf for x in vals):
                raise ValueError("contains NaN or inf")
            return vals
        return v

    @model_validator(mode="after")
    def _router_rules(self):
        if (self.kind == "router_bias") != (self.hook == ROUTER_HOOK):
            raise ValueError(f"kind: 'router_bias' writes go to {ROUTER_HOOK!r} and only there "
                             f"(got kind {self.kind!r} at {self.hook!r})")
        if isinstance(self.vector, list) and any(math.isinf(x) for x in self.vector):
            if self.kind != "router_bias":
                raise ValueError("vector: contains -inf (allowed only in router_bias masks)")
            if all(math.isinf(x) for x in self.vector):
                raise ValueError("vector: masks every expert (-inf everywhere): the router would produce NaN")
            if self.scale < 0:
                raise ValueError(f"scale: must be >= 0 for a router_bias with -inf masks (got {self.scale}); "
                                 "a negative scale turns the mask into +inf (NaN in the router)")
        return self

    @field_validator("scale", mode="before")
    @classmethod
    def _scale(cls, v) -> float:
        return _finite_number(v)

    @field_validator("value", mode="before")
    @classmethod
    def _value(cls, v):
        return None if v is None else _finite_number(v)

    @model_validator(mode="after")
    def _value_only_for_clamp(self):
        if self.value is not None and self.kind != "clamp":
            raise ValueError(f"value: only a 'clamp' write takes a value (this write is {self.kind!r})")
        if self.value is None and self.kind == "clamp":
            raise ValueError("value: a 'clamp' write needs the target projection value (use 'ablate' for 0)")
        return self

    @model_validator(mode="after")
    def _cond_kind(self):
        if self.cond is not None and self.kind == "router_bias":
            raise ValueError("cond: conditional router_bias writes are not supported yet")
        return self


class ReadOp(BaseModel):
    """One read: ``kind`` evaluated at ``blocks.{L}.{hook}`` for every ``L`` in ``layers``, on
    every token a request with the app on processes; the values come back with the request's
    output (``RequestOutput.mi_results[app][name]``, see docs/hooks.md for the alignment).

    Fields:
        kind: ``"linear_probe"``: ``score[t] = w . x[t] + bias`` (float32; ``sigmoid=True``
            returns ``1 / (1 + exp(-score))``), a logistic-regression / linear probe (Alain &
            Bengio 2016); ``"capture"``: the activation ``x[t]`` itself, float32 ``[d_model]``
            (``[n_experts]`` at ``mlp.hook_router_logits``).
        name: key of the result (default ``"probe"`` / ``"capture"``); unique within the app.
        hook, layers: as for :class:`WriteOp`. ``x`` is the hook's whole value after the writes
            at the same hook (``hidden + residual`` for the ``hook_resid_*`` hooks).
        weight: the probe direction ``[d_model]`` (``[n_experts]`` at the router hook), floats
            or a ``VectorFile``; probes only.
            ``"cosine"``: ``w . x / (|w| |x|)``, the cosine similarity with a condition vector
            (CAST's condition score), float32.
        bias: probe intercept (float); probes only.
        sigmoid: probes only.
        buffer: makes this a *condition read*: its values feed the ``cond(buffer=...)`` of the
            app's writes at later layers instead of coming back to the user (one layer only;
            ``linear_probe`` or ``cosine``).
        scope: of a buffer: ``"token"`` (per position) or ``"request"`` (mean over the prompt).
        positions: captures only: ``"all"`` (every processed position), ``"generated"`` (the
            positions whose next-token prediction was a generated token) or ``"last"`` (the last
            prompt token). Probes always return every processed position.
        cond: reserved for conditional ops (not yet supported: rejected).
    """

    model_config = ConfigDict(extra="forbid")
    primitive: Literal["read"] = "read"
    kind: Literal["linear_probe", "capture", "cosine"]
    name: str | None = None
    buffer: str | None = None
    scope: Literal["token", "request"] = "token"
    hook: str = "hook_resid_post"
    layers: Layers = "all"
    weight: Union[list[Number], VectorFile, None] = None
    bias: float = 0.0
    sigmoid: StrictBool = False
    positions: Literal["all", "generated", "last"] = "all"
    cond: dict[str, Any] | None = None

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, v):
        if v not in KNOWN_READ_KINDS:
            raise ValueError(f"unknown read kind {v!r}; known: {', '.join(KNOWN_READ_KINDS)}")
        return v

    @field_validator("hook")
    @classmethod
    def _hook(cls, v: str) -> str:
        return _hook_name(v)

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, v):
        if isinstance(v, (list, tuple)):
            if len(v) == 0:
                raise ValueError("empty")
            return [_finite_number(x) for x in v]
        return v

    @field_validator("bias", mode="before")
    @classmethod
    def _bias(cls, v) -> float:
        return _finite_number(v)

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, v):
        if v not in CAPTURE_POSITIONS:
            raise ValueError(f"unknown positions {v!r}; known: {', '.join(CAPTURE_POSITIONS)}")
        return v

    @model_validator(mode="after")
    def _per_kind(self):
        if self.kind in ("linear_probe", "cosine"):
            if self.weight is None:
                raise ValueError(f"weight: a {self.kind!r} read needs a weight vector")
            if self.positions != "all":
                raise ValueError("positions: probes return every processed position (only captures take positions)")
            if self.kind == "cosine" and (self.bias != 0.0 or self.sigmoid):
                raise ValueError("bias/sigmoid: only a 'linear_probe' read takes them")
        else:
            if self.weight is not None or self.bias != 0.0 or self.sigmoid:
                raise ValueError("weight/bias/sigmoid: only a 'linear_probe' read takes them (this read is a capture)")
        if self.buffer is not None:
            if self.kind == "capture":
                raise ValueError("buffer: a condition read is a 'linear_probe' or 'cosine', not a capture")
            if not _NAME_RE.match(self.buffer):
                raise ValueError(f"buffer: {self.buffer!r} must match {_NAME_RE.pattern}")
            if not (isinstance(self.layers, list) and len(self.layers) == 1):
                raise ValueError(f"layers: a condition read (buffer {self.buffer!r}) reads exactly one layer")
        elif self.scope != "token":
            raise ValueError("scope: only a condition read (with buffer=) takes a scope")
        if self.name is None:
            self.name = {"linear_probe": "probe", "capture": "capture", "cosine": "cosine"}[self.kind]
            if self.buffer is not None:
                self.name = self.buffer
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name: {self.name!r} must match {_NAME_RE.pattern}")
        return self

    @field_validator("cond")
    @classmethod
    def _cond(cls, v):
        if v is not None:
            raise ValueError("conditional reads are not yet supported")
        return v


def _op_tag(v) -> str:
    if isinstance(v, dict):
        return v.get("primitive", "write")
    return getattr(v, "primitive", "write")


Op = Annotated[Union[Annotated[WriteOp, Tag("write")], Annotated[ReadOp, Tag("read")]], Discriminator(_op_tag)]


class AppSpec(BaseModel):
    """A deployable MI app: a name and its ops. Identity is :meth:`content_hash`."""

    model_config = ConfigDict(extra="forbid")
    name: str
    ops: list[Op] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} must match {_NAME_RE.pattern}")
        return v

    @field_validator("ops")
    @classmethod
    def _read_names(cls, v):
        names = [op.name for op in v if op.primitive == "read"]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"read names {dup} used twice in one app; give each read a distinct name=")
        return v

    @field_validator("ops")
    @classmethod
    def _buffers(cls, v):
        bufs = [op.buffer for op in v if op.primitive == "read" and op.buffer is not None]
        dup = sorted({b for b in bufs if bufs.count(b) > 1})
        if dup:
            raise ValueError(f"buffer names {dup} defined twice in one app")
        for i, op in enumerate(v):
            if op.primitive == "write" and op.cond is not None and op.cond.buffer is not None:
                if op.cond.buffer not in bufs:
                    raise ValueError(f"{i}.cond.buffer: no read of this app writes buffer {op.cond.buffer!r} "
                                     f"(defined: {bufs or 'none'}; use read(..., buffer=...))")
        return v

    def buffer_read(self, name: str) -> "ReadOp":
        return next(op for op in self.ops if op.primitive == "read" and op.buffer == name)

    @property
    def has_reads(self) -> bool:
        """Reads whose values come back to the user (condition reads do not)."""
        return any(op.primitive == "read" and op.buffer is None for op in self.ops)

    def reads_prompt(self) -> bool:
        """True if the app needs values at prompt positions other than the last one: returned
        reads of every position, and request-scope conditions (mean over the prompt). Such a
        request must compute its whole prompt, never take it from the prefix cache."""
        return any(op.primitive == "read" and (
            (op.buffer is None and (op.kind == "linear_probe" or op.positions == "all"))
            or (op.buffer is not None and op.scope == "request")) for op in self.ops)

    def changes_prompt_kv(self) -> bool:
        """True if a write can apply at a prompt position (then the prompt's KV differs from an
        app-free request's and must not be shared through the prefix cache)."""
        return any(op.primitive == "write" and not (op.cond is not None and op.cond.positions == "generated")
                   for op in self.ops)

    def content_hash(self) -> str:
        """sha256 (hex, 16 chars) of the canonical JSON: same name, different vector => different app."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class DeploymentConfig(BaseModel):
    """``additional_config["xmix"]``: the apps compiled into this engine.

    Fields:
        apps: the deployed apps (unique names).
        fused_writes: ``"none"`` (default), ``"adds"`` or ``"all"``: which unconditional
            residual-stream writes a compiled engine applies as torch ops inside its graph
            instead of through the hook op. A fused write costs no launch of its own, but it is
            in every CUDA-graph variant, so every request pays for it, apps on or off (H200,
            Llama-3.1-8B decode step, apps off: ``"adds"`` up to +1.4%, ``"all"`` up to +2.8%,
            ``"none"`` within 0.5% of vLLM without the plugin; all-layer steering on: ``"adds"``
            +0.6 to +1.2%, ``"none"`` +1.2 to +2.2%; measured with runtime 0.4, before the
            per-token coefficient table). ``"adds"``: steering adds at sites without
            projections (a site with an add and an ablation is not fused); ``"all"``: also
            directional ablations and clamps at sites whose writes are all unconditional.
            Conditional writes (SEAL, CAST) are never fused; eager engines
            (``enforce_eager``) apply every write through the op whatever the setting.
        runtime: set by the plugin at engine configuration; keys the compile cache.
    """

    model_config = ConfigDict(extra="forbid")
    apps: list[AppSpec] = Field(default_factory=list)
    #: see the class docstring (trade-off, measured costs: benchmarks/RESULTS.md, fourth session);
    #: "adds" suits deployments where most requests steer
    fused_writes: Literal["adds", "all", "none"] = "none"
    #: set by the plugin at engine configuration (``"vllm-xmix <version>"``); keys the compile cache
    runtime: str | None = None

    @field_validator("apps")
    @classmethod
    def _unique(cls, v: list[AppSpec]) -> list[AppSpec]:
        names = [a.name for a in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate app names {dup}")
        return v

    def app(self, name: str) -> AppSpec:
        for a in self.apps:
            if a.name == name:
                return a
        raise KeyError(name)


class RequestApp(BaseModel):
    """One app switched on for one request.

    Fields:
        name: a deployed app's name.
        scale: coefficient for every op of the app (default: the op's deployed ``scale``);
            a finite float (``bool`` and strings are rejected).
        layers: optional subset of the app's deployed layers to apply on this request.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    scale: float | None = None
    layers: list[int] | None = None
    #: content hash of the app the caller meant (set when an ``MIApp`` is passed); checked
    #: against the deployed app of that name when the request is added
    hash: str | None = None

    @field_validator("scale", mode="before")
    @classmethod
    def _scale(cls, v):
        return None if v is None else _finite_number(v)

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v):
        return None if v is None else _layer_list(v)


# --------------------------------------------------------------------------------------------
# errors


def _fmt_validation_error(prefix: str, e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        raw = list(err.get("loc", ()))
        # drop the union tag pydantic inserts after an op index ("ops.0.write.scale" -> "ops.0.scale")
        raw = [x for i, x in enumerate(raw) if not (x in ("write", "read") and i and isinstance(raw[i - 1], int))]
        loc = ".".join(str(x) for x in raw)
        msg = err.get("msg", "")
        msg = msg.removeprefix("Value error, ")
        got = repr(err.get("input"))
        if err.get("type", "").endswith(("literal_error", "_type", "_parsing", "enum")) and len(got) <= 60:
            msg += f" (got {got})"  # which value: e.g. "ALL" where 'all' was meant
        parts.append(f"{prefix}{'.' + loc if loc else ''}: {msg}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# deployment


def parse_deployment(raw: Any) -> DeploymentConfig:
    """Parse ``additional_config["xmix"]`` (a dict, an :class:`MIApp` list, or a JSON string).

    Raises:
        XmixSpecError: naming the offending field (``xmix.apps.0.ops.0.vector: ...``).
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise XmixSpecError(f"additional_config.xmix: not valid JSON ({e})") from None
    if isinstance(raw, DeploymentConfig):
        return raw
    try:
        return DeploymentConfig.model_validate(raw)
    except ValidationError as e:
        raise XmixSpecError(_fmt_validation_error("additional_config.xmix", e)) from None


def load_vector(ref: list[float] | VectorFile, field: str, allow_neg_inf: bool = False) -> np.ndarray:
    """Load a vector as float32 numpy ``[d]``.

    Raises:
        XmixSpecError: missing file, unknown key (or a key for a file without keys: ``.npy``, a
            ``.pt`` holding one tensor), not real numbers (bool, complex, strings), not 1-D,
            non-finite values.
    """
    if isinstance(ref, list):
        arr = np.asarray(ref, dtype=np.float32)
    else:
        path = os.path.expanduser(ref.path)
        if not os.path.exists(path):
            raise XmixSpecError(f"{field}.path: file not found: {path}")
        try:
            if path.endswith(".safetensors"):
                from safetensors.numpy import load_file

                tensors = load_file(path)
                if ref.key is None:
                    if len(tensors) != 1:
                        raise XmixSpecError(f"{field}.key: {path} holds {sorted(tensors)}; name one")
                    arr = next(iter(tensors.values()))
                elif ref.key not in tensors:
                    raise XmixSpecError(f"{field}.key: {ref.key!r} not in {path} (has {sorted(tensors)})")
                else:
                    arr = tensors[ref.key]
            elif path.endswith((".pt", ".pth")):
                import torch

                obj = torch.load(path, map_location="cpu", weights_only=True)
                if isinstance(obj, dict):
                    if ref.key is None or ref.key not in obj:
                        raise XmixSpecError(f"{field}.key: {ref.key!r} not in {path} (has {sorted(obj)})")
                    obj = obj[ref.key]
                elif ref.key is not None:
                    raise XmixSpecError(f"{field}.key: {path} holds a single {type(obj).__name__}, not a dict of "
                                        f"tensors: key {ref.key!r} selects nothing (leave it out)")
                if not isinstance(obj, torch.Tensor):
                    raise XmixSpecError(f"{field}.path: {path} holds a {type(obj).__name__}, not a tensor")
                if obj.is_complex() or obj.dtype == torch.bool:
                    raise XmixSpecError(f"{field}: expected real numbers, got a {obj.dtype} tensor in {path}")
                arr = obj.detach().float().numpy()
            elif path.endswith(".npy"):
                if ref.key is not None:
                    raise XmixSpecError(f"{field}.key: a .npy file holds one array: key {ref.key!r} selects "
                                        f"nothing in {path} (leave it out)")
                arr = np.load(path, allow_pickle=False)
            else:
                raise XmixSpecError(f"{field}.path: unsupported file type {path} (.safetensors, .pt, .npy)")
        except XmixSpecError:
            raise
        except Exception as e:  # corrupt file etc.
            raise XmixSpecError(f"{field}.path: cannot read {path}: {e}") from None
        arr = np.asarray(arr)
        if arr.dtype.kind not in "fiu":  # bool, complex, strings: not a direction
            raise XmixSpecError(f"{field}: expected real numbers, got dtype {arr.dtype} in {path}")
        arr = arr.astype(np.float32)
    if arr.ndim != 1:
        raise XmixSpecError(f"{field}: expected a 1-D vector [d_model], got shape {list(arr.shape)}")
    bad = ~np.isfinite(arr)
    if allow_neg_inf:
        bad &= ~np.isneginf(arr)
    if bad.any():
        raise XmixSpecError(f"{field}: contains NaN or inf")
    return arr


def resolve_layers(layers: list[int] | str, n_layers: int, field: str) -> list[int]:
    if layers == "all":
        return list(range(n_layers))
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise XmixSpecError(f"{field}: layer index {bad[0]} out of range [0, {n_layers}) for this model")
    return list(layers)


def hook_width(hook: str, d_model: int, n_experts: int | None, field: str) -> int:
    """Last dimension of the value at ``hook``: ``n_experts`` at the router logits, else ``d_model``."""
    if hook == ROUTER_HOOK:
        if n_experts is None:
            raise XmixSpecError(f"{field}.hook: this model has no MoE router")
        return n_experts
    return d_model


def load_op_vector(op: WriteOp | ReadOp, field: str, d_model: int, n_experts: int | None) -> np.ndarray:
    """Load one op's vector (float32, as stored) and check it against the model: length
    ``d_model`` (``n_experts`` for ``router_bias`` and for reads at the router logits), a
    direction for ablate/clamp, safe masks. A capture has no vector: zeros of the hook's width.

    Raises:
        XmixSpecError: naming the field.
    """
    if op.primitive == "read":
        width = hook_width(op.hook, d_model, n_experts, field)
        if op.kind == "capture":
            return np.zeros(width, np.float32)
        w = load_vector(op.weight, field + ".weight")
        if op.kind == "cosine" and not np.any(w):
            raise XmixSpecError(f"{field}.weight: zero vector has no direction for a cosine similarity")
        if w.shape[0] != width:
            what = "n_experts" if op.hook == ROUTER_HOOK else "d_model"
            raise XmixSpecError(f"{field}.weight: length {w.shape[0]} != {what} {width} of this model")
        return w
    vec = load_vector(op.vector, field + ".vector", allow_neg_inf=op.kind == "router_bias")
    if op.kind == "router_bias":
        if np.isneginf(vec).all():
            raise XmixSpecError(f"{field}.vector: masks every expert (-inf everywhere)")
        if np.isneginf(vec).any() and op.scale < 0:
            raise XmixSpecError(f"{field}.scale: must be >= 0 for a router_bias with -inf masks")
        if n_experts is None:
            raise XmixSpecError(f"{field}.hook: this model has no MoE router")
        if vec.shape[0] != n_experts:
            raise XmixSpecError(f"{field}.vector: length {vec.shape[0]} != n_experts {n_experts} of this model")
        return vec
    if vec.shape[0] != d_model:
        raise XmixSpecError(f"{field}.vector: length {vec.shape[0]} != d_model {d_model} of this model")
    if op.kind in ("ablate", "clamp") and not np.any(vec):
        raise XmixSpecError(f"{field}.vector: zero vector has no direction to {op.kind}")
    return vec


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
            ids = cond.tokens if cond.tokens is not None else cond.tokens_prev
            if ids is not None and vocab_size is not None and max(ids) >= vocab_size:
                raise XmixSpecError(f"{f}.cond: token id {max(ids)} >= vocab size {vocab_size} of this model")


# --------------------------------------------------------------------------------------------
# request


def _coerce_request_list(raw: Any, field: str) -> list[Any]:
    if isinstance(raw, str):
        if not raw.strip():
            raise XmixSpecError(f"{field}: empty; expected a list of apps, e.g. ['happy'] or "
                                "'[{\"name\": \"happy\", \"scale\": 4}]'")
        if not raw.lstrip().startswith(("[", "{")):
            raise XmixSpecError(f"{field}: expected a list of apps (e.g. [{raw!r}]), got str {raw!r}")
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise XmixSpecError(f"{field}: not valid JSON ({e})") from None
    if isinstance(raw, dict):
        if "apps" not in raw or set(raw) - {"apps"}:
            raise XmixSpecError(f"{field}: expected {{'apps': [...]}}, got keys {sorted(raw)}")
        raw = raw["apps"]
    if isinstance(raw, (str, dict)) or not isinstance(raw, (list, tuple)):
        raise XmixSpecError(f"{field}: expected a list of apps, got {type(raw).__name__}")
    return list(raw)


def parse_request_apps(raw: Any, field: str = "mi_apps") -> list[RequestApp]:
    """Parse a request's app selection without a deployment (structure, types, finiteness).

    Accepts a list whose items are app names or ``{"name", "scale"?, "layers"?}`` dicts (or
    :class:`RequestApp`), a ``{"apps": [...]}`` dict, or a JSON string of either (the form
    ``vllm_xargs`` carries over HTTP).

    Raises:
        XmixSpecError: e.g. ``mi_apps[0].scale: expected a number, got str 'high'``.
    """
    items = _coerce_request_list(raw, field)
    out: list[RequestApp] = []
    seen: set[str] = set()
    for i, it in enumerate(items):
        f = f"{field}[{i}]"
        if isinstance(it, RequestApp):
            ra = it
        elif isinstance(it, str):
            ra = RequestApp(name=it)
        elif isinstance(it, dict):
            try:
                ra = RequestApp.model_validate(it)
            except ValidationError as e:
                raise XmixSpecError(_fmt_validation_error(f, e)) from None
        elif hasattr(it, "name") and hasattr(it, "to_spec"):  # an MIApp: by name, checked by content
            try:
                ra = RequestApp(name=it.name, hash=it.content_hash())
            except XmixSpecError as e:
                raise XmixSpecError(f"{f}: {e}") from None
        else:
            raise XmixSpecError(f"{f}: expected an app name or {{'name': ..., 'scale': ...}}, got {type(it).__name__}")
        if ra.name in seen:
            raise XmixSpecError(f"{f}.name: app {ra.name!r} listed twice")
        seen.add(ra.name)
        out.append(ra)
    return out


def check_request_against_deployment(apps: list[RequestApp], dep: DeploymentConfig, n_layers: int,
                                     field: str = "mi_apps", hashes: dict[str, str] | None = None) -> None:
    """Raises XmixSpecError for unknown app names, layers outside the app's deployed layers, and
    an app passed as an object whose content differs from the deployed app of that name."""
    names = [a.name for a in dep.apps]
    for i, ra in enumerate(apps):
        try:
            app = dep.app(ra.name)
        except KeyError:
            raise XmixSpecError(
                f"{field}[{i}].name: unknown app {ra.name!r}; deployed apps: {names or 'none (no additional_config.xmix)'}"
            ) from None
        if ra.scale is not None and ra.scale < 0 and any(
                op.kind == "router_bias" and isinstance(op.vector, list) and any(math.isinf(x) for x in op.vector)
                for op in app.ops):
            raise XmixSpecError(
                f"{field}[{i}].scale: must be >= 0 for app {ra.name!r}, whose router_bias masks experts "
                f"with -inf (got {ra.scale}); a negative scale turns the mask into +inf/NaN"
            )
        if ra.scale not in (None, 0.0) and not any(op.primitive == "write" for op in app.ops):
            raise XmixSpecError(
                f"{field}[{i}].scale: app {ra.name!r} has no writes, a scale would change nothing (only 0, "
                "which switches the app off, is accepted)")
        if ra.hash is not None:
            deployed = (hashes or {}).get(ra.name) or app.content_hash()
            if ra.hash != deployed:
                raise XmixSpecError(
                    f"{field}[{i}]: app {ra.name!r} differs from the deployed app of that name "
                    f"(content hash {ra.hash} != deployed {deployed}); requests select deployed apps"
                )
        if ra.layers is not None:
            allowed = set()
            for op in app.ops:
                allowed.update(resolve_layers(op.layers, n_layers, f"{field}[{i}].layers"))
            bad = [x for x in ra.layers if x not in allowed]
            if bad:
                raise XmixSpecError(
                    f"{field}[{i}].layers: layer {bad[0]} is not a deployed layer of app {ra.name!r} "
                    f"(deployed: {sorted(allowed)})"
                )
            useful = set()  # layers of the app's writes and returned reads (condition reads do nothing alone)
            for op in app.ops:
                if op.primitive == "write" or op.buffer is None:
                    useful.update(resolve_layers(op.layers, n_layers, f"{field}[{i}].layers"))
            if not useful & set(ra.layers):
                raise XmixSpecError(
                    f"{field}[{i}].layers: {ra.layers} selects only condition reads of app {ra.name!r}, so the "
                    f"app would do nothing; its writes and returned reads are at layers {sorted(useful)}")


def check_router_masks(apps: list[RequestApp], dep: DeploymentConfig, n_layers: int,
                       field: str = "mi_apps") -> None:
    """Raises XmixSpecError if the router masks of the selected apps together mask every expert
    at some layer (softmax over all -inf logits is NaN, and NaN would reach the KV cache)."""
    masked: dict[int, set[int]] = {}
    n_exp = None
    for ra in apps:
        if ra.scale == 0:
            continue
        for op in dep.app(ra.name).ops:
            if op.kind != "router_bias" or not isinstance(op.vector, list):
                continue
            n_exp = len(op.vector)
            idx = {j for j, x in enumerate(op.vector) if math.isinf(x)}
            layers = resolve_layers(op.layers, n_layers, field)
            if ra.layers is not None:
                layers = [L for L in layers if L in set(ra.layers)]
            for L in layers:
                masked.setdefault(L, set()).update(idx)
    for L, idx in sorted(masked.items()):
        if n_exp is not None and len(idx) >= n_exp:
            raise XmixSpecError(f"{field}: the selected apps mask every expert at layer {L} (-inf everywhere)")


def request_to_wire(apps: list[RequestApp]) -> dict[str, Any]:
    """The canonical ``extra_args["xmix"]`` payload."""
    return {"apps": [a.model_dump(exclude_none=True) for a in apps]}


# --------------------------------------------------------------------------------------------
# builder


class _OpBuilder:
    """Refines one op of an :class:`MIApp`; every method returns ``self`` for chaining."""

    def __init__(self, app: "MIApp", fields: dict[str, Any]):
        self._app = app
        self._fields = fields

    def layers(self, layers) -> "_OpBuilder":
        """``[int, ...]``, ``range(...)`` or ``"all"``."""
        if isinstance(layers, range):
            layers = list(layers)
        elif isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        self._fields["layers"] = layers
        return self

    def submodule(self, hook: str) -> "_OpBuilder":
        """TransformerLens hook name, e.g. ``"hook_resid_post"``."""
        self._fields["hook"] = _hook_name(hook)
        return self

    def cond(self, **predicate) -> "_OpBuilder":
        """Guard a write with a predicate (see :class:`Cond`): ``tokens=[ids]``,
        ``tokens_prev=[ids]``, or ``buffer="name", op=">", threshold=t``; optional
        ``positions="generated"``. Reads cannot be conditioned (rejected)."""
        if not predicate:
            raise XmixSpecError(f"{self._app.name}.cond: give a predicate: tokens=[...], tokens_prev=[...], "
                                "or buffer=..., op=..., threshold=...")
        self._fields["cond"] = predicate
        return self

    # allow app-level chaining from an op: MIApp("x").write(...).layers(...).write(...)
    def write(self, *a, **k) -> "_OpBuilder":
        return self._app.write(*a, **k)

    def read(self, *a, **k) -> "_OpBuilder":
        return self._app.read(*a, **k)

    def to_spec(self) -> AppSpec:
        return self._app.to_spec()

    def content_hash(self) -> str:
        return self._app.content_hash()

    @property
    def name(self) -> str:
        return self._app.name


class MIApp:
    """Builder for an MI app (xMIx programming interface, Blum et al., section 4.1).

    Example::

        app = MIApp("happy")
        app.write("add", vector=v, scale=4.0).layers([1, 2]).submodule("hook_resid_post")
        llm = LLM(model, additional_config=deploy(app))

    ``vector``: a sequence of floats / numpy array / torch tensor of shape ``[d_model]``, or a
    path (``.safetensors``, ``.pt``, ``.npy``; ``key=`` selects a tensor).
    """

    def __init__(self, name: str):
        self.name = name
        self._ops: list[_OpBuilder] = []

    def write(self, kind: str = "add", *, vector=None, scale: float = 1.0, value: float | None = None,
              key: str | None = None) -> _OpBuilder:
        """Declare a write (``"add"``, ``"ablate"``, ``"clamp"`` with ``value``, ``"router_bias"``;
        see :class:`WriteOp` for shapes and semantics).
        Returns the op builder (``.layers``, ``.submodule``, ``.cond``)."""
        if vector is None:
            raise XmixSpecError(f"{self.name}.write: vector is required")
        vec = self._vector_field(vector, key, "write.vector")
        fields = {"primitive": "write", "kind": kind, "vector": vec, "scale": scale}
        if value is not None:
            fields["value"] = value
        op = _OpBuilder(self, fields)
        self._ops.append(op)
        return op

    def read(self, kind: str, *, weight=None, bias: float = 0.0, sigmoid: bool = False,
             positions: str | None = None, name: str | None = None, key: str | None = None,
             buffer: str | None = None, scope: str | None = None) -> _OpBuilder:
        """Declare a read: ``"linear_probe"`` (``weight`` ``[d_model]``, ``bias``, ``sigmoid``),
        ``"cosine"`` (``weight``: the condition vector) or ``"capture"`` (``positions``:
        ``"all"``, ``"generated"``, ``"last"``); ``name`` keys the result in
        ``RequestOutput.mi_results[app]``; ``buffer`` (+ ``scope``) makes it a condition read
        for ``cond(buffer=...)`` instead. See :class:`ReadOp` for shapes and
        semantics. Returns the op builder (``.layers``, ``.submodule``, ``.cond``).

        Raises:
            XmixSpecError: unknown kind, missing probe weight, bad vector.
        """
        if kind not in KNOWN_READ_KINDS:
            raise XmixSpecError(f"{self.name}.read: unknown read kind {kind!r}; known: {', '.join(KNOWN_READ_KINDS)}")
        fields: dict[str, Any] = {"primitive": "read", "kind": kind}
        if weight is not None:
            fields["weight"] = self._vector_field(weight, key, "read.weight")
        if bias != 0.0:
            fields["bias"] = bias
        if sigmoid:
            fields["sigmoid"] = sigmoid
        if positions is not None:
            fields["positions"] = positions
        if name is not None:
            fields["name"] = name
        if buffer is not None:
            fields["buffer"] = buffer
        if scope is not None:
            fields["scope"] = scope
        op = _OpBuilder(self, fields)
        self._ops.append(op)
        return op

    def _vector_field(self, vector, key: str | None, field: str) -> Any:
        """A path (-> VectorFile fields) or array-like / tensor (-> list of floats)."""
        if isinstance(vector, (str, os.PathLike)):
            return {"path": os.fspath(vector), "key": key}
        if key is not None:
            raise XmixSpecError(f"{self.name}.{field}: key={key!r} names a tensor in a file, but the vector was "
                                f"given as a {type(vector).__name__} (pass a file path, or leave key out)")
        if hasattr(vector, "detach"):
            import torch

            if vector.is_complex() or vector.dtype == torch.bool:
                raise XmixSpecError(f"{self.name}.{field}: expected real numbers, got a {vector.dtype} tensor")
            vector = vector.detach().float().cpu().numpy()
        try:
            raw = np.asarray(vector)
            if raw.dtype.kind not in "fiu":  # bool, complex, strings, objects
                raise TypeError(f"dtype {raw.dtype}")
            arr = raw.astype(np.float64)
        except (TypeError, ValueError) as e:
            raise XmixSpecError(f"{self.name}.{field}: not a vector of real numbers ({e})") from None
        if arr.ndim != 1:
            raise XmixSpecError(f"{self.name}.{field}: expected a 1-D vector, got shape {list(arr.shape)}")
        return arr.tolist()

    def to_spec(self) -> AppSpec:
        """Validate and lower to :class:`AppSpec`. Raises XmixSpecError naming the field."""
        try:
            return AppSpec.model_validate({"name": self.name, "ops": [dict(o._fields) for o in self._ops]})
        except ValidationError as e:
            raise XmixSpecError(_fmt_validation_error(f"app {self.name!r}", e)) from None

    def to_json(self) -> str:
        return self.to_spec().model_dump_json()

    @staticmethod
    def from_json(s: str) -> AppSpec:
        try:
            return AppSpec.model_validate_json(s)
        except ValidationError as e:
            raise XmixSpecError(_fmt_validation_error("app", e)) from None

    def content_hash(self) -> str:
        return self.to_spec().content_hash()


def deploy(*apps: MIApp | _OpBuilder | AppSpec | dict, fused_writes: str = "none") -> dict[str, Any]:
    """Build vLLM's ``additional_config`` for these apps: ``{"xmix": {"apps": [...],
    "fused_writes": ...}}``.

    ``fused_writes``: ``"none"`` (default), ``"adds"`` or ``"all"``: which unconditional writes a
    compiled engine applies inside its graph, at a cost to every request, apps on or off
    (trade-off and measured costs: :class:`DeploymentConfig`; no effect with ``enforce_eager``).

    Raises:
        XmixSpecError: for an invalid app or ``fused_writes`` (the message names the field).
    """
    specs = []
    for a in apps:
        if isinstance(a, (MIApp, _OpBuilder)):  # MIApp("x").write(...).layers(...) chains end on an op
            specs.append(a.to_spec())
        elif isinstance(a, AppSpec):
            specs.append(a)
        else:
            specs.append(parse_deployment({"apps": [a]}).apps[0])
    dep = parse_deployment({"apps": [s.model_dump(mode="json") for s in specs], "fused_writes": fused_writes})
    return {CONFIG_KEY: dep.model_dump(mode="json", exclude_none=True)}
