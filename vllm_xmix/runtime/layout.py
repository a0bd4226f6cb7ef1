"""The compiled deployment: the apps' ops lowered to entries at hook sites, and the device tables
the hook ops read. Built once per model instance at engine start, never reallocated (CUDA graphs
bake addresses).

* an *entry* is one (app, op, layer): a write (``kernels.row_write.ADD`` / ``PROJ``) or a read
  (``kernels.read_rows.PROBE`` / ``CAPTURE`` / ``COSINE``) at the *site* (layer, hook);
* ``vectors``   float32 ``[n_entries, d_model]``: the steering vector / probe weight of each entry
  (ablation and clamp directions and cosine references are unit vectors);
* ``kinds`` / ``values`` / ``cols`` / ``flags`` int32 / float32 ``[n_entries]``: per-entry kernel
  parameters (also as host lists, ``*_host``, for the torch references);
* ``tok_slot``  int32 ``[max_tokens]``: per token of the current step, the slot of its request
  (written by the step fill); 0 is the null slot (no app on), so padding and app-free requests
  are inert;
* ``coef``      float32 ``[max_slots, n_entries]``: per slot, one coefficient per entry (the
  request's scale for writes, 1/0 for reads); row 0 stays zero;
* ``out``       float32 ``[max_tokens, n_read_cols]``: what reads wrote this step (a probe owns
  one column, a capture the hook's width);
* ``tok_fc``    float32 ``[max_tokens, n_fused]``: per token its coefficient of each write the
  compiled graph applies itself (``fused_writes``);
* ``conditions``: :class:`.conditions.ConditionTables` (also the latches of ``cond(latch=...)``:
  ``latch_pos [max_slots, K_latch]``, one latch per copy of each read that a write latches on,
  set by that read's entries, ``Entry.latch_k``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.read_rows import CAPTURE, COSINE, PROBE
from ..kernels.row_write import ADD, PROJ
from ..spec import DeploymentConfig, XmixSpecError, hook_width, load_op_vector, resolve_layers
from .conditions import COMPARISONS, ConditionTables

#: the hook points of a decoder layer's residual-stream body (``(hidden_states, residual)``,
#: installed by ``adapters._residual``): where the compiled graph can apply fused writes itself
RESIDUAL_HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
#: the layout's tensors that ``adapters._residual`` registers as (non-persistent) buffers of each
#: module whose hook emits fused writes (``tok_fc``, ``vectors``): graph inputs torch.compile
#: traces (stable addresses for CUDA graphs; the AOT cache rebinds them from the module), so the
#: fused writes are visible to Inductor
MODULE_BUFFERS = ("tok_fc", "vectors")
#: identity of what the lowering and the hooks put into the compiled graph, stamped into the
#: deployment (part of vLLM's config hash, hence of the torch.compile cache key): bump it with any
#: change to that
RUNTIME_ID = "vllm-xmix 0.7.3"
#: largest total of the buffers that grow with the engine's limits (see :func:`buffer_bytes`);
#: captures of many layers at ``max_num_batched_tokens`` rows are the usual way to hit it
MAX_READ_BUFFER_BYTES = 4 << 30


@dataclass
class Entry:
    """One (app, op, layer) of the deployment at its hook site."""

    app: str
    op: int
    layer: int
    hook: str
    default_scale: float
    kind: int = 0  # kernels.row_write.ADD / PROJ, kernels.read_rows.PROBE / CAPTURE
    value: float = 0.0  # clamp target; probe bias
    # reads only
    name: str = ""
    col: int = 0
    width: int = 0
    sigmoid: bool = False
    positions: str = "all"
    returned: bool = True  # False for condition reads (buffer=): their values stay on the device
    req_k: int = -1  # request-scope condition read: index into cbuf_req / req_mean
    # a read whose trigger some write latches on (cond(latch=...)): its latch (column of
    # ConditionTables.latch_pos), the trigger's comparison (0 '>', 1 '>=', 2 '<', 3 '<=') and
    # threshold; -1: none
    latch_k: int = -1
    lop: int = 0
    lthr: float = 0.0
    # conditional writes only (set by ConditionTables.build): CK_* kind, index (token set / out
    # column / request buffer), the comparison (0 '>', 1 '>=', 2 '<', 3 '<='), threshold,
    # generated-positions-only
    ckind: int = 0
    cidx: int = 0
    cop: int = 0
    cthr: float = 0.0
    cgen: bool = False

    @property
    def is_read(self) -> bool:
        return self.kind in (PROBE, CAPTURE, COSINE)


#: the app name of reserved entries until an added app takes them (not a valid app name)
RESERVE_APP = "<reserve>"


def lower_op(op, field: str, d_model: int, n_experts: int | None, width: int) -> tuple[int, np.ndarray]:
    """An op's kernel kind (``kernels.row_write.ADD`` / ``PROJ``, ``kernels.read_rows.PROBE`` /
    ``CAPTURE`` / ``COSINE``) and its row of the ``vectors`` table: float32 ``[width]``, unit
    length where the semantics uses a direction (ablate, clamp, cosine), zero-padded (router
    biases fill the first ``n_experts`` columns).

    Raises:
        XmixSpecError: a vector that does not load or fit (naming ``field``)."""
    v = load_op_vector(op, field, d_model, n_experts)
    if op.primitive == "read":
        kind = {"linear_probe": PROBE, "capture": CAPTURE, "cosine": COSINE}[op.kind]
        if kind == COSINE:
            v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)
    elif op.kind in ("add", "router_bias"):
        kind = ADD
    else:
        kind = PROJ
        v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)  # a unit direction
    if v.shape[0] < width:
        v = np.concatenate([v, np.zeros(width - v.shape[0], np.float32)])
    return kind, v


def reserved_sites(dep: DeploymentConfig, n_layers: int, hooked: set) -> list[tuple[tuple[int, str], str]]:
    """The reserved entries of ``dep.reserve`` (:class:`..spec.model.Reserve`): one
    ``((layer, hook), kind)`` per entry, in a fixed order. ``hooked``: the sites of the deployed
    apps; an int amount places that many entries at each of them and at every site a
    ``{hook: layers}`` amount names (adds only at residual-stream hooks).

    Raises:
        XmixSpecError: a layer out of range (naming ``additional_config.xmix.reserve.<kind>``)."""
    res = dep.reserve
    if res is None:
        return []
    named = []
    sites = set(hooked)
    for kind, amt in res.kinds().items():
        if isinstance(amt, dict):
            for hook, layers in amt.items():
                for L in resolve_layers(layers, n_layers, f"additional_config.xmix.reserve.{kind}.{hook}"):
                    named.append(((L, hook), kind))
                    sites.add((L, hook))
    out = list(named)
    for kind, amt in res.kinds().items():
        if isinstance(amt, int):
            for site in sorted(sites):
                if kind == "add" and site[1] not in RESIDUAL_HOOKS:
                    continue
                out.extend([(site, kind)] * amt)
    return out


def fused_id(spec: tuple) -> int:
    """A process-independent fingerprint (1 .. 2**31) of a site's fused writes ``(entry, kind,
    value, column)``: the compiled graph passes it to the op, which checks it against the
    runtime's, so a graph compiled for other fused writes (a stale compile cache) fails loudly
    instead of applying a write twice or not at all. 0 means: nothing fused."""
    return (zlib.crc32(repr(tuple((int(e), int(k), float(v), int(c)) for e, k, v, c in spec)).encode())
            & 0x7FFFFFFF) + 1 if spec else 0


class DeviceLayout:
    """Sites, entries and device tables of one deployment on one model instance (see the module
    docstring). Read-only after :meth:`build`, but for the per-step contents of ``tok_slot``,
    ``coef``, ``tok_fc`` and ``out``, and the parameters of the entries that apps changed on a
    running server take (:mod:`.updates`: rows of ``vectors``, ``values``, ``flags`` and the
    condition thresholds, written in place: the tables keep their shapes and addresses).

    ``copies[app]``: the entries of each copy of a deployed app (copy 0 the deployed one, then
    ``reserve.versions`` spares); ``pool[(layer, hook, kind)]``: reserved entries for added apps;
    ``version_entries[(app, version)]``: the entries a request of that app version runs;
    ``owner[entry]``: the ``(app, version)`` holding an entry, None for a free one.

    ``sites``: ``(layer, hook) -> site index`` (sorted); ``site_names[site]``: its
    TransformerLens name ``blocks.{L}.{hook}``; ``site_entries_host[site]`` /
    ``site_reads_host[site]``: its write / read entries; ``app_entries[app]``: the app's entries.
    """

    @classmethod
    def build(cls, deployment: DeploymentConfig, n_layers: int, d_model: int, device: torch.device,
              max_tokens: int, max_slots: int, n_experts: int | None = None, vocab_size: int = 0,
              max_model_len: int = 0) -> "DeviceLayout":
        """Lower ``deployment`` for a model of ``n_layers`` x ``d_model`` (``n_experts``: router
        width, MoE only) and an engine of ``max_tokens`` tokens per step, ``max_slots`` request
        slots and ``max_model_len``.

        Raises:
            XmixSpecError: a vector that does not load or fit, layers out of range, or buffers
            larger than :data:`MAX_READ_BUFFER_BYTES`."""
        lay = cls()
        lay.deployment, lay.n_layers, lay.d_model, lay.n_experts = deployment, n_layers, d_model, n_experts
        lay.device, lay.max_tokens, lay.max_slots = torch.device(device), max_tokens, max_slots
        lay.entries: list[Entry] = []
        width = lay.width = max(d_model, n_experts or 0)
        vecs = []
        per_site: dict[tuple[int, str], list[int]] = {}
        n_cols = 0
        n_req = 0
        buffers: dict[tuple, int] = {}  # ((app, copy), buffer) -> entry of its condition read
        latches: dict[tuple, int] = {}  # ((app, copy), read name) -> latch index (cond(latch=...))
        conds: list = []  # (write entry, (app, copy), Cond)
        reserve = deployment.reserve
        n_copies = 1 + (reserve.versions if reserve is not None else 0)
        lay.copies: dict[str, list[list[int]]] = {}  # app -> its copies' entries (copy 0: the deployed one)
        for ai, app in enumerate(deployment.apps):
            lowered = []  # per op: (kernel kind, vector padded to the table width, layers)
            for oi, op in enumerate(app.ops):
                f = f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}"
                kind, v = lower_op(op, f, d_model, n_experts, width)
                lowered.append((kind, v, resolve_layers(op.layers, n_layers, f + ".layers")))
            copies = lay.copies[app.name] = []
            latched = app.latched_reads()
            for k in range(n_copies):  # spare copies: adjacent at each site, so a version keeps the app's order
                first = len(lay.entries)
                for oi, (op, (kind, v, layers)) in enumerate(zip(app.ops, lowered)):
                    read = op.primitive == "read"
                    latch_k = -1
                    if read and op.name in latched:  # one latch for all of the read's layers
                        latch_k = latches[((app.name, k), op.name)] = len(latches)
                    for L in layers:
                        per_site.setdefault((L, op.hook), []).append(len(lay.entries))
                        if read:
                            w = hook_width(op.hook, d_model, n_experts, "read")
                            ncol = w if kind == CAPTURE else 1
                            req_k = -1
                            if op.buffer is not None:
                                buffers[((app.name, k), op.buffer)] = len(lay.entries)
                                if op.scope == "request":
                                    req_k = n_req
                                    n_req += 1
                            lay.entries.append(Entry(app.name, oi, L, op.hook, 1.0, kind, float(op.bias), name=op.name,
                                                     col=n_cols, width=ncol, sigmoid=op.sigmoid,
                                                     positions=op.positions, returned=op.buffer is None, req_k=req_k,
                                                     latch_k=latch_k,
                                                     lop=COMPARISONS[op.on.op] if latch_k >= 0 else 0,
                                                     lthr=float(op.on.threshold) if latch_k >= 0 else 0.0))
                            n_cols += ncol
                        else:
                            e = Entry(app.name, oi, L, op.hook, op.scale, kind, float(op.value or 0.0))
                            if op.cond is not None:
                                conds.append((len(lay.entries), (app.name, k), op.cond))
                            lay.entries.append(e)
                        vecs.append(v)
                copies.append(list(range(first, len(lay.entries))))
        # reserved entries for apps added on a running server: after every deployed entry of a site
        lay.pool: dict[tuple[int, str, str], list[int]] = {}
        for (L, hook), kind in reserved_sites(deployment, n_layers, set(per_site)):
            per_site.setdefault((L, hook), []).append(len(lay.entries))
            lay.pool.setdefault((L, hook, kind), []).append(len(lay.entries))
            if kind == "add":
                lay.entries.append(Entry(RESERVE_APP, -1, L, hook, 0.0, ADD))
            else:
                lay.entries.append(Entry(RESERVE_APP, -1, L, hook, 1.0, PROBE if kind == "linear_probe" else COSINE,
                                         name=kind, col=n_cols, width=1))
                n_cols += 1
            vecs.append(np.zeros(width, np.float32))
        check_buffer_bytes(deployment, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len)
        lay.sites: dict[tuple[int, str], int] = {key: i for i, key in enumerate(sorted(per_site))}
        dev = lay.device
        lay.tok_slot = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
        lay.coef = torch.zeros(max_slots, max(1, len(lay.entries)), dtype=torch.float32, device=dev)
        lay.vectors = (torch.from_numpy(np.stack(vecs)) if vecs else torch.zeros(1, width, device="cpu")).to(dev)
        n = len(lay.sites)
        lay.site_entries_host, lay.site_reads_host = [None] * n, [None] * n
        lay.site_has_proj = [False] * n
        for key, sid in lay.sites.items():
            writes = [e for e in per_site[key] if not lay.entries[e].is_read]
            lay.site_entries_host[sid] = writes
            lay.site_reads_host[sid] = [e for e in per_site[key] if lay.entries[e].is_read]
            lay.site_has_proj[sid] = any(lay.entries[e].kind == PROJ for e in writes)
        lay.kinds_host = [e.kind for e in lay.entries]
        lay.values_host = [e.value for e in lay.entries]
        lay.cols_host = [e.col for e in lay.entries]
        lay.flags_host = [int(e.sigmoid) for e in lay.entries]
        lay.kinds = torch.tensor(lay.kinds_host or [0], dtype=torch.int32, device=dev)
        lay.values = torch.tensor(lay.values_host or [0.0], dtype=torch.float32, device=dev)
        lay.cols = torch.tensor(lay.cols_host or [0], dtype=torch.int32, device=dev)
        lay.flags = torch.tensor(lay.flags_host or [0], dtype=torch.int32, device=dev)
        lay.out = torch.zeros(max_tokens if n_cols else 1, max(1, n_cols), dtype=torch.float32, device=dev)
        lay.returned_mask = np.array([e.is_read and e.returned for e in lay.entries], dtype=bool)
        lay.conditions = ConditionTables.build(
            lay.entries, conds, buffers, n_req, site_writes=lay.site_entries_host, tok_slot=lay.tok_slot,
            coef=lay.coef, out=lay.out, max_tokens=max_tokens, max_slots=max_slots, vocab_size=vocab_size,
            max_model_len=max_model_len, device=dev, latches=latches, n_latches=len(latches))
        lay.site_has_cond = lay.conditions.site_has_cond
        lay._split_fused()
        lay.site_names = {sid: f"blocks.{L}.{h}" for (L, h), sid in lay.sites.items()}
        # entries by the app they were built for (graph variants: an app's copies share its
        # variant, reserved entries are one more "app", RESERVE_APP); which entries a request
        # runs is ``version_entries[(app, version)]`` (runtime.updates changes it at run time)
        lay.app_entries: dict[str, list[int]] = {}
        for e_idx, e in enumerate(lay.entries):
            lay.app_entries.setdefault(e.app, []).append(e_idx)
        lay.version_entries: dict[tuple[str, int], list[int]] = {(a, 0): c[0] for a, c in lay.copies.items()}
        lay.owner: list[tuple[str, int] | None] = [None] * len(lay.entries)
        for key, idxs in lay.version_entries.items():
            for e_idx in idxs:
                lay.owner[e_idx] = key
        # per read entry, what ReadTransport.reads_of needs, as plain Python values (no attribute
        # lookups per step)
        lay.read_info = {i: (e.positions, e.col, e.width, "probe" if e.kind in (PROBE, COSINE) else e.positions,
                             e.app, e.name, e.layer) for i, e in enumerate(lay.entries) if e.is_read}
        return lay

    def _split_fused(self) -> None:
        """Which write entries the compiled graph applies as plain torch ops (``site_fused``),
        by the deployment's ``fused_writes``: ``"none"`` (default) and ``"norm"`` (the op
        itself replaces the next norm, ``ops.hook_norm_``): nothing; ``"adds"``:
        unconditional ``add`` entries at residual-stream sites without projection writes;
        ``"all"``: also every write of a residual-stream site whose writes are all unconditional
        (adds, directional ablations, clamps; ``site_fused_spec``: ``(entry, kind, value,
        column)`` in the site's order, the column of ``tok_fc [max_tokens, n_fused]`` float32
        that holds each token's coefficient of that entry, written by the step fill). Under
        torch.compile the hook emits them as torch ops (the token's coefficients from
        ``tok_fc``, multiply-adds, for projections a row dot product) that Inductor fuses into
        the neighbouring kernels (the next residual add + RMSNorm), so they cost no launch of
        ours; the custom op then applies the rest (``site_rest_host``: conditional writes, and
        projections at sites that also have conditional writes) and the reads. Eager runs apply
        every entry in the op (``site_entries_host``), with the same semantics (adds only:
        :func:`..kernels.steer_add.steer_add_reference`; with projections: sequential,
        :func:`..kernels.row_write.row_write_reference`)."""
        n = len(self.sites)
        self.site_fused: list[tuple[int, ...]] = [()] * n
        self.site_fused_spec: list[tuple[tuple[int, int, float, int], ...]] = [()] * n
        self.site_fused_id: list[int] = [0] * n  # what a compiled graph must say it applied (ops.hook_write_)
        self.site_rest_host = list(self.site_entries_host)
        # what an op applies first, in the add kernel, before the site's other writes (eager
        # forwards at a site with fused and other writes: the fused adds, the compiled order;
        # sites with conditional writes and no projection: the unconditional adds)
        self.site_first: list[tuple[int, ...]] = [()] * n
        mode = self.deployment.fused_writes
        for (L, hook), sid in self.sites.items():
            writes = self.site_entries_host[sid] or []
            if hook not in RESIDUAL_HOOKS or mode not in ("adds", "all"):  # "norm": the op, at the norm
                continue
            if self.site_has_proj[sid]:
                if mode != "all":
                    continue  # projections do not commute: all of the site's writes or none
                fused = tuple(writes) if all(self.entries[e].ckind == 0 for e in writes) else ()
            else:
                fused = tuple(e for e in writes if self.entries[e].kind == ADD and self.entries[e].ckind == 0)
            if not fused:
                continue
            rest = [e for e in writes if e not in fused]
            self.site_fused[sid] = fused
            self.site_rest_host[sid] = rest
            # eager runs apply these first too, so both paths round the same way
            if rest:
                self.site_first[sid] = fused
        # sites with conditional writes and no projections, nothing fused: the unconditional adds
        # go first, all in the add kernel, and only the conditional writes through the row
        # kernel, in every variant (so a step with an unconditional app alone launches no row
        # kernel there, and a request's values never depend on its batch)
        for sid in range(n):
            writes = self.site_entries_host[sid] or []
            if self.site_fused[sid] or self.site_has_proj[sid] or not self.site_has_cond[sid]:
                continue
            adds = tuple(e for e in writes if self.entries[e].kind == ADD and self.entries[e].ckind == 0)
            if adds:
                self.site_first[sid] = adds
                self.site_rest_host[sid] = [e for e in writes if e not in adds]
        # each fused entry's column in the per-token coefficient table ``tok_fc`` (filled by the
        # step fill from the step's requests: a fused write reads its token's coefficient with
        # one load instead of gathering through the token's slot)
        fused_entries = sorted({e for f in self.site_fused for e in f})
        self.fused_entries = np.asarray(fused_entries, dtype=np.int64)
        col = {e: k for k, e in enumerate(fused_entries)}
        for sid, fused in enumerate(self.site_fused):
            if fused:
                self.site_fused_spec[sid] = tuple((e, self.entries[e].kind, float(self.entries[e].value), col[e])
                                                  for e in fused)
                self.site_fused_id[sid] = fused_id(self.site_fused_spec[sid])
        self.tok_fc = torch.zeros(self.max_tokens if fused_entries else 1, max(1, len(fused_entries)),
                                  dtype=torch.float32, device=self.device)

    def site_id(self, layer: int, hook: str) -> int | None:
        """The site index of (``layer``, ``hook``), None where nothing is deployed."""
        return self.sites.get((layer, hook))


def buffer_bytes(dep: DeploymentConfig, n_layers: int, d_model: int, n_experts: int | None, max_tokens: int,
                 max_slots: int, max_model_len: int) -> dict[str, int]:
    """Device memory of the deployment's per-step and per-request buffers that grow with the
    engine's limits (bytes): the read buffer (``max_tokens`` x read columns, float32), the token
    history of token conditions and the prompt values of each request-scope condition
    (``max_slots`` x ``max_model_len`` each), and with ``fused_writes`` other than ``"none"`` the
    per-token fused coefficients (``max_tokens`` x unconditional residual-stream writes, an upper
    bound; float32)."""
    cols, token_cond, req_bufs, fusible = 0, False, 0, 0
    copies = 1 + (dep.reserve.versions if dep.reserve is not None else 0)  # spare versions (Reserve)
    hooked = set()
    for ai, app in enumerate(dep.apps):
        for op in app.ops:
            layers = resolve_layers(op.layers, n_layers, f"apps.{ai}.layers")
            hooked.update((L, op.hook) for L in layers)
            nl = len(layers)
            if op.primitive == "read":
                cols += copies * nl * (hook_width(op.hook, d_model, n_experts, "read") if op.kind == "capture" else 1)
                req_bufs += copies * int(op.buffer is not None and op.scope == "request")
            elif op.cond is not None and op.cond.kind() in ("tokens", "tokens_prev"):
                token_cond = True
            elif op.cond is None and op.hook in RESIDUAL_HOOKS and dep.fused_writes in ("adds", "all"):
                fusible += nl
    cols += sum(1 for _, kind in reserved_sites(dep, n_layers, hooked) if kind != "add")  # reserved probes
    return {"read buffer": cols * max_tokens * 4,
            "token history": (max_slots * max_model_len * 4) if token_cond else 0,
            "request-scope condition values": req_bufs * max_slots * max_model_len * 4,
            "fused coefficients": fusible * max_tokens * 4}


def check_buffer_bytes(dep, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len) -> None:
    """Raises XmixSpecError if the buffers of :func:`buffer_bytes` exceed
    :data:`MAX_READ_BUFFER_BYTES` together."""
    b = buffer_bytes(dep, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len)
    total = sum(b.values())
    if total > MAX_READ_BUFFER_BYTES:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in b.items() if v)
        raise XmixSpecError(
            f"additional_config.xmix: the deployed apps need {total / 2**30:.1f} GiB of device buffers ({parts}; "
            f"read buffer = float32 columns x max_num_batched_tokens {max_tokens}, the others = "
            f"{max_slots} slots x max_model_len {max_model_len}); the limit is {MAX_READ_BUFFER_BYTES / 2**30:.0f} "
            "GiB: capture fewer layers, or lower max_num_batched_tokens / max_num_seqs / max_model_len")
