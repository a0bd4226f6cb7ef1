"""``FusedMoE`` (vLLM's MoE runner, ``model_executor/layers/fused_moe``): where a MoE block hands
its router to the runner (``FusedMoE(gate=...)``: Qwen3-MoE, DeepSeek-V2/V3, ...), the runner
computes the router logits itself inside the MoE op (on GPU an opaque custom op, under CUDA graphs
replayed without Python; with a shared-expert gate fused into one ``F.linear`` the gate module is
not even called), so a hook on the gate module is not a place the logits reliably pass through.

:func:`take_gate_out` is applied by the model-construction patch to a layer whose
``mlp.hook_router_logits`` is deployed: the runner forgets the gate (``is_internal_router`` becomes
False), and the block takes vLLM's own branch for that case, ``router_logits, _ =
self.gate(hidden_states)`` in its ``forward`` followed by ``self.experts(hidden_states,
router_logits)``: the same ``F.linear`` on the same weights, now in the model's graph, where the
router hook sits. Layers without a deployed router site keep vLLM's structure untouched.
"""

from __future__ import annotations


def take_gate_out(experts) -> None:
    """Make ``experts`` (a ``FusedMoE`` runner built with ``gate=``) take router logits from its
    caller instead of calling the gate itself.

    Raises:
        RuntimeError: ``experts`` is not a runner with an internal gate (vLLM changed its MoE
        runner; the router hook would not see the logits)."""
    if not getattr(experts, "is_internal_router", False) or getattr(experts, "gate", None) is None:
        raise RuntimeError(
            f"vllm_xmix: {type(experts).__name__} holds no router gate to take out (vLLM's FusedMoE changed?): "
            "mlp.hook_router_logits cannot be placed")
    experts.gate = None  # MoERunner.is_internal_router: `self.gate is not None`
    experts._fse_fuse_gate = False  # (shared-expert gate fused into the router GEMM: only with a gate)
    if getattr(experts, "is_internal_router", True):
        raise RuntimeError("vllm_xmix: the FusedMoE runner still routes internally after its gate was removed")
