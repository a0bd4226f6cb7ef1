"""``FusedMoE`` (vLLM's MoE runner, ``model_executor/layers/fused_moe``): where a MoE block hands
its router to the runner (``FusedMoE(gate=...)``: Qwen3-MoE, DeepSeek-V2/V3, ...), the runner
computes the router logits itself inside the MoE op (on GPU an opaque custom op, under CUDA graphs
replayed without Python; with a shared-expert gate fused into one ``F.linear`` the gate module is
not even called), so a hook on the gate module is not a place the logits reliably pass through.

:func:`take_gate_out` is applied by the model-construction patch to a layer whose
``mlp.hook_router_logits`` is deployed: the runner forgets the gate, and the block's gate computes
the logits in the model's graph, where the router hook sits, before the runner is called with
them: the same ``F.linear`` on the same weights. Who calls the gate then differs by version
(:attr:`.versions.VersionTable.moe_block_calls_its_gate`):

* vLLM 0.26: the block takes its own branch for a runner without a gate (``is_internal_router``
  False): ``router_logits, _ = self.gate(hidden_states)`` then ``self.experts(hidden_states,
  router_logits)``;
* vLLM 0.32: the block always calls ``self.experts(hidden_states=h, router_logits=h)`` and leaves
  routing to the runner; a forward pre-hook on the runner puts ``gate(hidden_states)[0]`` in the
  place of ``router_logits`` (what 0.26's branch did).

Layers without a deployed router site keep vLLM's structure untouched.
"""

from __future__ import annotations

from .versions import table


def _router_logits_from(gate):
    """A forward pre-hook (``with_kwargs``) for a runner called as ``experts(hidden_states,
    router_logits)`` (positional or keyword): ``router_logits`` becomes ``gate(hidden_states)[0]``
    (``[T, n_experts]``, the gate's dtype)."""

    def pre_hook(module, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        logits, _ = gate(h)
        if "router_logits" in kwargs:
            kwargs = {**kwargs, "router_logits": logits}
        else:
            args = (args[0], logits, *args[2:])
        return args, kwargs

    return pre_hook


def take_gate_out(experts) -> None:
    """Make ``experts`` (a ``FusedMoE`` runner built with ``gate=``) take router logits from its
    caller instead of calling the gate itself.

    Raises:
        RuntimeError: ``experts`` is not a runner with an internal gate (vLLM changed its MoE
        runner; the router hook would not see the logits)."""
    gate = getattr(experts, "gate", None)
    if gate is None:
        raise RuntimeError(
            f"vllm_xmix: {type(experts).__name__} holds no router gate to take out (vLLM's FusedMoE changed?): "
            "mlp.hook_router_logits cannot be placed")
    experts.gate = None  # the runner routes internally when `self.gate is not None`
    experts._fse_fuse_gate = False  # (shared-expert gate fused into the router GEMM: only with a gate)
    if getattr(experts, "is_internal_router", False) or getattr(experts, "gate", None) is not None:
        raise RuntimeError("vllm_xmix: the FusedMoE runner still routes internally after its gate was removed")
    if not table().moe_block_calls_its_gate:
        experts.register_forward_pre_hook(_router_logits_from(gate), with_kwargs=True)
