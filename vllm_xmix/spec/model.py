"""The plain data an app lowers to: pydantic models (JSON-serialisable) and their validators.

:class:`AppSpec` (a name and its :class:`WriteOp` / :class:`ReadOp` ops, writes optionally
guarded by a :class:`Cond`), :class:`DeploymentConfig` (``additional_config["xmix"]``) and
:class:`RequestApp` (one app switched on by a request). Validation here is structural (types,
finiteness, kinds, hooks, per-kind rules); the checks against a model are in :mod:`.vectors`
(vector lengths) and :mod:`.deployment` (layer range, condition layers, token ids).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import re
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool, StrictFloat,
                      StrictInt, Tag, field_validator, model_validator)

from .names import (CAPTURE_POSITIONS, KNOWN_READ_KINDS, KNOWN_WRITE_KINDS, ROUTER_HOOK, SUPPORTED_HOOKS,
                    SUPPORTED_WRITE_KINDS, _hook_name)
from .vector_files import load_vector, non_finite_entry

#: the float32 limits: vectors, scales, clamp targets and probe biases are applied in float32
_F32 = np.finfo(np.float32)
_F32_MAX = float(_F32.max)


_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")


def _is_a(x, kind: type) -> bool:
    """``x`` is a ``numbers.Real`` / ``numbers.Integral`` (Python or numpy), and not a bool."""
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, kind)


def _is_list_like(v) -> bool:
    """An iterable that can hold indices (list, tuple, range, array), not a str, bytes or dict."""
    return not isinstance(v, (str, bytes, dict)) and hasattr(v, "__iter__")


def _optional(coerce):
    """``coerce`` for an optional field: ``None`` stays ``None``."""
    return lambda v: None if v is None else coerce(v)


def _repeated(names: list) -> list:
    """The entries of ``names`` that occur more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})


def _one_of(names: tuple[str, ...], what: str):
    """A validator that accepts only the entries of ``names`` (``what`` names them in the error)."""
    def check(v):
        if v not in names:
            raise ValueError(f"unknown {what} {v!r}; known: {', '.join(names)}")
        return v
    return check


def _finite_number(v) -> float:
    """Any real number (Python or numpy), not bool, not a string; finite."""
    if not _is_a(v, numbers.Real):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    try:
        v = float(v)
    except OverflowError:  # an int beyond float range (JSON allows any number of digits)
        raise ValueError(f"must be finite, got an integer beyond float range ({int(v).bit_length()} bits)") from None
    if not math.isfinite(v):
        raise ValueError(f"must be finite, got {v}")
    return v


def _number_list(v, *, neg_inf: bool):
    """An inline vector: a non-empty list/tuple of finite numbers, ``-inf`` entries kept with
    ``neg_inf``; a string is a file path (``vector: dirs/happy.npy`` in a deployment file, the
    short form of ``{path: ...}``); anything else (a :class:`VectorFile`) is left to the field's
    type."""
    if isinstance(v, str):
        return {"path": v}
    if isinstance(v, (bool, numbers.Number)):  # (one number where a vector goes: said plainly, not per union member)
        raise ValueError(f"expected a list of numbers (a vector) or a file reference, got {type(v).__name__} {v!r}")
    if not isinstance(v, (list, tuple)):
        return v
    if len(v) == 0:
        raise ValueError("empty")
    if not neg_inf:
        vals = [_finite_number(x) for x in v]
    else:
        vals = [x if isinstance(x, float) else _finite_number(x) for x in v]
        bad = next((i for i, x in enumerate(vals) if math.isnan(x) or x == math.inf), None)
        if bad is not None:
            raise ValueError(non_finite_entry(bad, vals[bad], allow_neg_inf=True))
    big = next((i for i, x in enumerate(vals) if math.isfinite(x) and abs(x) > _F32_MAX), None)
    if big is not None:  # (the words of vector_files.load_vector, which refuses a file's so)
        raise ValueError(f"entry {big} ({vals[big]:.3g}) exceeds float32's range (+-{_F32_MAX:.3g}); "
                         "vectors are applied in float32")
    any_f32 = np.asarray(vals, dtype=np.float32).any()
    if any(vals) and not any_f32:  # (zeros as given are the caller's choice)
        raise ValueError(f"every entry underflows float32 (the largest, {max(map(abs, vals)):.3g}, is below "
                         f"{float(_F32.smallest_subnormal):.3g}): the vector would apply as zeros; vectors are "
                         "applied in float32")
    return vals


def _layer_list(v) -> list[int]:
    """A non-empty sequence of distinct non-negative ints (list, tuple, range, numpy ints)."""
    if isinstance(v, str):  # ("all", in that spelling, is taken before this)
        raise ValueError(f'expected a list of layer indices or "all", got str {v!r}')
    if not _is_list_like(v):
        raise ValueError(f"expected a list of layer indices, got {type(v).__name__} {v!r}")
    if hasattr(v, "tolist") and hasattr(v, "ndim"):  # a numpy array or torch tensor
        if v.ndim != 1:
            raise ValueError(f"expected a 1-D list of layer indices, got an array of shape {list(v.shape)}")
        v = v.tolist()
    out = []
    for x in v:
        if not _is_a(x, numbers.Integral):
            raise ValueError(f"layer indices must be integers, got {type(x).__name__} {x!r}")
        out.append(int(x))
    if not out:
        raise ValueError("empty list")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate layer indices in {out}")
    if any(x < 0 for x in out):
        raise ValueError(f"negative layer index in {out}")
    return sorted(out)


#: decoder-layer indices of an op: ``"all"`` or distinct non-negative ints (range, numpy ok)
Layers = Annotated[Union[list[int], Literal["all"]], BeforeValidator(lambda v: v if isinstance(v, str) and v == "all" else _layer_list(v))]

#: a finite real number (Python or numpy; bools and strings refused), and its optional form
FiniteFloat = Annotated[float, BeforeValidator(_finite_number)]
OptionalFiniteFloat = Annotated[Union[float, None], BeforeValidator(_optional(_finite_number))]


def _float32_number(v) -> float:
    """A finite number that float32, in which the kernels apply it, holds: not beyond its range
    (it would become inf: a probe's bias, every score NaN), and not so small that it becomes 0
    (below the smallest normal float32, 1.18e-38: a scale or a clamp target would silently apply
    nothing); 0 itself is fine."""
    v = _finite_number(v)
    if abs(v) > _F32_MAX:
        raise ValueError(f"{v:.3g} exceeds float32's range (+-{_F32_MAX:.3g}); it is applied in float32")
    if v != 0.0 and abs(v) < float(_F32.tiny):
        raise ValueError(f"{v:.3g} underflows float32 (smallest normal {float(_F32.tiny):.3g}): it would apply as 0; "
                         "give 0 to apply nothing")
    return v


#: a scale, a clamp target or a probe's bias: applied in float32 on the device
Float32 = Annotated[float, BeforeValidator(_float32_number)]
OptionalFloat32 = Annotated[Union[float, None], BeforeValidator(_optional(_float32_number))]

#: a read kind and a capture's positions (an unknown value gets the list of known ones)
ReadKind = Annotated[Literal["linear_probe", "capture", "cosine"],
                     BeforeValidator(_one_of(KNOWN_READ_KINDS, "read kind"))]
CapturePositions = Annotated[Literal["all", "generated", "last"],
                             BeforeValidator(_one_of(CAPTURE_POSITIONS, "positions"))]


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
    * ``latch``: the name of a read of the same app that has a trigger (``read(..., name=n)
      .on(op, threshold, action=...)``, :class:`Trigger`): a *latch*. The write applies at the
      token at absolute position ``t`` (``t``-th token of prompt + generated tokens, as in
      ``mi_results``) iff ``q <= t``, where ``q`` is the request's *latch position*: the first
      position whose value of that read crosses the trigger's threshold, at any of the read's
      layers the request has on (never crossed: the write never applies). So the write applies
      from the crossing position itself on, for the rest of the request, prompt and generated
      tokens alike. The written layers must all be after the read's layers (``validate_deployment``):
      within one forward the read sets ``q`` for every token of the step before any latched write
      runs, so the result does not depend on chunked prefill, batch composition, preemption or
      async scheduling. ``q`` lives on the device (per request slot, set by the read's site and
      reset when the slot is given to a new request); no host round trip is involved.

    ``positions="generated"`` restricts a token or per-token condition to positions of generated
    tokens (the prompt's KV is then untouched and keeps sharing the prefix cache).
    """

    model_config = ConfigDict(extra="forbid")
    tokens: list[int] | None = None
    tokens_prev: list[int] | None = None
    buffer: str | None = None
    latch: str | None = None
    op: Literal[">", ">=", "<", "<="] | None = None  # buffer conditions; default ">"
    threshold: OptionalFiniteFloat = None
    positions: Literal["all", "generated"] = "all"

    @field_validator("tokens", "tokens_prev", mode="before")
    @classmethod
    def _ids(cls, v):
        if v is None:
            return v
        if not _is_list_like(v):
            raise ValueError(f"expected a list of token ids, got {type(v).__name__}")
        out = []
        for x in v:
            if not _is_a(x, numbers.Integral) or x < 0:
                raise ValueError(f"token ids must be non-negative integers, got {x!r}")
            out.append(int(x))
        if not out:
            raise ValueError("empty token set")
        return sorted(set(out))

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("tokens", "tokens_prev", "buffer", "latch") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of tokens, tokens_prev, buffer, latch (got {given or 'none'})")
        if self.latch is not None and not _NAME_RE.match(self.latch):
            raise ValueError(f"latch: {self.latch!r} must be a read name (matching {_NAME_RE.pattern})")
        if self.buffer is not None and self.threshold is None:
            raise ValueError("threshold: a buffer condition needs a threshold")
        if self.buffer is None and (self.threshold is not None or self.op is not None):
            raise ValueError("threshold/op: only a buffer condition takes them")
        if self.buffer is not None and self.op is None:
            self.op = ">"
        return self

    def kind(self) -> str:
        """``"tokens"``, ``"tokens_prev"``, ``"buffer"`` or ``"latch"``: the predicate given."""
        for k in ("tokens", "tokens_prev", "buffer"):
            if getattr(self, k) is not None:
                return k
        return "latch"


def _file_key_beside(data, field: str):
    """A ``key`` given beside an op's ``field`` (``vector: v.safetensors`` then ``key: k``, the
    likely slip in a deployment file) is refused, saying where it goes (else pydantic's bare
    "Extra inputs are not permitted")."""
    if isinstance(data, dict) and "key" in data and field in data:
        raise ValueError(f"key: a file's key goes with its path, {field}: {{path: ..., key: {data['key']!r}}}, "
                         f"not beside {field}")
    return data


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
    scale: Float32 = 1.0
    value: OptionalFloat32 = None
    cond: Cond | None = None

    @model_validator(mode="before")
    @classmethod
    def _key(cls, data):
        return _file_key_beside(data, "vector")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v in KNOWN_READ_KINDS:  # (an op is a write unless it says otherwise: the likely slip)
            raise ValueError(f"{v!r} is a read kind: a read op needs \"primitive\": \"read\" "
                             "(an op without a primitive is a write)")
        _one_of(KNOWN_WRITE_KINDS, "write kind")(v)
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
        if v is None:
            raise ValueError("expected a list of numbers (a vector) or a file reference, got null")
        return _number_list(v, neg_inf=True)  # -inf: router_bias masks an expert; checked below

    @model_validator(mode="after")
    def _router_rules(self):
        if self.kind == "router_bias" and self.hook != ROUTER_HOOK:
            raise ValueError(f"hook: a 'router_bias' write goes to {ROUTER_HOOK!r} (got {self.hook!r})")
        if self.kind != "router_bias" and self.hook == ROUTER_HOOK:
            raise ValueError(f"kind: only 'router_bias' writes at {ROUTER_HOOK!r} (got {self.kind!r}); "
                             "other writes go to the residual-stream hooks")
        if isinstance(self.vector, list) and any(math.isinf(x) for x in self.vector):
            if self.kind != "router_bias":
                raise ValueError("vector: contains -inf (allowed only in router_bias masks)")
            if all(math.isinf(x) for x in self.vector):
                raise ValueError("vector: masks every expert (-inf everywhere): the router would produce NaN")
            if self.scale < 0:
                raise ValueError(f"scale: must be >= 0 for a router_bias with -inf masks (got {self.scale}); "
                                 "a negative scale turns the mask into +inf (NaN in the router)")
        return self

    @model_validator(mode="after")
    def _direction(self):
        # (a file's vector is read when the engine is configured: spec/vectors.py says the same there)
        if self.kind in ("ablate", "clamp") and isinstance(self.vector, list) and not any(self.vector):
            raise ValueError(f"vector: zero vector has no direction to {self.kind}")
        return self

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


class Trigger(BaseModel):
    """An action on a probe's value, decided per processed token (``read(...).on(op, threshold,
    action=...)``): the trigger *fires* at the first position ``p`` of a request where ``value[p]
    <op> threshold`` (the read's returned value: after ``sigmoid`` if set; at any of the read's
    layers).

    * ``"flag"``: the request's result records it (``mi_results[app]["triggers"]``);
    * ``"stop"``: also ends the request after the step that computed ``value[p]``, keeping the
      token that step sampled: ``finish_reason`` ``"stop"``, ``stop_reason`` ``"xmix:<app>.<read>"``.
      A request whose value crosses at a prompt position ``p < P - 1`` stops at its first
      generated token; at a generated position (``p >= P - 1``) it has ``p - P + 2`` generated
      tokens. ``min_tokens`` does not delay it.
    * ``"latch"``: records it like ``"flag"`` (with action ``"latch"``); its purpose is to switch
      on the app's writes guarded by ``cond(latch=<this read's name>)`` from ``p`` on (see
      :class:`Cond`; at least one write must name it). Writes may latch on a ``"flag"`` or
      ``"stop"`` trigger too: the latch is the trigger's first crossing whatever its action.

    The records and the stop come from the values every step already copies to the host (no
    synchronisation inside the forward); the scheduler applies the stop when it takes the step's
    output, in the same place as vLLM's own stop checks. A latch is decided on the device
    instead, in the forward that computes the value (a host decision would reach the writes one
    or two steps late under async scheduling). Used by jailbreak / toxicity probes that abort
    generation (xMIx's first use case)."""

    model_config = ConfigDict(extra="forbid")
    op: Literal[">", ">=", "<", "<="] = ">"
    threshold: FiniteFloat
    action: Literal["stop", "flag", "latch"] = "flag"


#: read names refused: the key of the trigger records in ``mi_results[app]``
RESERVED_READ_NAMES = ("triggers",)


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
        on: optional :class:`Trigger` (probes and cosine reads that come back to the user):
            ``"stop"``, ``"flag"`` or ``"latch"`` when the value crosses a threshold; writes of
            the app guarded by ``cond(latch=name)`` apply from the first crossing on.
        cond: reserved for conditional ops (not yet supported: rejected).
    """

    model_config = ConfigDict(extra="forbid")
    primitive: Literal["read"] = "read"
    kind: ReadKind
    name: str | None = None
    buffer: str | None = None
    scope: Literal["token", "request"] = "token"
    hook: str = "hook_resid_post"
    layers: Layers = "all"
    weight: Union[list[Number], VectorFile, None] = None
    bias: Float32 = 0.0
    sigmoid: StrictBool = False
    positions: CapturePositions = "all"
    on: Trigger | None = None
    cond: dict[str, Any] | None = None

    @field_validator("hook")
    @classmethod
    def _hook(cls, v: str) -> str:
        return _hook_name(v)

    @model_validator(mode="before")
    @classmethod
    def _key(cls, data):
        return _file_key_beside(data, "weight")

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, v):
        return _number_list(v, neg_inf=False)

    @model_validator(mode="after")
    def _per_kind(self):
        if self.kind in ("linear_probe", "cosine"):
            if self.weight is None:
                raise ValueError(f"weight: a {self.kind!r} read needs a weight vector")
            if self.positions != "all":
                raise ValueError("positions: probes return every processed position (only captures take positions)")
            if self.kind == "cosine" and (self.bias != 0.0 or self.sigmoid):
                raise ValueError("bias/sigmoid: only a 'linear_probe' read takes them")
            if self.kind == "cosine" and isinstance(self.weight, list) and not any(self.weight):
                raise ValueError("weight: zero vector has no direction for a cosine similarity")
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
        if self.name in RESERVED_READ_NAMES:
            raise ValueError(f"name: {self.name!r} is reserved (mi_results[app][{self.name!r}] holds the trigger "
                             "records); give the read another name=")
        if self.on is not None and (self.kind == "capture" or self.buffer is not None):
            raise ValueError("on: a trigger acts on a probe's value: only a 'linear_probe' or 'cosine' read that "
                             "comes back to the user (no buffer=) takes one")
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
        dup = _repeated([op.name for op in v if op.primitive == "read"])
        if dup:
            raise ValueError(f"read names {dup} used twice in one app; give each read a distinct name=")
        return v

    @field_validator("ops")
    @classmethod
    def _buffers(cls, v):
        bufs = [op.buffer for op in v if op.primitive == "read" and op.buffer is not None]
        dup = _repeated(bufs)
        if dup:
            raise ValueError(f"buffer names {dup} defined twice in one app")
        for i, op in enumerate(v):
            if op.primitive == "write" and op.cond is not None and op.cond.buffer is not None:
                if op.cond.buffer not in bufs:
                    raise ValueError(f"{i}.cond.buffer: no read of this app writes buffer {op.cond.buffer!r} "
                                     f"(defined: {bufs or 'none'}; use read(..., buffer=...))")
                # a threshold outside the read's range would make the condition constant (never or always)
                read = next(r for r in v if r.primitive == "read" and r.buffer == op.cond.buffer)
                lo, hi, what = ((-1.0, 1.0, "a cosine similarity") if read.kind == "cosine" else
                                (0.0, 1.0, "a probe's sigmoid") if read.sigmoid else (None, None, None))
                if lo is not None and not lo <= op.cond.threshold <= hi:
                    raise ValueError(f"{i}.cond.threshold: {op.cond.threshold} is outside [{lo:g}, {hi:g}], the range of "
                                     f"{what} (buffer {op.cond.buffer!r}): the condition would never or always hold")
        return v

    @field_validator("ops")
    @classmethod
    def _latches(cls, v):
        reads = {op.name: op for op in v if op.primitive == "read"}
        latched = set()
        for i, op in enumerate(v):
            if op.primitive != "write" or op.cond is None or op.cond.latch is None:
                continue
            name = op.cond.latch
            src = reads.get(name)
            if src is None:
                raise ValueError(f"{i}.cond.latch: no read of this app is named {name!r} (reads: "
                                 f"{sorted(reads) or 'none'}); a latch names a read declared with .on(...)")
            if src.on is None:
                raise ValueError(f"{i}.cond.latch: read {name!r} has no trigger; declare it with "
                                 ".on(op, threshold, action='latch') (the latch is its first crossing)")
            latched.add(name)
        for i, op in enumerate(v):
            if op.primitive == "read" and op.on is not None and op.on.action == "latch" and op.name not in latched:
                raise ValueError(f"{i}.on.action: 'latch' switches on the app's writes with cond(latch="
                                 f"{op.name!r}), and no write of this app names read {op.name!r} (use 'flag' to "
                                 "only record the crossing)")
        return v

    def latch_read(self, name: str) -> "ReadOp":
        """The read (with a trigger) that ``cond(latch=name)`` names."""
        return next(op for op in self.ops if op.primitive == "read" and op.name == name)

    def latched_reads(self) -> set[str]:
        """Names of the reads that some write of this app latches on (``cond(latch=...)``)."""
        return {op.cond.latch for op in self.ops
                if op.primitive == "write" and op.cond is not None and op.cond.latch is not None}

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
        """sha256 (hex, 16 chars) of the canonical JSON, each vector in it replaced by the digest
        of its float32 values (how it is applied; :func:`vector_digest`): the same app whether a
        vector is given inline or as a file, a different app for a different vector, name,
        scale, layer, ...

        Raises:
            XmixSpecError: a vector file that cannot be read (:func:`~.vectors.load_vector`)."""
        data = self.model_dump(mode="json")
        for i, (op, d) in enumerate(zip(self.ops, data["ops"])):
            key = "vector" if op.primitive == "write" else "weight"
            if getattr(op, key) is not None:
                d[key] = vector_digest(getattr(op, key), f"{self.name}.ops.{i}.{key}")
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: digests of vector files already read: (path, key, size, mtime) -> digest
_FILE_DIGESTS: dict[tuple, str] = {}


def vector_digest(ref, field: str) -> str:
    """``"sha256:<hex>"`` of a vector's values as float32 (shape and bytes; ``-inf`` entries of
    router masks included), for an inline list or a :class:`VectorFile` alike. A file's digest
    is kept per (path, key, size, modification time), so a request naming an app by its builder
    does not read the file again.

    Raises:
        XmixSpecError: the file cannot be read or holds no real 1-D vector."""
    stamp = None
    if isinstance(ref, VectorFile):
        try:
            st = os.stat(os.path.expanduser(ref.path))
            stamp = (os.path.abspath(os.path.expanduser(ref.path)), ref.key, st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None  # load_vector names the problem
        if stamp is not None and stamp in _FILE_DIGESTS:
            return _FILE_DIGESTS[stamp]
    arr = np.ascontiguousarray(load_vector(ref, field, allow_neg_inf=True), dtype=np.float32)
    h = hashlib.sha256(str(arr.shape).encode())
    h.update(arr.tobytes())
    digest = "sha256:" + h.hexdigest()
    if stamp is not None:
        if len(_FILE_DIGESTS) > 256:
            _FILE_DIGESTS.clear()
        _FILE_DIGESTS[stamp] = digest
    return digest


#: the op kinds a deployment can reserve entries for (apps added on a running server): the kinds
#: that commute with each other at a hook site (adds) or only read it (probes, cosines)
RESERVE_KINDS: tuple[str, ...] = ("add", "linear_probe", "cosine")
#: most spare versions per deployed app, and most reserved entries of one kind per site
MAX_RESERVE = 16


def _reserve_amount(v):
    """``{hook: layers}`` (one entry at each of those sites) or an int n (n entries at every
    hooked site)."""
    if v is None:
        return v
    if _is_a(v, numbers.Integral):
        if not 1 <= int(v) <= MAX_RESERVE:
            raise ValueError(f"expected an entry count in 1..{MAX_RESERVE} per site, got {v!r}")
        return int(v)
    if not isinstance(v, dict) or not v:
        raise ValueError("expected {hook: layers} (one entry at each of those sites) or an entry count per "
                         f"hooked site, got {type(v).__name__} {v!r}")
    return v


class Reserve(BaseModel):
    """Capacity kept at engine start for apps changed on a running server (the admin routes of
    the OpenAI server, ``POST /v1/mi/apps`` and ``POST /v1/mi/apps/{name}``; docs/design.md,
    "Apps on a running server"). Reserved entries are ordinary entries of the device tables
    whose coefficient is 0 until an app takes them: they are hooked, compiled and captured at
    start-up, so taking one needs no recompilation and no graph recapture.

    Fields:
        versions: spare copies of every deployed app's entries (same sites, same order at each
            site): a replaced app's new parameters go into a free copy, while requests in
            flight keep the copy they started with. 0 (the default): deployed apps are replaced
            through the entries below where their ops allow it.
        add, linear_probe, cosine: entries for apps added at run time (and replaced added
            apps), per kind: ``{hook: layers}`` gives one entry of that kind at each of those
            sites (``{"hook_resid_post": "all"}``); an int ``n`` gives ``n`` entries at every
            hooked site (a site where a deployed app or another reserved entry is). An added
            app's op of that kind takes one entry at each of its layers. Only adds (which
            commute) and probe / cosine reads (which see the site's final value) are reserved:
            an added app applies after the deployed apps at a site, as if deployed last.
    """

    model_config = ConfigDict(extra="forbid")
    versions: StrictInt = 0
    add: Annotated[Union[int, dict[str, Layers], None], BeforeValidator(_reserve_amount)] = None
    linear_probe: Annotated[Union[int, dict[str, Layers], None], BeforeValidator(_reserve_amount)] = None
    cosine: Annotated[Union[int, dict[str, Layers], None], BeforeValidator(_reserve_amount)] = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, v):
        if isinstance(v, dict):
            bad = [k for k in v if k not in ("versions",) + RESERVE_KINDS]
            if bad:
                raise ValueError(f"{bad[0]}: not reservable; a reserve has 'versions' and entries of the kinds "
                                 f"{', '.join(RESERVE_KINDS)} (added apps take those)")
        return v

    @field_validator("versions")
    @classmethod
    def _versions(cls, v: int) -> int:
        if not 0 <= v <= MAX_RESERVE:
            raise ValueError(f"expected 0..{MAX_RESERVE} spare versions per app, got {v}")
        return v

    @field_validator("add", "linear_probe", "cosine")
    @classmethod
    def _hooks(cls, v, info):
        if not isinstance(v, dict):
            return v
        out = {}
        for hook, layers in v.items():
            h = _hook_name(hook)
            if info.field_name == "add" and h == ROUTER_HOOK:
                raise ValueError(f"{hook}: adds go to the residual-stream hooks (router logits take router_bias)")
            out[h] = layers
        return out

    def kinds(self) -> dict[str, Any]:
        """The reserved kinds and their amounts (``{hook: layers}`` or an int), in
        :data:`RESERVE_KINDS` order."""
        return {k: getattr(self, k) for k in RESERVE_KINDS if getattr(self, k) is not None}


class DeploymentConfig(BaseModel):
    """``additional_config["xmix"]``: the apps compiled into this engine.

    Fields:
        apps: the deployed apps (unique names).
        fused_writes: ``"auto"`` (default): ``"norm"`` where it costs requests with apps
            off nothing, else ``"none"`` (resolved when the engine is configured,
            ``validation.engine.resolve_fused_writes``: ``"norm"`` unless the model is
            quantized, tensor parallelism is on, or one of vLLM's compile passes that match
            RMSNorm is on). ``"none"``, ``"adds"`` or ``"all"``: which unconditional
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
            ``"norm"``: no torch ops in the graph; instead the hook op of a residual-stream
            site that vLLM's next fused residual add + RMSNorm consumes (``hook_resid_pre`` of
            layers >= 1, ``hook_resid_mid``, ``hook_resid_post`` of all but the last layer)
            replaces that norm call: vLLM's own kernel in the graph variants where the site's
            apps are off, one kernel of writes and norm where they are on
            (``vllm_xmix.kernels.add_rms_norm``), eager and compiled alike (H200, Llama-3.1-8B
            decode step at batch 1/8/64: all-layer steering -0.05/+1.6/+1.3% against
            +1.1/+6.7/+2.5% with ``"none"``, apps off within 1% for both; trade-offs:
            docs/design.md, "Writes inside the norm").
        reserve: optional :class:`Reserve`: capacity for apps replaced or added on a running
            server (with ``fused_writes`` ``"adds"`` / ``"all"`` refused: those compile the
            writes into the graph).
        runtime: set by the plugin at engine configuration; keys the compile cache.
    """

    model_config = ConfigDict(extra="forbid")
    apps: list[AppSpec] = Field(default_factory=list)
    #: see the class docstring (trade-off, measured costs: benchmarks/RESULTS.md);
    #: "adds" suits deployments where most requests steer
    fused_writes: Literal["adds", "all", "auto", "none", "norm"] = "auto"
    #: set by the plugin at engine configuration (``"vllm-xmix <version>"``); keys the compile cache
    runtime: str | None = None
    reserve: Reserve | None = None

    @model_validator(mode="after")
    def _reserve_needs_tables(self):
        if self.reserve is not None and self.fused_writes in ("adds", "all"):
            raise ValueError(f"reserve: with fused_writes {self.fused_writes!r} the compiled graph applies the "
                             "writes itself, so apps changed on a running server could not reach it; use "
                             "fused_writes 'auto', 'norm' or 'none' with a reserve")
        return self

    @field_validator("apps")
    @classmethod
    def _unique(cls, v: list[AppSpec]) -> list[AppSpec]:
        dup = _repeated([a.name for a in v])
        if dup:
            raise ValueError(f"duplicate app names {dup}")
        return v

    def app(self, name: str) -> AppSpec:
        for a in self.apps:
            if a.name == name:
                return a
        raise KeyError(name)


def _request_layers(v) -> list[int] | None:
    """A request's layers: a list of layer indices, or ``"all"`` (None: the app's deployed layers)."""
    if isinstance(v, str) and v == "all":
        return None
    if isinstance(v, (list, tuple)) and len(v) > MAX_REQUEST_LAYERS:  # (before each entry is looked at)
        raise ValueError(f"{len(v)} layer indices; a request lists at most {MAX_REQUEST_LAYERS} (each layer once)")
    return _layer_list(v)


#: the most layer indices a request's ``layers`` may list (more than any model has)
MAX_REQUEST_LAYERS = 4096


class RequestApp(BaseModel):
    """One app switched on for one request.

    Fields:
        name: a deployed app's name.
        scale: coefficient for every op of the app (default: the op's deployed ``scale``);
            a finite float (``bool`` and strings are rejected).
        layers: optional subset of the app's deployed layers to apply on this request
            (``"all"``: every deployed layer, the same as leaving it out).
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    scale: OptionalFloat32 = None
    layers: Annotated[Union[list[int], None], BeforeValidator(_optional(_request_layers))] = None
    #: content hash of the app the caller meant (set when an ``MIApp`` is passed); checked
    #: against the deployed app of that name when the request is added
    hash: str | None = None
    #: which parameters of a replaced or added app the request runs with (written by the front
    #: end into the canonical selection when the request is added; refused from users): 0, or
    #: absent, is the deployment's own
    version: StrictInt | None = None
