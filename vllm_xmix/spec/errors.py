"""The spec's error type, and turning JSON and pydantic errors into it.

Every bad app spec, deployment or request surfaces as :class:`XmixSpecError` (a ``ValueError``)
whose message starts with the offending field, e.g. ``app 'happy'.ops.0.scale: ...``.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class XmixSpecError(ValueError):
    """A bad app spec or request: the message names the offending field."""


#: the start of a message, raised by a validator of a list field, that names the item and the
#: field it is about ("1.cond.buffer: ..."): part of the location, not of the message
_SUB_LOC = re.compile(r"(\d+(?:\.[A-Za-z_]\w*)+): ")
#: the start of a message, raised by a model's validator, that names the field it is about
#: ("vector: zero vector has no direction ..."): part of the location too (``ops.0.vector``)
_FIELD_LOC = re.compile(r"(vector|weight|bias|sigmoid|hook|kind|scale|value|cond|threshold|layers|buffer|name|"
                        r"positions|scope|on|key|path|op|tokens|tokens_prev|latch): ")


def _fmt_validation_error(prefix: str, e: ValidationError) -> str:
    """One line per pydantic error, ``{prefix}.{loc}: {msg}``, joined with ``"; "``; the
    discriminated union's ``write``/``read`` tag is dropped from the location, and a list
    validator's item path at the start of its message joins it (``apps.0.ops.1.cond.buffer``), and
    so does the field a model validator's message starts with (``apps.0.ops.0.vector``)."""
    parts = []
    for err in e.errors():
        raw = list(err.get("loc", ()))
        # drop the union tag pydantic inserts after an op index ("ops.0.write.scale" -> "ops.0.scale")
        raw = [x for i, x in enumerate(raw) if not (x in ("write", "read") and i and isinstance(raw[i - 1], int))]
        loc = ".".join(str(x) for x in raw)
        msg = err.get("msg", "")
        msg = msg.removeprefix("Value error, ")
        sub = _SUB_LOC.match(msg) or (_FIELD_LOC.match(msg) if raw and err.get("type") == "value_error" else None)
        if sub:  # a list validator's message naming an item's field ("1.cond.buffer: ..."), a model's its own
            loc, msg = f"{loc}.{sub.group(1)}" if loc else sub.group(1), msg[sub.end():]
        got = repr(err.get("input"))
        if err.get("type", "").endswith(("literal_error", "_type", "_parsing", "enum")) and len(got) <= 60:
            msg += f" (got {got})"  # which value: e.g. "ALL" where 'all' was meant
        parts.append(f"{prefix}{'.' + loc if loc else ''}: {msg}")
    return "; ".join(parts)


def _json(s: str, field: str) -> Any:
    """``json.loads(s)``. Raises XmixSpecError ``{field}: not valid JSON (...)``, or
    ``{field}: nested too deeply`` (JSON text deeper than the parser's recursion limit)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise XmixSpecError(f"{field}: not valid JSON ({e})") from None
    except RecursionError:
        raise XmixSpecError(f"{field}: JSON text nested too deeply (a selection is a flat list of apps)") from None


def _validated(model: type[M], data, prefix: str, *, from_json: bool = False) -> M:
    """``model.model_validate(data)`` (``model_validate_json`` with ``from_json``).

    Raises:
        XmixSpecError: the pydantic errors, formatted by :func:`_fmt_validation_error` with ``prefix``.
    """
    try:
        return model.model_validate_json(data) if from_json else model.model_validate(data)
    except ValidationError as e:
        raise XmixSpecError(_fmt_validation_error(prefix, e)) from None
