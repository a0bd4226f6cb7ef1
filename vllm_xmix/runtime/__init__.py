"""Worker-side MI runtime, along the data path of a step:

* :mod:`.layout` -- the compiled deployment: entries at hook sites and the device tables the hook
  ops read (``tok_slot``, ``coef``, ``vectors``, ``out``, ``tok_fc``), built once at engine start;
* :mod:`.conditions` -- the condition state of conditional writes (token sets, positions,
  request-scope condition values);
* :mod:`.slots` -- the request registry: which request holds which slot;
* :mod:`.step` -- the per-step fill of the token tables from the scheduler's batch;
* :mod:`.variants` -- run masks, CUDA-graph variants and the site plans the hook ops apply;
* :mod:`.reads` -- the read values' way from the device to the host, per request;
* :mod:`.updates` -- app versions replaced or added on a running server, in reserved entries;
* :mod:`.state` -- :class:`XmixState`, the façade that holds them for one model instance.

Nothing here imports vLLM internals; the model-runner patches in ``vllm_xmix._vllm_compat``
call into it.
"""

from .layout import MAX_READ_BUFFER_BYTES, RUNTIME_ID, DeviceLayout, Entry, buffer_bytes, check_buffer_bytes, fused_id
from .slots import NULL_SLOT
from .state import STATE_KEY, XmixState, engine_limits, get_or_create_state, get_state_from_config
from .step import RING
from .updates import AppUpdates, app_structure, pool_kind
from .variants import SitePlan, app_capture_size_setting, graph_variant_settings, piecewise_variant_setting

__all__ = [
    "MAX_READ_BUFFER_BYTES", "NULL_SLOT", "RUNTIME_ID", "RING", "STATE_KEY", "DeviceLayout", "Entry", "SitePlan", "XmixState",
    "buffer_bytes", "check_buffer_bytes", "engine_limits", "fused_id", "get_or_create_state",
    "get_state_from_config", "graph_variant_settings", "piecewise_variant_setting", "app_capture_size_setting", "AppUpdates", "app_structure", "pool_kind",
]
