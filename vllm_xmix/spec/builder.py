"""What users write: the :class:`MIApp` builder (xMIx programming interface, Blum et al.,
section 4.1), which lowers to an :class:`AppSpec`, and :func:`deploy`, which turns apps into
vLLM's ``additional_config``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .deployment import parse_deployment
from .errors import XmixSpecError, _validated
from .model import AppSpec
from .names import CONFIG_KEY, KNOWN_READ_KINDS, _hook_name
from .vector_files import _tensor_to_numpy


class _OpBuilder:
    """Refines one op of an :class:`MIApp`; every method returns ``self`` for chaining."""

    def __init__(self, app: "MIApp", fields: dict[str, Any]):
        self._app = app
        self._fields = fields

    def _set_once(self, key: str, method: str, value) -> None:
        """Set an op field that a chain may give once (a second call would silently replace the
        first). Raises XmixSpecError naming the method."""
        if key in self._fields:
            raise XmixSpecError(f"{self._app.name}.{method}: already given for this op "
                                f"({self._fields[key]!r}); give it once (write a second op for another one)")
        self._fields[key] = value

    def layers(self, layers) -> "_OpBuilder":
        """``[int, ...]``, ``range(...)``, a 1-D integer array or ``"all"`` (once per op)."""
        if isinstance(layers, range):
            layers = list(layers)
        elif isinstance(layers, (int, np.integer)) and not isinstance(layers, (bool, np.bool_)):
            layers = [int(layers)]
        self._set_once("layers", "layers", layers)
        return self

    def submodule(self, hook: str) -> "_OpBuilder":
        """TransformerLens hook name, e.g. ``"hook_resid_post"`` (once per op)."""
        self._set_once("hook", "submodule", _hook_name(hook))
        return self

    def cond(self, **predicate) -> "_OpBuilder":
        """Guard a write with a predicate (see :class:`Cond`): ``tokens=[ids]``,
        ``tokens_prev=[ids]``, ``buffer="name", op=">", threshold=t``, or ``latch="read name"``
        (from the first position where that read's trigger, ``.on(...)``, fires, for the rest of
        the request; at layers after the read's); optional ``positions="generated"``; one
        predicate per op. Reads cannot be conditioned (rejected)."""
        if not predicate:
            raise XmixSpecError(f"{self._app.name}.cond: give a predicate: tokens=[...], tokens_prev=[...], "
                                "buffer=..., op=..., threshold=..., or latch=<read name>")
        self._set_once("cond", "cond", predicate)
        return self

    def on(self, op: str = ">", threshold: float | None = None, *, action: str = "flag") -> "_OpBuilder":
        """Act on this read's value (see :class:`Trigger`): ``.on(">", 0.9, action="stop")`` ends
        the request at the first position whose value is above 0.9; ``action="flag"`` records it
        in ``mi_results[app]["triggers"]``; ``action="latch"`` records it and switches on the
        app's writes with ``.cond(latch=<this read's name>)`` from that position on. Reads only
        (``linear_probe`` / ``cosine``); once per op."""
        if self._fields.get("primitive") != "read":
            raise XmixSpecError(f"{self._app.name}.on: only a read (a probe's value) takes a trigger")
        if threshold is None:
            raise XmixSpecError(f"{self._app.name}.on: give a threshold, e.g. .on('>', 0.9, action='stop')")
        self._set_once("on", "on", {"op": op, "threshold": threshold, "action": action})
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
        return self._add(fields)

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
        given = {"positions": positions, "name": name, "buffer": buffer, "scope": scope}
        fields.update({k: v for k, v in given.items() if v is not None})
        return self._add(fields)

    def _add(self, fields: dict[str, Any]) -> _OpBuilder:
        """Append an op with these (not yet validated) fields; its builder."""
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
            vector = _tensor_to_numpy(vector, f"{self.name}.{field}")
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
        ops = [dict(o._fields) for o in self._ops]
        return _validated(AppSpec, {"name": self.name, "ops": ops}, f"app {self.name!r}")

    def to_json(self) -> str:
        """The validated :class:`AppSpec` as JSON. Raises XmixSpecError like :meth:`to_spec`."""
        return self.to_spec().model_dump_json()

    @staticmethod
    def from_json(s: str) -> AppSpec:
        """Parse an :class:`AppSpec` from JSON (e.g. :meth:`to_json`'s). Raises XmixSpecError naming the field."""
        return _validated(AppSpec, s, "app", from_json=True)

    def content_hash(self) -> str:
        """:meth:`AppSpec.content_hash` of the validated app (16 hex chars)."""
        return self.to_spec().content_hash()


def deploy(*apps: MIApp | _OpBuilder | AppSpec | dict, fused_writes: str = "auto") -> dict[str, Any]:
    """Build vLLM's ``additional_config`` for these apps: ``{"xmix": {"apps": [...],
    "fused_writes": ...}}``.

    ``fused_writes``: ``"auto"`` (default: ``"norm"`` where it costs apps-off requests nothing,
    else ``"none"``; :class:`DeploymentConfig`), ``"none"``, ``"adds"`` or ``"all"``: which unconditional writes a
    compiled engine applies inside its graph, at a cost to every request, apps on or off
    (trade-off and measured costs: :class:`DeploymentConfig`; no effect with ``enforce_eager``);
    ``"norm"``: residual-stream writes run inside vLLM's next residual add + RMSNorm, in one
    kernel, only in the graph variants where their apps are on.

    Raises:
        XmixSpecError: for an invalid app or ``fused_writes`` (the message names the field); no
            apps (an engine that would start with nothing to switch on); a list of apps given as
            one argument.
    """
    if not apps:
        raise XmixSpecError("deploy: no apps given; pass the apps to deploy, e.g. deploy(happy, probe)")
    specs = []
    for i, a in enumerate(apps):
        if isinstance(a, (list, tuple)):
            raise XmixSpecError(f"deploy: argument {i} is a {type(a).__name__} of {len(a)}; pass the apps as "
                                "arguments, deploy(*apps)")
        if isinstance(a, (MIApp, _OpBuilder)):  # MIApp("x").write(...).layers(...) chains end on an op
            specs.append(a.to_spec())
        elif isinstance(a, AppSpec):
            specs.append(a)
        elif isinstance(a, dict):  # (errors named as the caller wrote it: deploy's argument)
            specs.append(_validated(AppSpec, a, f"deploy argument {i}"))
        else:
            raise XmixSpecError(f"deploy: argument {i} is {type(a).__name__}; expected an MIApp (or one of its "
                                "op chains), or an app as a dict")
    dep = parse_deployment({"apps": [s.model_dump(mode="json") for s in specs], "fused_writes": fused_writes})
    return {CONFIG_KEY: dep.model_dump(mode="json", exclude_none=True)}
