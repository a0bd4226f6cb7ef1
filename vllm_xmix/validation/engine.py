"""Checks of a deployment against the engine it is deployed on, when vLLM configures the engine
(in the front-end process, before any worker starts): architecture and hook points, layers and
vector sizes, write magnitudes against the model's dtype, buffer sizes, and the engine features
the runtime cannot serve (pipeline parallelism, speculative decoding, microbatching, sleep mode,
Inductor freezing, sequence parallelism, a ``VLLM_PLUGINS`` that leaves the plugin out).
"""

from __future__ import annotations

import logging
import os

from ..hf_config import n_experts, text_config
from ..runtime import (RUNTIME_ID, app_capture_size_setting, check_buffer_bytes, engine_limits,
                       graph_variant_settings, piecewise_variant_setting)
from ..spec import CONFIG_KEY, RESERVE_KINDS, XmixSpecError, parse_deployment, validate_deployment
from .requests import check_combined_magnitude, check_write_magnitude, field_path, misspelled_selection_key

logger = logging.getLogger("vllm.xmix")


def validate_engine_config(vllm_config) -> None:
    """Check ``additional_config["xmix"]`` against the model and the engine features.

    Raises:
        ValueError (XmixSpecError): bad spec, unsupported architecture or feature; a deployment
        under a misspelled key (``additional_config["xmx"]``, ``["mi_apps"]``: see
        ``validation.requests.misspelled_selection_key``), which nothing would read.
    """
    add = vllm_config.additional_config
    if not isinstance(add, dict):
        return
    # a deployment nothing reads: the engine would start without these apps (a bare "apps" key
    # is left to other extensions: additional_config is every platform's and plugin's)
    key = misspelled_selection_key(add, allow=("apps",))
    if key is not None:
        raise XmixSpecError(f"{field_path('additional_config', key)}: unknown key, which nothing reads, so the "
                            f"engine would start without these apps; deploy apps under "
                            f"additional_config[{CONFIG_KEY!r}] (vllm_xmix.deploy(...) builds it)")
    if CONFIG_KEY not in add:
        return
    dep = parse_deployment(add[CONFIG_KEY])
    mc = vllm_config.model_config
    archs = list(getattr(mc, "architectures", None) or getattr(mc.hf_config, "architectures", []) or [])
    validate_for_model(dep, archs, mc.hf_config)
    text = text_config(mc.hf_config)
    check_family_dtype(dep, archs, text, getattr(mc, "dtype", None))

    for ai, app in enumerate(dep.apps):
        check_write_magnitude(vllm_config, app.name, None, f"additional_config.xmix.apps.{ai}({app.name})", per_op=True)
        check_combined_magnitude(vllm_config, [(app.name, None, None)], f"additional_config.xmix.apps.{ai}({app.name})")

    try:
        graph_variant_settings()
        piecewise_variant_setting()
        app_capture_size_setting()
    except ValueError as e:
        raise XmixSpecError(f"additional_config.xmix: {e}") from None

    check_buffer_bytes(dep, text.num_hidden_layers, text.hidden_size, n_experts(text), *engine_limits(vllm_config))
    token_cond = any(op.primitive == "write" and op.cond is not None and op.cond.kind() in ("tokens", "tokens_prev")
                     for app in dep.apps for op in app.ops)
    if token_cond and getattr(mc, "enable_prompt_embeds", False):
        raise XmixSpecError("additional_config.xmix: token conditions (cond(tokens=...) / cond(tokens_prev=...)) "
                            "need the token ids inside the forward; with enable_prompt_embeds vLLM embeds "
                            "outside it. Start the engine without enable_prompt_embeds")
    ind = getattr(vllm_config.compilation_config, "inductor_compile_config", None) or {}
    if ind.get("freezing"):
        raise XmixSpecError("additional_config.xmix: inductor_compile_config freezing=True would inline the "
                            "runtime's buffers (zeros at compile time) as constants; not supported")
    if getattr(mc, "enable_sleep_mode", False):
        raise XmixSpecError("additional_config.xmix: sleep mode is not supported (level 2 discards the "
                            "runtime's device buffers along with the weights)")
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise XmixSpecError("additional_config.xmix: pipeline parallelism is not supported yet")
    if vllm_config.speculative_config is not None:
        raise XmixSpecError("additional_config.xmix: speculative decoding is not supported yet")
    if getattr(pc, "enable_dbo", False) or getattr(pc, "ubatch_size", 0) > 1:
        # vLLM's UBatchWrapper keeps its own CUDA graphs keyed by token count only: it would
        # replay one hook variant's graphs for every other (the apps would silently do nothing)
        raise XmixSpecError("additional_config.xmix: microbatching (dual-batch overlap, --ubatch-size > 1) "
                            "is not supported")
    pass_cfg = getattr(vllm_config.compilation_config, "pass_config", None)
    if getattr(pass_cfg, "enable_sp", False):
        raise XmixSpecError("additional_config.xmix: sequence parallelism shards the residual stream; not supported")
    if envs_plugins_exclude_xmix():
        raise XmixSpecError(
            "additional_config.xmix: VLLM_PLUGINS is set and does not name 'xmix': the engine's "
            "processes would not load vllm-xmix and the apps would silently do nothing"
        )
    # Canonical form (parsed and re-dumped), stamped with the runtime that builds the hooks: the
    # dict is part of vLLM's config hash, so a torch.compile/AOT cache written by an engine
    # without the plugin (or another plugin version) is never reused for this one.
    dep.runtime = RUNTIME_ID
    if dep.fused_writes == "auto":
        dep.fused_writes, why = resolve_fused_writes(vllm_config)
        logger.info("vllm_xmix: fused_writes=auto -> %s (%s)", dep.fused_writes, why)
    add[CONFIG_KEY] = dep.model_dump(mode="json", exclude_none=True)


def resolve_fused_writes(vllm_config) -> tuple[str, str]:
    """What ``fused_writes="auto"`` means on this engine, and why: ``"norm"`` (the residual-stream
    writes inside vLLM's add + RMSNorm, launched only in the graph variants where their apps
    are on) when the hosted norms lose nothing for requests with apps off; ``"none"`` (a kernel
    per site) when vLLM would fuse those norms with something else: a quantized model (Inductor
    fuses the norm with the activation quantization that follows it), tensor parallelism (the
    all-reduce + RMSNorm fusion), or a compile pass that pattern-matches RMSNorm turned on."""
    mc = vllm_config.model_config
    if getattr(mc, "quantization", None):
        return "none", f"quantization {mc.quantization!r}: vLLM fuses the norms with the quantization"
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return "none", "tensor parallelism: vLLM may fuse the all-reduce with the norms"
    pc = getattr(vllm_config.compilation_config, "pass_config", None)
    on = [f for f in ("fuse_norm_quant", "fuse_allreduce_rms") if getattr(pc, f, False)]
    if on:
        return "none", f"compile passes {on} match the norms"
    return "norm", "unquantized, one rank, no compile pass matches the norms"


def validate_for_model(dep, archs: list[str], hf_config) -> None:
    """The checks of a parsed deployment against a model alone (no engine): its architecture
    ``archs`` has an adapter, every op's hook is one the adapter provides, and layers, vector
    widths and token ids fit ``hf_config`` (``spec.validate_deployment``).

    Raises:
        XmixSpecError: naming the field (``additional_config.xmix...``); also a deployment with no
        apps and no entries reserved for apps added while serving, on which no request could
        select anything (as ``deploy()`` with no apps is refused)."""
    from ..adapters import SUPPORTED_ARCHITECTURES

    r = dep.reserve
    if not dep.apps and not (r is not None and any(getattr(r, k) for k in RESERVE_KINDS)):
        raise XmixSpecError("additional_config.xmix: no apps deployed and no entries reserved for apps added "
                            f"while serving (reserve: {' / '.join(RESERVE_KINDS)}): nothing a request could "
                            "select; deploy apps (vllm_xmix.deploy(...)) or reserve entries")
    if dep.apps and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise XmixSpecError(
            f"additional_config.xmix: architecture {archs} is not supported by vllm-xmix "
            f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    adapter = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    for ai, app in enumerate(dep.apps):
        for oi, op in enumerate(app.ops):
            if adapter is not None and op.hook not in adapter.hooks:
                raise XmixSpecError(
                    f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}.hook: {op.hook!r} is not "
                    f"available on {archs[0]} (available: {', '.join(adapter.hooks)})"
                )
    res = dep.reserve.kinds() if dep.reserve is not None else {}
    for kind, amt in res.items():
        for hook in (amt if isinstance(amt, dict) else {}):
            if adapter is not None and hook not in adapter.hooks:
                raise XmixSpecError(f"additional_config.xmix.reserve.{kind}.{hook}: not available on {archs[0]} "
                                    f"(available: {', '.join(adapter.hooks)})")
    text = text_config(hf_config)
    if dep.reserve is not None:
        from ..runtime.layout import reserved_sites

        reserved_sites(dep, text.num_hidden_layers, set())  # layers in range
    validate_deployment(dep, text.num_hidden_layers, text.hidden_size, n_experts(text),
                        getattr(text, "vocab_size", None))
    if adapter is not None and adapter.router is not None:
        _check_router_layers(dep, adapter, archs[0], text)


def check_family_dtype(dep, archs: list[str], text, dtype) -> None:
    """A family's own refusal of this model in this dtype (``DecoderAdapter.refuse``), with apps
    deployed or reserved for apps added later. ``text``: the model's text config; ``dtype``: the
    torch dtype it is served in.

    Raises:
        XmixSpecError: naming the dtype, the architecture and the family's reason."""
    from ..adapters import SUPPORTED_ARCHITECTURES

    adapter = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if (dep.apps or dep.reserve is not None) and adapter is not None and adapter.refuse is not None:
        why = adapter.refuse(text, dtype)
        if why:
            raise XmixSpecError(f"additional_config.xmix: dtype {str(dtype).removeprefix('torch.')} of {archs[0]}: "
                                f"{why}")


def _check_router_layers(dep, adapter, arch: str, text) -> None:
    """A router hook only at layers that have a router (a MoE model's dense layers have none)."""
    from ..spec import ROUTER_HOOK
    from ..spec.deployment import resolve_layers

    have = list(adapter.router_layers(text))
    for ai, app in enumerate(dep.apps):
        for oi, op in enumerate(app.ops):
            if op.hook != ROUTER_HOOK:
                continue
            f = f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}.layers"
            bad = [L for L in resolve_layers(op.layers, text.num_hidden_layers, f) if L not in have]
            if bad:
                raise XmixSpecError(
                    f"{f}: layer {bad[0]} of {arch} has a dense MLP, no router "
                    f"(layers with a router: {have}); list those layers instead of {op.layers!r}")


def envs_plugins_exclude_xmix() -> bool:

    v = os.environ.get("VLLM_PLUGINS")
    return v is not None and "xmix" not in [x.strip() for x in v.split(",")]
