"""vLLM 0.32.x: what differs from 0.26.x (:mod:`.v0_26`) for the patches.

* OLMo 3 (``Olmo3ForCausalLM``): vLLM 0.32 removed ``model_executor/models/olmo3.py`` and serves
  the architecture through its Transformers backend (``TransformersForCausalLM``), whose layers
  are HF's: the adapter's classes do not exist, so apps on it are refused at engine start.
* MoE blocks that hand their gate to the ``FusedMoE`` runner (Qwen3-MoE) no longer have a branch
  for a runner without a gate: the block always calls ``experts(hidden_states=h, router_logits=h)``
  (``MoERunner`` has no ``is_internal_router``), so once the gate is taken out a pre-hook on the
  runner computes the router logits with it (:mod:`..fused_moe`).
"""

from __future__ import annotations

from . import VersionTable

TABLE = VersionTable(
    series=(0, 32),
    unserved_architectures={
        "Olmo3ForCausalLM": "vLLM 0.32 serves it through its Transformers backend, not Olmo3DecoderLayer",
    },
    moe_block_calls_its_gate=False,
)
