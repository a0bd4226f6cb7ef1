"""Worker-side runtime: the device buffers ("MI scheduler field"), the request registry and the
per-step fill. One :class:`XmixState` per model instance; it lives in vLLM's
``compilation_config.static_forward_context["vllm_xmix"]`` so that the custom op finds it through
the forward context (no process globals: several engines in one process stay separate).

Buffers (allocated once at model construction, never reallocated: CUDA graphs bake addresses):

* ``tok_slot``  int32 ``[max_tokens]``: per token of the current step, the slot of its request;
  0 is the null slot (no app on), so padding and app-free requests are inert.
* ``coef``      float32 ``[max_slots, n_entries]``: per slot, one coefficient per
  (app, op, layer) entry; row 0 stays zero.
* ``vectors``   float32 ``[n_entries, d_model]``: the steering vector of each entry.
* ``site_entries_host[site]``: the write entries attached at one hook site (layer, hook);
  ``site_reads_host[site]``: its read entries. A hook op applies, per run mask, the subset of
  the apps in it (``site_plan``: int32 device tensors of entry indices, built before capture).
* ``out``       float32 ``[max_tokens, n_read_cols]``: what reads wrote this step (a probe owns
  one column, a capture the hook's width); copied out after every forward that had a read on
  (``snapshot``), before the next step reuses it, and attached to the step's
  ``ModelRunnerOutput`` as ``xmix_reads`` (``attach``).

Per step (before the forward, on the forward's stream): ``tok_slot[:n]`` is uploaded from a
pinned staging ring, and coefficient rows of requests that got a slot this step. Nothing here
reads device data back, so async scheduling keeps its overlap.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from itertools import repeat
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernels import request_mean
from .kernels.cond_gate import gate_reference, note_tokens_reference, note_tokens_triton
from .kernels.read_rows import CAPTURE, COSINE, PROBE
from .kernels.row_write import ADD, PROJ
from .kernels.steer_add import HAS_TRITON
from .spec import (
    CONFIG_KEY,
    DeploymentConfig,
    XmixSpecError,
    hook_width,
    load_op_vector,
    parse_deployment,
    parse_request_apps,
    resolve_layers,
)

logger = logging.getLogger("vllm.xmix")

STATE_KEY = "vllm_xmix"
#: pinned staging buffers for the per-step uploads, used in turn: a buffer is written again only
#: after the copy that read it has run (vLLM keeps one or two steps in flight)
RING = 4
NULL_SLOT = 0
#: largest total of the buffers that grow with the engine's limits (see :func:`buffer_bytes`);
#: captures of many layers at ``max_num_batched_tokens`` rows are the usual way to hit it
MAX_READ_BUFFER_BYTES = 4 << 30


@dataclass
class Entry:
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
    # conditional writes only: CK_* kind, index (token set / out column / request buffer), the
    # comparison (0 '>', 1 '>=', 2 '<', 3 '<='), threshold, generated-positions-only
    ckind: int = 0
    cidx: int = 0
    cop: int = 0
    cthr: float = 0.0
    cgen: bool = False

    @property
    def is_read(self) -> bool:
        return self.kind in (PROBE, CAPTURE, COSINE)


_MAX_PLANS = 16384  # cached site plans of uncaptured run masks, before they are dropped


@dataclass(frozen=True)
class _SitePlan:
    """What a hook op applies at one site under one run mask (``XmixState.site_plan``): entry
    indices as int32 device tensors (None: none) and host lists."""

    pre: torch.Tensor | None  # eager forward at a site with fused adds and other writes: those adds, first
    writes: torch.Tensor | None
    writes_host: list[int]
    row: bool  # the site's writes need the one-program-per-token kernel (projections or conditions at the site)
    has_cond: bool  # some of ``writes`` are conditional (their gate is evaluated)
    reads: torch.Tensor | None
    reads_host: list[int]
    req_reads: list[int]  # request-scope condition reads among ``reads``


CK_NONE, CK_TOKENS, CK_TOKENS_PREV, CK_BUF_TOKEN, CK_BUF_REQUEST = 0, 1, 2, 3, 4
_OPS = {">": 0, ">=": 1, "<": 2, "<=": 3}


@dataclass
class _Stage:
    tok: torch.Tensor
    rows: torch.Tensor
    idx: torch.Tensor
    pos: torch.Tensor
    plen: torch.Tensor
    fc: torch.Tensor  # [max_tokens, n_fused] float32: the step's per-token fused coefficients
    event: object | None = None
    keep: list = field(default_factory=list)  # pinned sources of in-flight copies


def graph_variant_settings() -> tuple[str, int]:
    """(mode, most variants) from ``VLLM_XMIX_GRAPH_VARIANTS`` (``apps``, the default, or ``1``;
    ``onoff``; ``0``) and ``VLLM_XMIX_MAX_GRAPH_VARIANTS`` (an integer >= 2, 8 by default); see
    :meth:`XmixState.graph_variants`.

    Raises:
        ValueError: a value other than these, naming the variable."""
    mode = os.environ.get("VLLM_XMIX_GRAPH_VARIANTS", "apps")
    if mode not in ("0", "1", "apps", "onoff"):
        raise ValueError(f"VLLM_XMIX_GRAPH_VARIANTS={mode!r}: expected 'apps' (the default), 'onoff' or '0'")
    raw = os.environ.get("VLLM_XMIX_MAX_GRAPH_VARIANTS", "8")
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 2:
        raise ValueError(f"VLLM_XMIX_MAX_GRAPH_VARIANTS={raw!r}: expected an integer >= 2 (app-free and "
                         "every-site graphs are always captured; 8 by default)")
    return ("apps" if mode == "1" else mode), int(raw)


def fused_id(spec: tuple) -> int:
    """A process-independent fingerprint (1 .. 2**31) of a site's fused writes ``(entry, kind,
    value, column)``: the compiled graph passes it to the op, which checks it against the runtime's, so a
    graph compiled for other fused writes (a stale compile cache) fails loudly instead of applying
    a write twice or not at all. 0 means: nothing fused."""
    import zlib

    return (zlib.crc32(repr(tuple((int(e), int(k), float(v), int(c)) for e, k, v, c in spec)).encode())
            & 0x7FFFFFFF) + 1 if spec else 0


@dataclass
class XmixState:
    """Per-model-instance MI runtime state. See the module docstring for the buffers."""

    deployment: DeploymentConfig
    n_layers: int
    d_model: int
    device: torch.device
    max_tokens: int
    max_slots: int
    entries: list[Entry] = field(default_factory=list)
    sites: dict[tuple[int, str], int] = field(default_factory=dict)
    installed: set[int] = field(default_factory=set)
    calls: list[int] = field(default_factory=list)

    # ---------------------------------------------------------------- construction
    @classmethod
    def build(cls, deployment: DeploymentConfig, n_layers: int, d_model: int, device: torch.device,
              max_tokens: int, max_slots: int, n_experts: int | None = None, vocab_size: int = 0,
              max_model_len: int = 0) -> "XmixState":
        st = cls(deployment, n_layers, d_model, torch.device(device), max_tokens, max_slots)
        width = max(d_model, n_experts or 0)
        vecs = []
        per_site: dict[tuple[int, str], list[int]] = {}
        n_cols = 0
        n_req = 0
        buffers: dict[tuple[str, str], int] = {}  # (app, buffer) -> entry of its condition read
        conds: list = []  # (write entry, app, Cond)
        for ai, app in enumerate(deployment.apps):
            for oi, op in enumerate(app.ops):
                f = f"additional_config.xmix.apps.{ai}({app.name}).ops.{oi}"
                v = load_op_vector(op, f, d_model, n_experts)
                if v.shape[0] < width:  # router biases live in the first n_experts columns
                    v = np.concatenate([v, np.zeros(width - v.shape[0], np.float32)])
                read = op.primitive == "read"
                if read:
                    kind = {"linear_probe": PROBE, "capture": CAPTURE, "cosine": COSINE}[op.kind]
                    if kind == COSINE:
                        v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)
                elif op.kind in ("add", "router_bias"):
                    kind = ADD
                else:
                    kind = PROJ
                    v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)  # a unit direction
                for L in resolve_layers(op.layers, n_layers, f + ".layers"):
                    per_site.setdefault((L, op.hook), []).append(len(st.entries))
                    if read:
                        w = hook_width(op.hook, d_model, n_experts, f)
                        ncol = w if kind == CAPTURE else 1
                        req_k = -1
                        if op.buffer is not None:
                            buffers[(app.name, op.buffer)] = len(st.entries)
                            if op.scope == "request":
                                req_k = n_req
                                n_req += 1
                        st.entries.append(Entry(app.name, oi, L, op.hook, 1.0, kind, float(op.bias), name=op.name,
                                                col=n_cols, width=ncol, sigmoid=op.sigmoid,
                                                positions=op.positions, returned=op.buffer is None, req_k=req_k))
                        n_cols += ncol
                    else:
                        e = Entry(app.name, oi, L, op.hook, op.scale, kind, float(op.value or 0.0))
                        if op.cond is not None:
                            conds.append((len(st.entries), app.name, op.cond))
                        st.entries.append(e)
                    vecs.append(v)
        check_buffer_bytes(deployment, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len)
        for key in sorted(per_site):
            st.sites[key] = len(st.sites)
        dev = st.device
        st.tok_slot = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
        st.coef = torch.zeros(max_slots, max(1, len(st.entries)), dtype=torch.float32, device=dev)
        st.vectors = (torch.from_numpy(np.stack(vecs)) if vecs else torch.zeros(1, width, device="cpu")).to(dev)
        n = len(st.sites)
        st.site_entries_host, st.site_reads_host = [None] * n, [None] * n
        st.site_has_proj = [False] * n
        for key, sid in st.sites.items():
            writes = [e for e in per_site[key] if not st.entries[e].is_read]
            reads = [e for e in per_site[key] if st.entries[e].is_read]
            st.site_entries_host[sid] = writes
            st.site_reads_host[sid] = reads
            st.site_has_proj[sid] = any(st.entries[e].kind == PROJ for e in writes)
        st.site_has_cond = [False] * n
        st.kinds_host = [e.kind for e in st.entries]
        st.values_host = [e.value for e in st.entries]
        st.cols_host = [e.col for e in st.entries]
        st.flags_host = [int(e.sigmoid) for e in st.entries]
        st.kinds = torch.tensor(st.kinds_host or [0], dtype=torch.int32, device=dev)
        st.values = torch.tensor(st.values_host or [0.0], dtype=torch.float32, device=dev)
        st.cols = torch.tensor(st.cols_host or [0], dtype=torch.int32, device=dev)
        st.flags = torch.tensor(st.flags_host or [0], dtype=torch.int32, device=dev)
        st.out = torch.zeros(max_tokens if n_cols else 1, max(1, n_cols), dtype=torch.float32, device=dev)
        st.returned_mask = np.array([e.is_read and e.returned for e in st.entries], dtype=bool)
        st._build_conditions(conds, buffers, n_req, vocab_size, max_model_len)
        st._split_fused()
        st.site_names = {sid: f"blocks.{L}.{h}" for (L, h), sid in st.sites.items()}
        st.calls = [0] * len(st.sites)
        st._app_entries = {}
        for e_idx, e in enumerate(st.entries):
            st._app_entries.setdefault(e.app, []).append(e_idx)
        # request registry
        st.req_rows: dict[str, np.ndarray] = {}
        st.req_slot: dict[str, int] = {}
        st.free_slots = list(range(max_slots - 1, 0, -1))
        st.pending_rows: list[tuple[int, np.ndarray]] = []
        st.high_water = 0
        st.forwards = 0
        # reads: per request the read entries on and the prompt length; per step the rows to copy
        st.req_reads: dict[str, tuple[tuple, int]] = {}  # (read entries' _read_info, prompt length)
        # per read entry, what reads_of needs, as plain Python values (no attribute lookups per step)
        st._read_info = {i: (e.positions, e.col, e.width, "probe" if e.kind in (PROBE, COSINE) else e.positions,
                             e.app, e.name, e.layer) for i, e in enumerate(st.entries) if e.is_read}
        st._step_pos: dict[str, int] = {}
        st._step_reads: list[tuple] = []  # (req_id, first row, n rows, first position, read entries, P)
        st._snapshots: list = []
        st.verified = False
        st.buffer_modules: list = []  # modules holding the runtime's buffers (adapters._residual)
        # graph variants (see `_set_variant` / `capture_variant` / `graph_variants`): each hook op
        # runs in a step only if its site's bit is in `run_mask`; CUDA graphs are captured once
        # per variant (app-free, one per deployed app, every site)
        st._build_variant_bits()
        mode, st.max_variants = graph_variant_settings()
        st.variants_enabled = mode != "0" and os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") != "1"
        st.variant_mode = mode
        st.run_mask = st.all_mask
        st.capturing_variants = False
        st.variant_steps = Counter()
        st._variants = None
        st.captured_masks = []
        st.fused_mode = None
        st._row_masks = {}
        st._need = None
        st._cover = {}
        pin = dev.type == "cuda"
        st._ring = [
            _Stage(
                tok=torch.zeros(max_tokens, dtype=torch.int32, device="cpu", pin_memory=pin),
                rows=torch.zeros(max_slots, st.coef.shape[1], dtype=torch.float32, device="cpu", pin_memory=pin),
                idx=torch.zeros(max_slots, dtype=torch.int64, device="cpu", pin_memory=pin),
                pos=torch.zeros(max_tokens, dtype=torch.int32, device="cpu", pin_memory=pin),
                plen=torch.zeros(max_slots, dtype=torch.int32, device="cpu", pin_memory=pin),
                fc=torch.zeros(st.tok_fc.shape, dtype=torch.float32, device="cpu", pin_memory=pin),
            )
            for _ in range(RING)
        ]
        st.stage_waits = 0  # times fill() had to wait for an earlier step's upload (see _next_stage)
        st.preempted: dict[str, None] = {}  # preempted requests keep their slot (and its state)
        st.req_plen: dict[str, int] = {}
        st.req_prompt: dict[str, list[int]] = {}
        st._ring_pos = 0
        return st

    def _split_fused(self) -> None:
        """Which write entries the compiled graph applies as plain torch ops (``site_fused``),
        by the deployment's ``fused_writes``: ``"none"`` (default): nothing; ``"adds"``:
        unconditional ``add`` entries at residual-stream sites without projection writes;
        ``"all"``: also every write of a residual-stream site whose writes are all unconditional
        (adds, directional ablations, clamps; ``site_fused_spec``: ``(entry, kind, value,
        column)`` in the site's order, the column of ``tok_fc [max_tokens, n_fused]`` float32
        that holds each token's coefficient of that entry, written by :meth:`fill`). Under
        torch.compile the hook emits them as torch ops (the token's coefficients from
        ``tok_fc``, multiply-adds, for projections a row dot product) that Inductor fuses into
        the neighbouring kernels (the next residual add + RMSNorm), so they cost no launch of
        ours; the custom op then applies the rest (``site_rest_host``: conditional writes, and
        projections at sites that also have conditional writes) and the reads. Eager runs apply
        every entry in the op (``site_entries_host``), with the same semantics (adds only:
        :func:`.kernels.steer_add.steer_add_reference`; with projections: sequential,
        :func:`.kernels.row_write.row_write_reference`)."""
        from .adapters._residual import RESIDUAL_HOOKS

        n = len(self.sites)
        self.site_fused: list[tuple[int, ...]] = [()] * n
        self.site_fused_spec: list[tuple[tuple[int, int, float, int], ...]] = [()] * n
        self.site_fused_id: list[int] = [0] * n  # what a compiled graph must say it applied (ops.hook_write_)
        self.site_rest_host = list(self.site_entries_host)
        self.site_fused_first = [False] * n  # sites with fused and other writes (eager: the fused adds first)
        mode = self.deployment.fused_writes
        for (L, hook), sid in self.sites.items():
            writes = self.site_entries_host[sid] or []
            if hook not in RESIDUAL_HOOKS or mode == "none":
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
            self.site_fused_first[sid] = bool(rest)
        # each fused entry's column in the per-token coefficient table ``tok_fc`` (filled by
        # ``fill`` from the step's requests: a fused write reads its token's coefficient with one
        # load instead of gathering through the token's slot)
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
        self.req_fc: dict[str, np.ndarray] = {}
        self._fc_zero = np.zeros(len(fused_entries), dtype=np.float32)

    def _build_conditions(self, conds, buffers, n_req: int, vocab_size: int, max_model_len: int) -> None:
        """Device state of conditional writes (issue 4): token sets as vocabulary bitmaps,
        per-token positions, per-slot prompt lengths; for token conditions the per-slot token
        history (``hist [S, max_model_len]``: the previous token of a chunk's first position may
        come from an earlier step); for request-scope conditions the condition read's value at
        every prompt position (``cbuf_req [K, S, max_model_len]``) and the per-slot mean."""
        dev = self.device
        self.has_cond = bool(conds)
        self.n_req_bufs = n_req
        self.tok_pos = torch.zeros(self.max_tokens, dtype=torch.int32, device=dev)
        self.slot_plen = torch.zeros(self.max_slots, dtype=torch.int32, device=dev)
        sets: list[list[int]] = []
        self.cond_entries: list[int] = []
        for e_idx, app, c in conds:
            e = self.entries[e_idx]
            if c.tokens is not None or c.tokens_prev is not None:
                ids = c.tokens if c.tokens is not None else c.tokens_prev
                e.ckind = CK_TOKENS if c.tokens is not None else CK_TOKENS_PREV
                e.cidx = len(sets)
                sets.append(ids)
            else:
                src = self.entries[buffers[(app, c.buffer)]]
                if src.req_k >= 0:
                    e.ckind, e.cidx = CK_BUF_REQUEST, src.req_k
                else:
                    e.ckind, e.cidx = CK_BUF_TOKEN, src.col
                e.cop, e.cthr = _OPS[c.op or ">"], float(c.threshold)
            e.cgen = c.positions == "generated"
            self.cond_entries.append(e_idx)
        self.has_token_cond = bool(sets)
        L = max(1, max_model_len)
        if sets:
            bm = torch.zeros(len(sets), vocab_size, dtype=torch.int8)  # ids < vocab: checked by validate_deployment
            for i, ids in enumerate(sets):
                bm[i, ids] = 1
            self.bitmaps = bm.to(dev)
            self.hist = torch.zeros(self.max_slots, L, dtype=torch.int32, device=dev)
            self.tok_cur = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
            self.tok_prev = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=dev)
        self.token_hook_calls = 0
        self.token_hook_installed = False
        if n_req:
            self.cbuf_req = torch.zeros(n_req, self.max_slots, L, dtype=torch.float32, device=dev)
            self.req_mean = torch.zeros(self.max_slots, n_req, dtype=torch.float32, device=dev)
        cond_set = set(self.cond_entries)
        for key, sid in self.sites.items():
            self.site_has_cond[sid] = any(e in cond_set for e in self.site_entries_host[sid])
        # per-entry condition parameters, host lists (reference) and device tensors (kernel)
        self.cond_host = [(e.ckind, e.cidx, e.cop, int(e.cgen), e.cthr) for e in self.entries]
        zero_i = torch.zeros(1, dtype=torch.int64, device=dev)
        self.cond_args = dict(
            cond_i=torch.tensor([[c[0], c[1], c[2], c[3]] for c in self.cond_host] or [[0, 0, 0, 0]],
                                dtype=torch.int32, device=dev),
            cond_thr=torch.tensor([c[4] for c in self.cond_host] or [0.0], dtype=torch.float32, device=dev),
            tok_pos=self.tok_pos, slot_plen=self.slot_plen,
            tok_cur=getattr(self, "tok_cur", zero_i), tok_prev=getattr(self, "tok_prev", zero_i),
            bitmaps=getattr(self, "bitmaps", torch.zeros(1, 1, dtype=torch.int8, device=dev)), out=self.out,
            req_mean=getattr(self, "req_mean", torch.zeros(1, 1, dtype=torch.float32, device=dev)),
        )

    def gate(self, site: int, T: int, entries: list[int] | None = None) -> torch.Tensor:
        """``[T, len(entries)]`` float32 (default entries: the site's writes): 1 where an entry's
        condition holds for the token (unconditional entries: 1):
        :func:`.kernels.cond_gate.gate_reference` (the CPU path; on CUDA the row kernel evaluates
        the same gate inline)."""
        a = self.cond_args
        entries = self.site_entries_host[site] if entries is None else entries
        return gate_reference(T, entries, self.cond_host, self.tok_slot, self.tok_pos,
                              self.slot_plen, a["tok_cur"], a["tok_prev"], a["bitmaps"], self.out, a["req_mean"])

    def store_request_values(self, entries: list[int], T: int) -> None:
        """After a site's reads: for its request-scope condition reads ``entries`` (entry
        indices, ``_SitePlan.req_reads``) keep the values by (slot, position) for prompt
        positions, then the mean over the prompt for requests whose last prompt token is in this
        step (``kernels/request_mean.py``)."""
        cuda = self.device.type == "cuda" and HAS_TRITON
        store = request_mean.store_values_triton if cuda else request_mean.store_values_reference
        mean = request_mean.request_mean_triton if cuda else request_mean.request_mean_reference
        for e_idx in entries:
            e = self.entries[e_idx]
            vals = self.cbuf_req[e.req_k]
            store(vals, self.out, e.col, self.tok_slot, self.tok_pos, self.slot_plen, self.coef, e_idx, T)
            mean(vals, self.tok_slot, self.tok_pos, self.slot_plen, self.req_mean, e.req_k, T)

    def note_tokens(self, input_ids: torch.Tensor) -> None:
        """At the embedding: this step's token ids, and each token's previous token (from the same
        step, or the slot's history for a chunk's first token): ``kernels/cond_gate.py``."""
        impl = note_tokens_triton if input_ids.is_cuda and HAS_TRITON else note_tokens_reference
        impl(input_ids, self.tok_slot, self.tok_pos, self.hist, self.tok_cur, self.tok_prev)

    def site_id(self, layer: int, hook: str) -> int | None:
        return self.sites.get((layer, hook))

    # ---------------------------------------------------------------- requests
    def request_row(self, extra_args: dict | None) -> np.ndarray | None:
        """Coefficient row ``[n_entries]`` float32 for a request, or None if no app is on."""
        if not extra_args or CONFIG_KEY not in extra_args:
            return None
        apps = parse_request_apps(extra_args[CONFIG_KEY], field="extra_args.xmix")
        if not apps:
            return None
        row = np.zeros(self.coef.shape[1], dtype=np.float32)
        for ra in apps:
            if ra.name not in self._app_entries:
                raise XmixSpecError(f"extra_args.xmix: unknown app {ra.name!r}")
            layers = set(ra.layers) if ra.layers is not None else None
            for e_idx in self._app_entries[ra.name]:
                e = self.entries[e_idx]
                if layers is not None and e.layer not in layers and e.returned:
                    continue  # (condition reads stay on: the app's conditional writes need them)
                if e.is_read:  # a read's coefficient is its on/off gate (scale 0 = app off)
                    row[e_idx] = 0.0 if ra.scale == 0 else 1.0
                else:
                    row[e_idx] = e.default_scale if ra.scale is None else ra.scale
        return row if row.any() else None

    def update_requests(self, scheduler_output) -> None:
        """Registry update from a SchedulerOutput (called before the runner's own update)."""
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():  # finished or aborted
            self._forget(rid)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid in self.req_slot:  # keep the row and the slot (its device state): the request comes back
                self.preempted[rid] = None
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            sp = getattr(nr, "sampling_params", None)
            row = self.request_row(sp.extra_args if sp is not None else None)
            self._forget(nr.req_id)
            if row is not None:
                self.req_rows[nr.req_id] = row
                if self.fused_entries.size:
                    self.req_fc[nr.req_id] = row[self.fused_entries]
                self._row_masks[nr.req_id] = self._row_bits(row)
                self._need = None
                P = len(nr.prompt_token_ids) if nr.prompt_token_ids is not None else len(nr.prompt_embeds)
                self.req_plen[nr.req_id] = P
                if self.has_token_cond and nr.prompt_token_ids is not None:
                    self.req_prompt[nr.req_id] = list(nr.prompt_token_ids)
                reads = np.flatnonzero(self.returned_mask & (row != 0))
                if reads.size:
                    self.req_reads[nr.req_id] = (tuple(self._read_info[e] for e in reads.tolist()), P)
        # absolute position of the first scheduled token of each request with apps (alignment of
        # reads and conditions: chunked prefill, recompute and async scheduling come through here)
        self._step_pos = {}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if self.preempted and cached is not None:  # scheduled again: no longer a victim for its slot
            for rid in cached.req_ids:
                self.preempted.pop(rid, None)
        track = self.req_reads if not self.has_cond else self.req_rows
        if track:
            for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                if nr.req_id in track:
                    self._step_pos[nr.req_id] = int(nr.num_computed_tokens)
            if cached is not None:
                for rid, nct in zip(cached.req_ids, cached.num_computed_tokens):
                    if rid in track:
                        self._step_pos[rid] = int(nct)

    def _forget(self, rid: str) -> None:
        self.req_rows.pop(rid, None)
        self.req_fc.pop(rid, None)
        if self._row_masks.pop(rid, None) is not None:
            self._need = None
        self.req_reads.pop(rid, None)
        self.req_plen.pop(rid, None)
        self.req_prompt.pop(rid, None)
        self.preempted.pop(rid, None)
        self._free(rid)

    def _free(self, rid: str) -> None:
        s = self.req_slot.pop(rid, None)
        if s is not None:
            self.free_slots.append(s)

    def _slot_for(self, rid: str) -> int:
        row = self.req_rows.get(rid)
        if row is None:
            return NULL_SLOT
        s = self.req_slot.get(rid)
        if s is None:
            if not self.free_slots and self.preempted:
                victim = next(iter(self.preempted))  # the longest-preempted request gives its slot
                logger.warning("vllm_xmix: out of request slots; request %s (preempted) loses its slot and "
                               "its condition state (token history, prompt values)", victim)
                self.preempted.pop(victim)
                self._free(victim)
            if not self.free_slots:
                raise RuntimeError(
                    f"vllm_xmix: out of request slots ({self.max_slots - 1}); more requests with apps "
                    "are running than max_num_seqs allows"
                )
            s = self.free_slots.pop()
            self.req_slot[rid] = s
            self.pending_rows.append((s, row, self.req_plen.get(rid, 0), self.req_prompt.get(rid)))
        return s

    # ---------------------------------------------------------------- per step
    def fill(self, req_ids, num_scheduled_tokens: np.ndarray, n_padded: int | None = None) -> None:
        """Write ``tok_slot`` for this step's tokens (batch order) and upload new slot rows.

        ``req_ids``: batch-ordered request ids; ``num_scheduled_tokens``: int array, same order.
        ``n_padded``: the padded token count when known (V2), else padding relies on the
        invariant that ``tok_slot`` is zero beyond the last written non-null token.
        """
        self.forwards += 1
        if not self.req_rows and self.high_water == 0 and not self.pending_rows:
            self._set_variant(0)
            return  # fast path: no app on anywhere; tok_slot is all null already
        n_req = len(num_scheduled_tokens)
        ids = req_ids[:n_req]
        # per-request Python kept off the common path (every request with a row already has a slot)
        slots = np.fromiter(map(self.req_slot.get, ids, repeat(NULL_SLOT)), dtype=np.int32, count=n_req)
        # slots exist only for requests with a row (req_slot keys are a subset of req_rows keys)
        if len(self.req_slot) < len(self.req_rows):  # some request with apps on has no slot yet
            for i in np.flatnonzero(slots == NULL_SLOT).tolist():
                slots[i] = self._slot_for(ids[i])
        T = int(num_scheduled_tokens.sum())
        n_on = int(np.count_nonzero(slots))
        if not n_on:
            self._set_variant(0)
        elif n_on == len(self._row_masks):  # every registered request is in this step: the cached union
            self._set_variant(self._variant_for(self.need_mask()))
        else:  # some are not (waiting for a chunk, preempted): what this step's requests need
            k = 1 if self.fused_mode else 0
            need = 0
            for i in np.flatnonzero(slots).tolist():
                need |= self._row_masks.get(ids[i], (self.all_mask, self.all_mask))[k]
            self._set_variant(self._variant_for(need))
        any_on = n_on > 0
        if not any_on and self.high_water == 0 and not self.pending_rows:
            return
        n = max(T, self.high_water)
        if n_padded is not None:
            n = max(n, min(n_padded, self.max_tokens))
        if T > self.max_tokens:
            raise RuntimeError(f"vllm_xmix: {T} tokens in a step > buffer size {self.max_tokens}")
        stage = self._next_stage()
        tok = stage.tok.numpy()
        tok[:T] = np.repeat(slots, num_scheduled_tokens[:n_req])
        tok[T:n] = NULL_SLOT
        self.tok_slot[:n].copy_(stage.tok[:n], non_blocking=True)
        # written whenever fused entries exist, whatever fused_mode says: the first op call decides
        # fused_mode, and a compiled graph may still run after an eager forward came first
        if self.fused_entries.size:
            fc = stage.fc.numpy()
            if any_on:
                fc[:T] = np.repeat(np.stack(list(map(self.req_fc.get, ids, repeat(self._fc_zero)))),
                                   num_scheduled_tokens[:n_req], axis=0)
            else:
                fc[:T] = 0.0
            fc[T:n] = 0.0
            self.tok_fc[:n].copy_(stage.fc[:n], non_blocking=True)
        row0 = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:n_req])[:-1]])  # first row of each request
        if self.has_cond:  # absolute position of every token (0 for app-free tokens and padding)
            starts = np.fromiter(map(self._step_pos.get, ids, repeat(0)), dtype=np.int64, count=n_req)
            pos = stage.pos.numpy()
            pos[:T] = np.repeat(starts - row0, num_scheduled_tokens[:n_req]) + np.arange(T)
            pos[:T][tok[:T] == NULL_SLOT] = 0
            pos[T:n] = 0
            self.tok_pos[:n].copy_(stage.pos[:n], non_blocking=True)
        if self.pending_rows:
            k = len(self.pending_rows)
            for i, (s, row, plen, prompt) in enumerate(self.pending_rows):
                stage.idx[i] = s
                stage.rows[i].numpy()[:] = row
                stage.plen[i] = plen
                if prompt is not None and self.has_token_cond:  # for a first chunk after a cache hit
                    src = torch.tensor(prompt[: self.hist.shape[1]], dtype=torch.int32)
                    if self.device.type == "cuda":
                        src = src.pin_memory()
                    stage.keep.append(src)
                    self.hist[s, : src.shape[0]].copy_(src, non_blocking=True)
            self.pending_rows.clear()
            rows = stage.rows[:k].to(self.device, non_blocking=True)
            idx = stage.idx[:k].to(self.device, non_blocking=True)
            self.coef.index_copy_(0, idx, rows)
            if self.has_cond:
                self.slot_plen.index_copy_(0, idx, stage.plen[:k].to(self.device, non_blocking=True))
        if stage.event is not None:
            stage.event.record()
        self.high_water = T if any_on else 0
        if self._step_pos and self.req_reads:
            self._step_reads = [(r, int(row0[i]), int(num_scheduled_tokens[i]), self._step_pos[r]) + self.req_reads[r]
                                for i, r in enumerate(req_ids[:n_req]) if r in self.req_reads and r in self._step_pos]

    # ---------------------------------------------------------------- graph variants
    def _build_variant_bits(self) -> None:
        """Per entry, the hook units it needs to run (bit ``site``: the site's op; bit
        ``n_sites``: the embedding's token bookkeeping) and its app's bit (bit ``n_sites + 1 +
        k`` for the k-th deployed app), so that a run mask also says whose entries a hook op
        applies (:meth:`site_plan`: at a site shared by several apps, a variant captured for one
        app launches that app's entries only, not the others' gates, projections and reads). In
        eager forwards every entry needs its site; in compiled ones the fused writes
        (``site_fused``) are applied by torch ops inside the graph and need nothing
        (``_bits_compiled`` 0: an app whose writes are all fused shares the app-free graphs)."""
        n = len(self.sites)
        self.tok_unit = n
        tok = 1 << n
        app_bit = {a: 1 << (n + 1 + k) for k, a in enumerate(dict.fromkeys(e.app for e in self.entries))}
        self._bits_eager, self._bits_compiled = [], []
        for e_idx, e in enumerate(self.entries):
            sid = self.sites[(e.layer, e.hook)]
            b = (1 << sid) | (tok if e.ckind in (CK_TOKENS, CK_TOKENS_PREV) else 0) | app_bit[e.app]
            self._bits_eager.append(b)
            self._bits_compiled.append(0 if e_idx in self.site_fused[sid] else b)
        self.all_mask = 0
        for b in self._bits_eager:
            self.all_mask |= b
        self._plans: dict[tuple[int, int, bool], _SitePlan] = {}
        self._plan_bits = ~((1 << n) - 1)  # what a site's plan depends on besides its own bit: token unit, apps
        self._idx_t: dict[tuple[int, ...], torch.Tensor] = {}
        self._cond_set = set(self.cond_entries)

    def _row_bits(self, row: np.ndarray) -> tuple[int, int]:
        """(eager, compiled) unit masks a coefficient row needs."""
        e = c = 0
        for i in np.flatnonzero(row).tolist():
            e |= self._bits_eager[i]
            c |= self._bits_compiled[i]
        return e, c

    def need_mask(self) -> int:
        """Hook units that the registered requests' apps need (union over requests; compiled
        semantics once a compiled forward has been seen, else eager semantics, a superset).
        :meth:`fill` uses it when every registered request is in the step, else the union over
        the step's requests."""
        if self._need is None:
            e = c = 0
            for a, b in self._row_masks.values():
                e |= a
                c |= b
            self._need = (e, c)
        return self._need[1] if self.fused_mode else self._need[0]

    def _variant_for(self, need: int) -> int:
        """The run mask of a step that needs units ``need``: without captured graphs exactly
        ``need``; with them the smallest captured variant that covers it (every site at worst)."""
        if not self.captured_masks:
            return need
        m = self._cover.get(need)
        if m is None:
            m = next((v for v in self.captured_masks if need & ~v == 0), self.all_mask)
            self._cover[need] = m
        return m

    def graph_variants(self) -> list[int]:
        """The variants (run masks) CUDA graphs are captured for, in capture order: app-free
        first, then one per deployed app that needs a hook op (``VLLM_XMIX_GRAPH_VARIANTS=apps``,
        the default; at most ``VLLM_XMIX_MAX_GRAPH_VARIANTS`` variants in all, 8 by default;
        an app's variant also runs the apps whose sites all lie within its own, so apps with the
        same sites share one and a step mixing nested apps replays the larger one's), every
        site last. ``VLLM_XMIX_GRAPH_VARIANTS=onoff``: app-free and every site only.
        Fixed at the first call (the first capture); from then on a step with apps on replays
        the smallest variant that covers the apps of its requests (:meth:`fill`)."""
        if self._variants is None:
            bits = self._bits_compiled if self.fused_mode else self._bits_eager
            masks = [0]
            if self.variant_mode == "apps":
                app_masks = []
                for idxs in self._app_entries.values():
                    m = 0
                    for i in idxs:
                        m |= bits[i]
                    app_masks.append(m)
                units = ~self._plan_bits | (1 << self.tok_unit)  # site bits and the token unit
                for m in app_masks:
                    # apps whose units all lie within this app's join its variant (their entries
                    # run in it too), so a step mixing them replays it rather than every site
                    v = m
                    for o in app_masks:
                        if o and (o & units) & ~(m & units) == 0:
                            v |= o
                    if v and v != self.all_mask and v not in masks and len(masks) < self.max_variants - 1:
                        masks.append(v)
            if self.all_mask not in masks:
                masks.append(self.all_mask)
            self._variants = masks
            self.captured_masks = sorted(masks, key=lambda m: (bin(m).count("1"), m))
            self._cover = {}
            for m in masks:  # the ops' plans of every captured variant, before any capture
                for site, fused in self._plan_keys(m):
                    self._plans.setdefault((site, m & self._plan_bits, fused), self._make_plan(site, m, fused))
            logger.info("vllm_xmix: CUDA graphs captured for %d hook variants (app-free, %d per-app, all sites)",
                        len(masks), len(masks) - 2 if len(masks) > 1 else 0)
        return self._variants

    def _set_variant(self, mask: int) -> None:
        """Which hook ops this step runs (set by :meth:`fill` before the forward): a hook op runs
        only if its site's bit is in ``mask`` (``ops.hook_write_``); CUDA-graph wrappers replay the
        graphs captured for this mask.

        With graph variants enabled (the default; ``VLLM_XMIX_GRAPH_VARIANTS=0`` turns them off) a
        step in which no token belongs to a request with an app on runs none of them, and a step
        with apps on runs the sites of those apps only (the smallest captured variant covering
        the apps of the step's requests; without CUDA graphs exactly those sites). This is vLLM's
        own device for LoRA (``cudagraph_specialize_lora``: separate graphs with and without
        adapters) applied to MI hooks; cost: every CUDA graph is captured once per variant
        (:meth:`graph_variants`). Without variants every step runs every site.
        """
        if not self.variants_enabled:
            mask = self.all_mask
        self.run_mask = mask
        self.variant_steps[mask] += 1

    @property
    def active(self) -> bool:
        """Whether any hook op runs in this step (the run mask is not empty)."""
        return self.run_mask != 0

    def runs(self, site: int, fused: int) -> bool:
        """Whether the hook op of ``site`` runs in this forward (``fused``: nonzero when the call
        comes from a compiled graph that applied the site's fused writes itself: their
        :func:`fused_id`, which must be the runtime's).

        Raises:
            RuntimeError: the graph applied other fused writes than this runtime's (a stale
            compile cache, or a plugin change without a new ``RUNTIME_ID``)."""
        return bool(self._op_mask(site, fused))

    def _op_mask(self, site: int, fused: int) -> int:
        """The run mask the hook op of ``site`` applies in this forward, 0 if it does not run
        (errors: :meth:`runs`)."""
        if fused and fused != self.site_fused_id[site]:
            raise RuntimeError(
                f"vllm_xmix: the compiled graph applies other fused writes at {self.site_names[site]} "
                f"(id {fused}) than this deployment ({self.site_fused_id[site]}): a stale torch.compile "
                "cache; clear it (VLLM_CACHE_ROOT) or set VLLM_DISABLE_COMPILE_CACHE=1")
        fused = bool(fused)
        mask = self.run_mask
        if self.site_fused[site]:
            if self.fused_mode is None:  # the first call that tells: compiled (True) or eager
                self.fused_mode = fused
                self._cover = {}
            elif self.fused_mode and not fused:
                # an eager forward in a compiled engine: the site's unconditional adds are this
                # op's to apply, so it runs wherever a registered request needs any of its entries
                self.need_mask()
                mask |= self._need[0]
        return mask if (mask >> site) & 1 else 0

    def site_plan(self, site: int, fused: int) -> "_SitePlan | None":
        """What the hook op of ``site`` applies in this forward (None: it does not run): the
        site's entries whose app and units are in the run mask (:meth:`_build_variant_bits`).
        Entries left out have coefficient 0 for every token of the step (the mask covers every
        entry a request of the step has on), so leaving them out changes no value; it changes
        which entries' vectors are loaded, which gates evaluated and which reads computed; the
        kernel stays the site's (``_SitePlan.row``). ``fused``: as in :meth:`runs`.

        Raises:
            RuntimeError: a stale compile cache (see :meth:`runs`); a plan first needed while a
            CUDA graph is being captured (plans of captured variants are built before capture
            by :meth:`graph_variants`)."""
        mask = self._op_mask(site, fused)
        if not mask:
            return None
        key = (site, mask & self._plan_bits, bool(fused))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:  # eager engines: masks follow the requests' layer subsets
                keep = {m & self._plan_bits for m in self.captured_masks}
                self._plans = {k: v for k, v in self._plans.items() if k[1] in keep}
            plan = self._plans[key] = self._make_plan(site, mask, bool(fused))
        return plan

    def _plan_keys(self, mask: int):
        """(site, fused) of every plan an op can ask for under ``mask``."""
        for site in range(len(self.sites)):
            if (mask >> site) & 1:
                yield site, False
                if self.site_fused[site]:
                    yield site, True

    def _make_plan(self, site: int, mask: int, fused: bool) -> "_SitePlan":
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"vllm_xmix: no hook plan for {self.site_names[site]} under variant {mask:#x} "
                               "was built before CUDA-graph capture")
        keep = [(b & ~mask) == 0 for b in self._bits_eager]  # the entry's units and app are in the mask
        pre: list[int] = []
        if fused:  # the compiled graph applied the site's fused writes
            writes = self.site_rest_host[site] or []
        elif self.site_fused_first[site]:  # eager, mixed site: the compiled order (those adds first)
            pre = [e for e in self.site_fused[site] if keep[e]]
            writes = self.site_rest_host[site] or []
        else:
            writes = self.site_entries_host[site] or []
        writes = [e for e in writes if keep[e]]
        reads = [e for e in (self.site_reads_host[site] or []) if keep[e]]
        return _SitePlan(
            pre=self._idx(pre), writes=self._idx(writes), writes_host=writes,
            # the kernel is the site's, whatever the variant: the row kernel rounds to the dtype
            # after each entry, the add kernel once, so choosing by variant would make a request's
            # values depend on which other apps share its batch
            row=self.site_has_proj[site] or self.site_has_cond[site],
            has_cond=any(e in self._cond_set for e in writes),
            reads=self._idx(reads), reads_host=reads, req_reads=[e for e in reads if self.entries[e].req_k >= 0])

    def _idx(self, entries: list[int]) -> torch.Tensor | None:
        """Entry indices as an int32 device tensor (one per distinct list), None for none."""
        if not entries:
            return None
        t = self._idx_t.get(tuple(entries))
        if t is None:
            t = self._idx_t[tuple(entries)] = torch.tensor(entries, dtype=torch.int32, device=self.device)
        return t

    def dummy_forward(self) -> None:
        """Before a forward that does not go through :meth:`fill` (vLLM's dummy runs: profiling,
        warm-up, idle data-parallel ranks): no token belongs to any request, so the step's slot
        table is cleared (a dummy token must not write into a live request's slot) and, outside a
        variant capture, the step runs without the hook ops."""
        if self.high_water:
            self.tok_slot[: self.high_water].zero_()
            if self.fused_entries.size:
                self.tok_fc[: self.high_water].zero_()
            self.high_water = 0
        if not self.capturing_variants:
            self._set_variant(0)

    @contextlib.contextmanager
    def capture_variant(self, mask: int):
        """During CUDA-graph capture: capture the variant that runs the hook units in ``mask``
        (one of :meth:`graph_variants`)."""
        prev = self.run_mask, self.capturing_variants
        self.run_mask, self.capturing_variants = mask, True
        try:
            yield
        finally:
            self.run_mask, self.capturing_variants = prev

    # ---------------------------------------------------------------- reads
    def snapshot(self) -> None:
        """After the forward is enqueued: copy this step's read rows out of ``out`` (which the
        next forward reuses) to host memory, asynchronously on the forward's stream."""
        if not self._step_reads:
            return
        T = max(sr[1] + sr[2] for sr in self._step_reads)
        src = self.out[:T]
        if self.device.type == "cuda":
            host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = src.clone(), None
        self._snapshots.append((host, event, self._step_reads))
        self._step_reads = []

    def pop_snapshot(self):
        """The oldest pending snapshot (FIFO: one per forward that had a read on), or None."""
        return self._snapshots.pop(0) if self._snapshots else None

    def reads_of(self, snapshot) -> dict[str, list]:
        """A snapshot as ``{req_id: [chunk, ...]}`` (waits for its device-to-host copy).

        A chunk is ``(app, name, layer, tag, pos0, n, width, float32 bytes [n, width])`` (``tag``:
        ``"probe"`` or the capture's ``positions``):
        the values of one read entry for positions ``pos0 .. pos0+n-1`` of the request, already
        restricted to the positions the read returns (captures with ``generated`` / ``last``)."""
        host, event, rows = snapshot
        if event is not None:
            event.synchronize()
        vals = host.numpy()
        out: dict[str, list] = {}
        for rid, r0, n, pos0, reads, P in rows:
            chunks = out.setdefault(rid, [])
            for positions, col, width, tag, app, name, layer in reads:  # tag "probe": one float per position
                lo, hi = pos0, pos0 + n  # positions covered this step
                if positions == "generated":
                    lo = max(lo, P - 1)
                elif positions == "last":
                    lo, hi = max(lo, P - 1), min(hi, P)
                if hi <= lo:
                    continue
                block = vals[r0 + lo - pos0: r0 + hi - pos0, col: col + width]
                chunks.append((app, name, layer, tag, lo, hi - lo, width, block.tobytes()))
        return out

    def _next_stage(self) -> _Stage:
        stage = self._ring[self._ring_pos]
        self._ring_pos = (self._ring_pos + 1) % len(self._ring)
        if self.device.type == "cuda":
            if stage.event is None:
                stage.event = torch.cuda.Event()
            elif not stage.event.query():  # the H2D copy that last read this buffer has not run yet
                # (never expected: vLLM waits for each step's output before scheduling far ahead;
                # a blocking wait here would stall the host, so it is counted)
                self.stage_waits += 1
                if self.stage_waits == 1:
                    logger.warning("vllm_xmix: a step's slot-table upload waited for the one %d steps earlier "
                                   "(the host ran that far ahead of the GPU); counted in XmixState.stage_waits",
                                   len(self._ring))
                stage.event.synchronize()
        stage.keep.clear()
        return stage

    # ---------------------------------------------------------------- checks
    def verify_hooks_fired(self) -> None:
        """Fail loudly if a deployed hook site is missing from the model or was never executed
        (e.g. a torch.compile cache traced without it)."""
        if self.verified or self.forwards == 0:
            return
        missing = [self.site_names[s] for s in range(len(self.sites)) if s not in self.installed]
        if missing:
            raise RuntimeError(
                f"vllm_xmix: deployed hook sites {missing} were not installed on the model "
                "(unsupported architecture or layer class)"
            )
        if self.has_token_cond and not self.token_hook_installed:
            raise RuntimeError("vllm_xmix: token conditions are deployed but the embedding hook is not installed "
                               "(unsupported model class)")
        from .adapters._residual import _BUFFERS

        for m in self.buffer_modules:  # a module.to()/half() after construction would have copied them
            for name in _BUFFERS:
                if getattr(m, f"xmix_{name}").data_ptr() != getattr(self, name).data_ptr():
                    raise RuntimeError(f"vllm_xmix: the buffer xmix_{name} of {type(m).__name__} is no longer the "
                                       "runtime's tensor (the model was moved or cast after construction); the "
                                       "compiled steering would read a stale copy")
        silent = [self.site_names[s] for s in range(len(self.sites)) if self.calls[s] == 0]
        if self.has_token_cond and self.token_hook_calls == 0:
            silent.append("embed_tokens (token conditions)")
        if silent:
            raise RuntimeError(
                f"vllm_xmix: hook sites {silent} never executed although the model ran: the "
                "compiled graph does not contain them (stale torch.compile cache?). Clear "
                "VLLM_CACHE_ROOT/torch_compile_cache or set VLLM_DISABLE_COMPILE_CACHE=1."
            )
        self.verified = True


def buffer_bytes(dep: DeploymentConfig, n_layers: int, d_model: int, n_experts: int | None, max_tokens: int,
                 max_slots: int, max_model_len: int) -> dict[str, int]:
    """Device memory of the deployment's per-step and per-request buffers that grow with the
    engine's limits (bytes): the read buffer (``max_tokens`` x read columns, float32), the token
    history of token conditions and the prompt values of each request-scope condition
    (``max_slots`` x ``max_model_len`` each), and with ``fused_writes`` other than ``"none"`` the
    per-token fused coefficients (``max_tokens`` x unconditional residual-stream writes, an upper
    bound; float32)."""
    from .adapters._residual import RESIDUAL_HOOKS

    cols, token_cond, req_bufs, fusible = 0, False, 0, 0
    for ai, app in enumerate(dep.apps):
        for op in app.ops:
            nl = len(resolve_layers(op.layers, n_layers, f"apps.{ai}.layers"))
            if op.primitive == "read":
                cols += nl * (hook_width(op.hook, d_model, n_experts, "read") if op.kind == "capture" else 1)
                req_bufs += int(op.buffer is not None and op.scope == "request")
            elif op.cond is not None and op.cond.buffer is None:
                token_cond = True
            elif op.cond is None and op.hook in RESIDUAL_HOOKS and dep.fused_writes != "none":
                fusible += nl
    return {"read buffer": cols * max_tokens * 4,
            "token history": (max_slots * max_model_len * 4) if token_cond else 0,
            "request-scope condition values": req_bufs * max_slots * max_model_len * 4,
            "fused coefficients": fusible * max_tokens * 4}


def check_buffer_bytes(dep, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len) -> None:
    """Raises XmixSpecError if the buffers exceed :data:`MAX_READ_BUFFER_BYTES` together."""
    b = buffer_bytes(dep, n_layers, d_model, n_experts, max_tokens, max_slots, max_model_len)
    total = sum(b.values())
    if total > MAX_READ_BUFFER_BYTES:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in b.items() if v)
        raise XmixSpecError(
            f"additional_config.xmix: the deployed apps need {total / 2**30:.1f} GiB of device buffers ({parts}; "
            f"read buffer = float32 columns x max_num_batched_tokens {max_tokens}, the others = "
            f"{max_slots} slots x max_model_len {max_model_len}); the limit is {MAX_READ_BUFFER_BYTES / 2**30:.0f} "
            "GiB: capture fewer layers, or lower max_num_batched_tokens / max_num_seqs / max_model_len")


def engine_limits(vllm_config) -> tuple[int, int, int]:
    """(max_tokens per step, request slots, max_model_len) the buffers are sized for."""
    sched = vllm_config.scheduler_config
    max_tokens = max(int(sched.max_num_batched_tokens),
                     int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
    # slots: running requests plus preempted ones that keep theirs (their condition state)
    return max_tokens, 2 * int(sched.max_num_seqs) + 1, int(vllm_config.model_config.max_model_len)


# -------------------------------------------------------------------- lookup helpers


def get_state_from_config(vllm_config) -> XmixState | None:
    return vllm_config.compilation_config.static_forward_context.get(STATE_KEY)


def get_or_create_state(vllm_config, layer: torch.nn.Module | None = None) -> XmixState | None:
    """Called at decoder-layer construction (inside vLLM's model init, in the worker).

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
    hf = vllm_config.model_config.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    max_tokens, max_slots, max_model_len = engine_limits(vllm_config)
    device = None
    if layer is not None:
        p = next(layer.parameters(), None)
        if p is not None and p.device.type != "meta":
            device = p.device
    if device is None:
        device = vllm_config.device_config.device or torch.device("cpu")
    from ._vllm_compat import _n_experts

    st = XmixState.build(dep, text.num_hidden_layers, text.hidden_size, device, max_tokens, max_slots,
                         _n_experts(text), vocab_size=int(getattr(text, "vocab_size", 0) or 0),
                         max_model_len=max_model_len)
    ctx[STATE_KEY] = st
    logger.info("vllm_xmix: %d app(s), %d hook site(s), %d entries on %s", len(dep.apps),
                len(st.sites), len(st.entries), device)
    return st
