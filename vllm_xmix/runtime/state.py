"""The worker-side MI runtime of one model instance: :class:`XmixState`, a façade over its parts
along the data path (layout -> slots -> step fill -> variants -> reads).

One :class:`XmixState` per model instance; it lives in vLLM's
``compilation_config.static_forward_context["vllm_xmix"]`` so that the custom ops find it through
the forward context (no process globals: several engines in one process stay separate).
"""

from __future__ import annotations

import logging

import torch

from ..hf_config import n_experts, text_config
from ..spec import CONFIG_KEY, DeploymentConfig, parse_deployment
from .layout import MODULE_BUFFERS, DeviceLayout
from .site_keys import SiteKeys
from .reads import ReadTransport
from .replicas import ReplicaCheck
from .slots import SlotRegistry
from .step import StepFill
from .updates import AppUpdates
from .variants import GraphVariants

logger = logging.getLogger("vllm.xmix")

STATE_KEY = "vllm_xmix"


class _Via:
    """An attribute of one of the state's parts, read (and written) through the façade."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class XmixState:
    """Per-model-instance MI runtime. Its parts, each with one job:

    * ``layout`` (:class:`.layout.DeviceLayout`): the compiled deployment: entries, sites and the
      device tables the hook ops read; ``layout.conditions``
      (:class:`.conditions.ConditionTables`): the condition state of conditional writes;
    * ``slots`` (:class:`.slots.SlotRegistry`): which request holds which slot;
    * ``step`` (:class:`.step.StepFill`): the per-step fill of the token tables;
    * ``variants`` (:class:`.variants.GraphVariants`): run masks, CUDA-graph variants, site plans;
    * ``reads`` (:class:`.reads.ReadTransport`): the read snapshots' way to the host;
    * ``updates`` (:class:`.updates.AppUpdates`): app versions changed on a running server;
    * ``replicas`` (:class:`.replicas.ReplicaCheck`): under tensor parallelism, the check that
      every hook site sees the same whole tensor on every rank.

    The state itself keeps the hook bookkeeping (``installed`` sites, ``calls`` per site, the
    buffer modules) and checks it (:meth:`verify_hooks_fired`). The attributes below are the
    parts' own, named here for the model-runner patches, the hook ops and the adapters."""

    # layout
    d_model = _Via("layout")
    device = _Via("layout")
    max_tokens = _Via("layout")
    max_slots = _Via("layout")
    entries = _Via("layout")
    sites = _Via("layout")
    site_names = _Via("layout")
    site_id = _Via("layout")
    tok_slot = _Via("layout")
    vectors = _Via("layout")
    out = _Via("layout")
    tok_fc = _Via("layout")
    site_fused = _Via("layout")
    site_fused_spec = _Via("layout")
    site_fused_id = _Via("layout")
    fused_entries = _Via("layout")
    # conditions
    has_token_cond = _Via("conditions")
    cond_args = _Via("conditions")
    gate = _Via("conditions")
    store_request_values = _Via("conditions")
    note_tokens = _Via("conditions")
    # slots
    req_rows = _Via("slots")
    req_slot = _Via("slots")
    req_fc = _Via("slots")
    free_slots = _Via("slots")
    preempted = _Via("slots")
    update_requests = _Via("slots")
    # step fill
    fill = _Via("step")
    dummy_forward = _Via("step")
    forwards = _Via("step")
    high_water = _Via("step")
    stage_waits = _Via("step")
    # graph variants
    run_mask = _Via("variants")
    all_mask = _Via("variants")
    tok_unit = _Via("variants")
    active = _Via("variants")
    fused_mode = _Via("variants")
    variants_enabled = _Via("variants")
    capturing_variants = _Via("variants")
    capture_variant = _Via("variants")
    graph_variants = _Via("variants")
    variant_steps = _Via("variants")
    runs = _Via("variants")
    site_plan = _Via("variants")
    # reads
    snapshot = _Via("reads")
    pop_snapshot = _Via("reads")
    reads_of = _Via("reads")

    def __init__(self, layout: DeviceLayout) -> None:
        self.layout = layout
        self.conditions = layout.conditions
        self.variants = GraphVariants(layout)
        self.slots = SlotRegistry(layout, self.variants)
        self.reads = ReadTransport(layout.out)
        from ..spec import ROUTER_HOOK

        widths = [layout.d_model] * len(layout.sites)
        for (_, hook), sid in layout.sites.items():
            if hook == ROUTER_HOOK:
                widths[sid] = int(layout.n_experts or 0)
        self.replicas = ReplicaCheck(len(layout.sites), widths, layout.device)
        self.step = StepFill(layout, self.slots, self.variants, self.reads)
        self.updates = AppUpdates(layout, self.slots)
        self.installed: set[int] = set()  # sites whose hook the adapter installed
        self.site_keys = SiteKeys()  # the hook ops' site lookup (runtime/site_keys.py)
        self.calls = [0] * len(layout.sites)  # hook-op calls per site (eager, compiled, captures)
        # the hosted norms' kernel launches per pair of site plans (ops._norm_launch; opaque here)
        self.norm_launches: dict = {}
        self.token_hook_calls = 0
        self.token_hook_installed = False
        self.buffer_modules: list = []  # modules holding the runtime's buffers (adapters._residual)
        self.verified = False

    @classmethod
    def build(cls, deployment: DeploymentConfig, n_layers: int, d_model: int, device: torch.device,
              max_tokens: int, max_slots: int, n_experts: int | None = None, vocab_size: int = 0,
              max_model_len: int = 0) -> "XmixState":
        """The runtime of ``deployment`` on a model of ``n_layers`` x ``d_model`` (see
        :meth:`.layout.DeviceLayout.build` for the arguments and errors)."""
        return cls(DeviceLayout.build(deployment, n_layers, d_model, device, max_tokens, max_slots, n_experts,
                                      vocab_size=vocab_size, max_model_len=max_model_len))

    def counts(self) -> dict[str, int]:
        """What the runtime holds per request right now, as plain ints (read-only; JSON-able).

        Per-request bookkeeping (``slots_held``, ``rows_registered``, ``reads_registered``,
        ``fused_rows``, ``prompt_lengths``, ``prompts_staged``, ``preempted``, ``pending_rows``,
        ``variant_requests``, ``step_positions``, ``step_reads``), the free and total slots (``slots_free``,
        ``slots_total``: ``max_slots - 1``, slot 0 is the null slot), the device rows of the
        per-token tables that point at a request (``tok_slot_rows``: non-null entries of
        ``tok_slot [max_tokens]``; ``tok_fc_rows``: non-zero rows of ``tok_fc``), the read
        snapshots waiting for their step's output (``snapshots_pending``), those taken since start
        (``snapshots_taken``: 0 on a rank whose outputs vLLM drops, :attr:`.reads.ReadTransport.keep`),
        whether the tensor-parallel replica check ran (``replicas_checked``), the pinned buffers
        kept for reuse (``snapshot_pool``, at most ``reads._POOL``), the coefficient rows cached
        per distinct selection (``row_cache``, bounded). With no request in flight and after the
        worker has seen the last ones finish (vLLM reports finished requests in the next step's
        scheduler output), every per-request count is 0 and ``slots_free == slots_total``.

        App versions (:mod:`.updates`): ``versions_held``, the ``(app, version)`` pairs that hold
        entries; ``versions_superseded``, those among them that are not their app's current
        version (kept for requests that were in flight at a change; released at the next change
        once no request runs them); ``entries_held``, the entries they hold (one per op and
        layer of each version); ``spare_total`` / ``spare_free``, the entries of the deployed
        apps' spare copies (``reserve.versions``) and the free ones among them;
        ``reserved_total`` / ``reserved_free``, likewise for the reserved entries
        (``reserve.add`` / ``linear_probe`` / ``cosine``).

        Reads two small device tables back (a synchronisation): for tests and debugging, not
        for the step path."""
        sl, lay = self.slots, self.layout
        spare = [e for copies in lay.copies.values() for c in copies[1:] for e in c]
        reserved = [e for es in lay.pool.values() for e in es]
        return {
            "slots_total": int(self.max_slots - 1),
            "slots_free": len(sl.free_slots),
            "slots_held": len(sl.req_slot),
            "rows_registered": len(sl.req_rows),
            "reads_registered": len(sl.req_reads),
            "fused_rows": len(sl.req_fc),
            "prompt_lengths": len(sl.req_plen),
            "prompts_staged": len(sl.req_prompt),
            "preempted": len(sl.preempted),
            "pending_rows": len(sl.pending_rows),
            "step_positions": len(sl.step_pos),
            "variant_requests": int(self.variants.n_requests),
            "step_reads": len(self.reads.step_reads),
            "snapshots_pending": len(self.reads._snapshots),
            "snapshots_taken": int(self.reads.taken),
            "replicas_checked": int(self.replicas.done),
            "snapshot_pool": len(self.reads._free),
            "row_cache": len(sl._rows),
            "high_water": int(self.step.high_water),
            "tok_slot_rows": int((lay.tok_slot != 0).sum().item()),
            "tok_fc_rows": int((lay.tok_fc != 0).any(dim=-1).sum().item()) if lay.tok_fc.numel() else 0,
            "versions_held": len(lay.version_entries),
            "versions_superseded": sum(self.updates.current.get(a) != v for a, v in lay.version_entries),
            "entries_held": sum(o is not None for o in lay.owner),
            "spare_total": len(spare),
            "spare_free": sum(lay.owner[e] is None for e in spare),
            "reserved_total": len(reserved),
            "reserved_free": sum(lay.owner[e] is None for e in reserved),
        }

    def verify_hooks_fired(self) -> None:
        """Fail loudly if a deployed hook site is missing from the model or was never executed
        (e.g. a torch.compile cache traced without it).

        Raises:
            RuntimeError: naming the sites, after the first forward."""
        if self.verified or self.step.forwards == 0:
            return
        names = self.layout.site_names
        n = len(self.layout.sites)
        missing = [names[s] for s in range(n) if s not in self.installed]
        if missing:
            raise RuntimeError(
                f"vllm_xmix: deployed hook sites {missing} were not installed on the model "
                "(unsupported architecture or layer class)"
            )
        if self.has_token_cond and not self.token_hook_installed:
            raise RuntimeError("vllm_xmix: token conditions are deployed but the embedding hook is not installed "
                               "(unsupported model class)")
        for m in self.buffer_modules:  # a module.to()/half() after construction would have copied them
            for name in MODULE_BUFFERS:
                if getattr(m, f"xmix_{name}").data_ptr() != getattr(self.layout, name).data_ptr():
                    raise RuntimeError(f"vllm_xmix: the buffer xmix_{name} of {type(m).__name__} is no longer the "
                                       "runtime's tensor (the model was moved or cast after construction); the "
                                       "compiled steering would read a stale copy")
        silent = [names[s] for s in range(n) if self.calls[s] == 0]
        if self.has_token_cond and self.token_hook_calls == 0:
            silent.append("embed_tokens (token conditions)")
        if silent:
            raise RuntimeError(
                f"vllm_xmix: hook sites {silent} never executed although the model ran: the "
                "compiled graph does not contain them (stale torch.compile cache?). Clear "
                "VLLM_CACHE_ROOT/torch_compile_cache or set VLLM_DISABLE_COMPILE_CACHE=1."
            )
        self.verified = True


def engine_limits(vllm_config) -> tuple[int, int, int]:
    """(max_tokens per step, request slots, max_model_len) the buffers are sized for."""
    sched = vllm_config.scheduler_config
    max_tokens = max(int(sched.max_num_batched_tokens),
                     int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
    # slots: running requests plus preempted ones that keep theirs (their condition state)
    return max_tokens, 2 * int(sched.max_num_seqs) + 1, int(vllm_config.model_config.max_model_len)


def get_state_from_config(vllm_config) -> XmixState | None:
    """The model instance's state, None if nothing is deployed (or not built yet)."""
    return vllm_config.compilation_config.static_forward_context.get(STATE_KEY)


def get_or_create_state(vllm_config, layer: torch.nn.Module | None = None) -> XmixState | None:
    """Called at decoder-layer construction (inside vLLM's model init, in the worker): the
    model instance's state, built at the first call from ``additional_config["xmix"]`` (None if
    nothing is deployed).

    The buffers go on the device of ``layer``'s parameters (the model's device)."""
    ctx = vllm_config.compilation_config.static_forward_context
    st = ctx.get(STATE_KEY)
    if st is not None:
        return st
    add = vllm_config.additional_config
    raw = add.get(CONFIG_KEY) if isinstance(add, dict) else None
    if raw is None:
        return None
    dep = parse_deployment(raw)
    text = text_config(vllm_config.model_config.hf_config)
    max_tokens, max_slots, max_model_len = engine_limits(vllm_config)
    device = None
    if layer is not None:
        p = next(layer.parameters(), None)
        if p is not None and p.device.type != "meta":
            device = p.device
    if device is None:
        device = vllm_config.device_config.device or torch.device("cpu")
    st = XmixState.build(dep, text.num_hidden_layers, text.hidden_size, device, max_tokens, max_slots,
                         n_experts(text), vocab_size=int(getattr(text, "vocab_size", 0) or 0),
                         max_model_len=max_model_len)
    ctx[STATE_KEY] = st
    logger.info("vllm_xmix: %d app(s), %d hook site(s), %d entries on %s", len(dep.apps),
                len(st.sites), len(st.entries), device)
    return st
