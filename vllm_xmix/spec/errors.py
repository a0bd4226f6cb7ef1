"""The spec's error type and the formatting of pydantic errors into it.

Every bad app spec, deployment or request surfaces as :class:`XmixSpecError` (a ``ValueError``)
whose message starts with the offending field, e.g. ``app 'happy'.ops.0.scale: ...``.
"""

from __future__ import annotations

from pydantic import ValidationError


class XmixSpecError(ValueError):
    """A bad app spec or request: the message names the offending field."""


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
