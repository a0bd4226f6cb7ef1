"""vLLM's start-up log line ``non-default args: {...}`` (``log_non_default_args``, from
``LLM(...)`` and the OpenAI server): a filter on its logger shortens a deployment's inline
vectors (``[0.01, -0.2, ...]`` of d_model floats each, or a token set of thousands of ids) to
``<4096 floats>``, so the line stays one readable line. Nothing else in the record changes."""

from __future__ import annotations

import json
import logging

from ..spec import CONFIG_KEY

#: the logger of vLLM's ``log_non_default_args``
LOGGER = "vllm.entrypoints.serve.utils.api_utils"
_LONG = 16  # lists of more numbers than this are shortened


def shorten(value):
    """``value`` with every list of more than 16 numbers replaced by ``"<n floats>"`` /
    ``"<n ints>"`` (a copy; dicts and lists recursively)."""
    if isinstance(value, dict):
        return {k: shorten(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > _LONG and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            kind = "ints" if all(isinstance(x, int) for x in value) else "floats"
            return f"<{len(value)} {kind}>"
        return [shorten(v) for v in value]
    return value


class ShortDeploymentFilter(logging.Filter):
    """Shortens the vectors of ``additional_config["xmix"]`` in vLLM's non-default-args line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("non-default args") and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            a = args[0]
            if isinstance(a, dict) and "additional_config" in a:
                add = a["additional_config"]
                if isinstance(add, str):
                    try:
                        add = json.loads(add)
                    except ValueError:
                        return True
                if isinstance(add, dict) and CONFIG_KEY in add:
                    record.args = ({**a, "additional_config": shorten(add)},) + tuple(args[1:])
        return True


def patch_args_log() -> None:
    """Attach the filter to vLLM's logger of the line (once)."""
    log = logging.getLogger(LOGGER)
    if not any(isinstance(f, ShortDeploymentFilter) for f in log.filters):
        log.addFilter(ShortDeploymentFilter())
