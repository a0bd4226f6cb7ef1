"""Graph variants and site plans: which hook ops a step runs, and what each applies.

A *run mask* has one bit per hook site (the site's op runs), one for the embedding's token
bookkeeping (token conditions) and one per deployed app (whose entries a site's op applies).
CUDA graphs are captured once per *variant* (a run mask: app-free, one per deployed app, every
site); a step replays the smallest captured variant that covers the apps of its requests. This
is vLLM's own device for LoRA (``cudagraph_specialize_lora``: separate graphs with and without
adapters) applied to MI hooks. A *site plan* is what one hook op applies under one run mask: the
site's entries of the apps in the mask, as device index tensors built before capture.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from .conditions import CK_TOKENS, CK_TOKENS_PREV
from .layout import DeviceLayout

logger = logging.getLogger("vllm.xmix")

_MAX_PLANS = 16384  # cached site plans of uncaptured run masks, before they are dropped


def graph_variant_settings() -> tuple[str, int]:
    """(mode, most variants) from ``VLLM_XMIX_GRAPH_VARIANTS`` (``apps``, the default, or ``1``;
    ``onoff``; ``0``) and ``VLLM_XMIX_MAX_GRAPH_VARIANTS`` (an integer >= 2, 8 by default); see
    :meth:`GraphVariants.graph_variants`.

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


def piecewise_variant_setting() -> str:
    """``VLLM_XMIX_PIECEWISE_VARIANTS``: ``apps`` (the default: piecewise CUDA graphs are
    captured for every variant, like the FULL graphs) or ``onoff`` (piecewise graphs only for the
    app-free and the every-site variants; the FULL graphs of uniform decode batches keep one
    variant per app). With ``onoff`` a step that runs piecewise graphs (prefill or mixed
    prefill + decode) with any app on replays the every-site pieces, whose ops gate every entry
    on the device: the same values, more kernels in those steps, and per extra variant only its
    FULL graphs (a FULL graph per captured size against one per piece and size; see
    docs/design.md, graph memory).

    Raises:
        ValueError: another value, naming the variable."""
    mode = os.environ.get("VLLM_XMIX_PIECEWISE_VARIANTS", "apps")
    if mode not in ("apps", "onoff"):
        raise ValueError(f"VLLM_XMIX_PIECEWISE_VARIANTS={mode!r}: expected 'apps' (the default) or 'onoff'")
    return mode


def app_capture_size_setting() -> int | None:
    """``VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE``: the largest token count for which a per-app
    variant captures FULL CUDA graphs (None, the default: every size vLLM captures). A FULL step of
    more tokens with an app on replays the every-site variant's graph of its size, whose ops gate
    every entry on the device (the same values, more kernels), and the step fill uploads that
    variant's tables (:meth:`GraphVariants.full_variant`). Per-app variants then capture a
    fraction of their FULL graphs: a variant's capture time follows its batch sizes (one warm-up
    and one captured forward each) and its memory its graph count; with
    ``VLLM_XMIX_PIECEWISE_VARIANTS=onoff`` that is all a per-app variant captures (see
    docs/design.md, graph memory). vLLM's V2 model runner only (it knows a step's FULL graph
    size when its inputs are prepared).

    Raises:
        ValueError: a value that is not an integer >= 1, naming the variable."""
    raw = os.environ.get("VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE")
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ValueError(f"VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE={raw!r}: expected an integer >= 1 (the "
                         "largest token count of a per-app variant's FULL CUDA graphs; unset: every size)")
    return int(raw)


@dataclass(frozen=True)
class SitePlan:
    """What a hook op applies at one site under one run mask (:meth:`GraphVariants.site_plan`):
    entry indices as int32 device tensors (None: none) and host lists."""

    # applied first with the add kernel: a site's unconditional adds beside its conditional writes
    # (and, in eager forwards, fused adds beside other writes: the compiled order)
    pre: torch.Tensor | None
    writes: torch.Tensor | None
    writes_host: list[int]
    row: bool  # the site's writes need the one-program-per-token kernel (projections or conditions at the site)
    has_cond: bool  # some of ``writes`` are conditional (their gate is evaluated)
    reads: torch.Tensor | None
    reads_host: list[int]
    req_reads: list[int]  # request-scope condition reads among ``reads``
    # reads among ``reads`` that set a latch (cond(latch=...)), host list and int32 device tensor
    latch_reads: list[int]
    latch_idx: torch.Tensor | None


class GraphVariants:
    """Run masks, captured variants and site plans of one deployment (see the module docstring).

    ``run_mask``: the current step's (set by the step fill before the forward; during capture by
    :meth:`capture_variant`); ``fused_mode``: None until the first hook call of a site with fused
    writes, then whether forwards are compiled (the compiled graph applies those writes);
    ``variant_steps``: steps per run mask (a counter, for benchmarks)."""

    def __init__(self, layout: DeviceLayout) -> None:
        self.layout = layout
        self._build_bits()
        mode, self.max_variants = graph_variant_settings()
        self.variants_enabled = mode != "0" and os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") != "1"
        self.variant_mode = mode
        #: piecewise graphs only for the app-free and every-site variants (piecewise_variant_setting)
        self.piecewise_onoff = piecewise_variant_setting() == "onoff"
        #: per-app variants' largest FULL CUDA graph (app_capture_size_setting; None: every size)
        self.app_capture_size = app_capture_size_setting()
        self.run_mask = self.all_mask
        self.capturing_variants = False
        self.variant_steps: Counter = Counter()
        self._variants: list[int] | None = None
        self.captured_masks: list[int] = []
        self.fused_mode: bool | None = None
        self._row_masks: dict[str, tuple[int, int]] = {}
        self._need: tuple[int, int] | None = None
        self._cover: dict[int, int] = {}

    def _build_bits(self) -> None:
        """Per entry, the hook units it needs to run (bit ``site``: the site's op; bit
        ``n_sites``: the embedding's token bookkeeping) and its app's bit (bit ``n_sites + 1 +
        k`` for the k-th deployed app), so that a run mask also says whose entries a hook op
        applies (:meth:`site_plan`: at a site shared by several apps, a variant captured for one
        app launches that app's entries only, not the others' gates, projections and reads). In
        eager forwards every entry needs its site; in compiled ones the fused writes
        (``site_fused``) are applied by torch ops inside the graph and need nothing
        (``_bits_compiled`` 0: an app whose writes are all fused shares the app-free graphs)."""
        lay = self.layout
        n = len(lay.sites)
        self.tok_unit = n
        tok = 1 << n
        app_bit = {a: 1 << (n + 1 + k) for k, a in enumerate(dict.fromkeys(e.app for e in lay.entries))}
        self._bits_eager, self._bits_compiled = [], []
        for e_idx, e in enumerate(lay.entries):
            sid = lay.sites[(e.layer, e.hook)]
            b = (1 << sid) | (tok if e.ckind in (CK_TOKENS, CK_TOKENS_PREV) else 0) | app_bit[e.app]
            self._bits_eager.append(b)
            self._bits_compiled.append(0 if e_idx in lay.site_fused[sid] else b)
        self.all_mask = 0
        for b in self._bits_eager:
            self.all_mask |= b
        self._plans: dict[tuple[int, int, bool], SitePlan] = {}
        self._plan_bits = ~((1 << n) - 1)  # what a site's plan depends on besides its own bit: token unit, apps
        self._idx_t: dict[tuple[int, ...], torch.Tensor] = {}
        self._cond_set = set(lay.conditions.cond_entries)
        # entries whose kernels read the step's token positions (tok_pos): conditional writes,
        # request-scope and latch-setting reads; and the token unit (the token history)
        self._pos_bits = [self._bits_eager[i] for i, e in enumerate(lay.entries)
                          if i in self._cond_set or e.req_k >= 0 or e.latch_k >= 0]
        self._pos_need: dict[int, bool] = {}

    # ---------------------------------------------------------------- per-request masks
    def row_masks(self, row: np.ndarray) -> tuple[int, int]:
        """The (eager, compiled) unit masks that a coefficient row ``[n_entries]`` float32 needs."""
        e = c = 0
        for i in np.flatnonzero(row).tolist():
            e |= self._bits_eager[i]
            c |= self._bits_compiled[i]
        return e, c

    def add_request(self, rid: str, row: np.ndarray, masks: tuple[int, int] | None = None) -> None:
        """Record the (eager, compiled) unit masks that request ``rid``'s coefficient row
        ``[n_entries]`` float32 needs (``masks``: :meth:`row_masks` of it, when already known)."""
        self._row_masks[rid] = masks if masks is not None else self.row_masks(row)
        self._need = None

    def forget_request(self, rid: str) -> None:
        if self._row_masks.pop(rid, None) is not None:
            self._need = None

    @property
    def n_requests(self) -> int:
        """Registered requests with an app on."""
        return len(self._row_masks)

    def need_mask(self) -> int:
        """Hook units that the registered requests' apps need (union over requests; compiled
        semantics once a compiled forward has been seen, else eager semantics, a superset).
        The step fill uses it when every registered request is in the step, else
        :meth:`need_of`."""
        if self._need is None:
            e = c = 0
            for a, b in self._row_masks.values():
                e |= a
                c |= b
            self._need = (e, c)
        return self._need[1] if self.fused_mode else self._need[0]

    def need_of(self, rids) -> int:
        """Hook units the requests ``rids`` need (a request not registered: every unit)."""
        k = 1 if self.fused_mode else 0
        need = 0
        for rid in rids:
            need |= self._row_masks.get(rid, (self.all_mask, self.all_mask))[k]
        return need

    # ---------------------------------------------------------------- variants
    def variant_for(self, need: int) -> int:
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
        an app's variant also runs the unconditional apps whose sites all lie within its own, so
        such apps with the same sites share one and a step mixing them replays the larger one's), every
        site last. ``VLLM_XMIX_GRAPH_VARIANTS=onoff``: app-free and every site only.
        Fixed at the first call (the first capture); from then on a step with apps on replays
        the smallest variant that covers the apps of its requests (the step fill)."""
        if self._variants is None:
            bits = self._bits_compiled if self.fused_mode else self._bits_eager
            masks = [0]
            if self.variant_mode == "apps":
                app_masks, conditional = [], []
                pos_entries = {i for i, e in enumerate(self.layout.entries)
                               if i in self._cond_set or e.req_k >= 0 or e.latch_k >= 0}
                for idxs in self.layout.app_entries.values():
                    m = 0
                    for i in idxs:
                        m |= bits[i]
                    app_masks.append(m)
                    conditional.append(any(i in pos_entries for i in idxs))
                units = ~self._plan_bits | (1 << self.tok_unit)  # site bits and the token unit
                for m in app_masks:
                    # unconditional apps whose units all lie within this app's join its variant
                    # (their entries run in it too), so a step mixing them replays it rather than
                    # every site; a conditional one does not (its gates, condition reads and the
                    # positions upload would run in every step of the larger app)
                    v = m
                    for o, cond in zip(app_masks, conditional):
                        if o and (o == m or not cond) and (o & units) & ~(m & units) == 0:
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

    def set_variant(self, mask: int) -> None:
        """Which hook ops this step runs (set by the step fill before the forward): a hook op
        runs only if its site's bit is in ``mask`` (``ops.hook_write_``); CUDA-graph wrappers
        replay the graphs captured for this mask.

        With graph variants enabled (the default; ``VLLM_XMIX_GRAPH_VARIANTS=0`` turns them off) a
        step in which no token belongs to a request with an app on runs none of them, and a step
        with apps on runs the sites of those apps only (the smallest captured variant covering
        the apps of the step's requests; without CUDA graphs exactly those sites). Cost: every
        CUDA graph is captured once per variant (:meth:`graph_variants`). Without variants every
        step runs every site."""
        if not self.variants_enabled:
            mask = self.all_mask
        self.run_mask = mask
        self.variant_steps[mask] += 1

    def needs_positions(self) -> bool:
        """Whether a hook op of this step's variant reads the step's token positions
        (``ConditionState.tok_pos``): it applies a conditional write, a request-scope or
        latch-setting read, or the token bookkeeping. The step fill uploads positions only then
        (a per-step table: a later step that needs them writes all of its own)."""
        m = self.run_mask
        need = self._pos_need.get(m)
        if need is None:
            need = self._pos_need[m] = bool((m >> self.tok_unit) & 1) or any(b & ~m == 0 for b in self._pos_bits)
        return need

    def captures_pieces(self, mask: int) -> bool:
        """Whether piecewise CUDA graphs are captured for variant ``mask`` (all variants; with
        ``VLLM_XMIX_PIECEWISE_VARIANTS=onoff`` the app-free and the every-site one only)."""
        return not self.piecewise_onoff or mask == 0 or mask == self.all_mask

    def captures_full(self, mask: int, num_tokens: int) -> bool:
        """Whether the FULL CUDA graph of ``num_tokens`` tokens is captured for variant ``mask``
        (every size for the app-free and every-site variants; with
        ``VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE`` a per-app variant's up to that size)."""
        cap = self.app_capture_size
        return cap is None or num_tokens <= cap or mask == 0 or mask == self.all_mask

    def full_variant(self, mask: int, num_tokens: int | None) -> int:
        """The variant a step replays whose run mask would be ``mask``: ``mask`` itself, or the
        every-site variant where the step replays a FULL CUDA graph of ``num_tokens`` tokens
        (None: it replays none) that ``mask``'s variant did not capture (:meth:`captures_full`)."""
        if num_tokens is None or self.captures_full(mask, num_tokens):
            return mask
        return self.all_mask

    def piecewise_mask(self) -> int:
        """The variant whose piecewise graphs this step replays: the step's run mask, or with
        ``VLLM_XMIX_PIECEWISE_VARIANTS=onoff`` the every-site variant whenever any app is on."""
        m = self.run_mask
        return self.all_mask if (m and self.piecewise_onoff) else m

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

    @property
    def active(self) -> bool:
        """Whether any hook op runs in this step (the run mask is not empty)."""
        return self.run_mask != 0

    # ---------------------------------------------------------------- site plans
    def runs(self, site: int, fused: int) -> bool:
        """Whether the hook op of ``site`` runs in this forward (``fused``: nonzero when the call
        comes from a compiled graph that applied the site's fused writes itself: their
        :func:`.layout.fused_id`, which must be the runtime's).

        Raises:
            RuntimeError: the graph applied other fused writes than this runtime's (a stale
            compile cache, or a plugin change without a new ``RUNTIME_ID``)."""
        return bool(self._op_mask(site, fused))

    def _op_mask(self, site: int, fused: int) -> int:
        """The run mask the hook op of ``site`` applies in this forward, 0 if it does not run
        (errors: :meth:`runs`)."""
        lay = self.layout
        if fused and fused != lay.site_fused_id[site]:
            raise RuntimeError(
                f"vllm_xmix: the compiled graph applies other fused writes at {lay.site_names[site]} "
                f"(id {fused}) than this deployment ({lay.site_fused_id[site]}): a stale torch.compile "
                "cache; clear it (VLLM_CACHE_ROOT) or set VLLM_DISABLE_COMPILE_CACHE=1")
        fused = bool(fused)
        mask = self.run_mask
        if lay.site_fused[site]:
            if self.fused_mode is None:  # the first call that tells: compiled (True) or eager
                self.fused_mode = fused
                self._cover = {}
            elif self.fused_mode and not fused:
                # an eager forward in a compiled engine: the site's unconditional adds are this
                # op's to apply, so it runs wherever a registered request needs any of its entries
                self.need_mask()
                mask |= self._need[0]
        return mask if (mask >> site) & 1 else 0

    def site_plan(self, site: int, fused: int) -> SitePlan | None:
        """What the hook op of ``site`` applies in this forward (None: it does not run): the
        site's entries whose app and units are in the run mask (:meth:`_build_bits`).
        Entries left out have coefficient 0 for every token of the step (the mask covers every
        entry a request of the step has on), so leaving them out changes no value; it changes
        which entries' vectors are loaded, which gates evaluated and which reads computed; the
        kernel stays the site's (``SitePlan.row``). ``fused``: as in :meth:`runs`.

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
        for site in range(len(self.layout.sites)):
            if (mask >> site) & 1:
                yield site, False
                if self.layout.site_fused[site]:
                    yield site, True

    def _make_plan(self, site: int, mask: int, fused: bool) -> SitePlan:
        lay = self.layout
        if lay.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"vllm_xmix: no hook plan for {lay.site_names[site]} under variant {mask:#x} "
                               "was built before CUDA-graph capture")
        keep = [(b & ~mask) == 0 for b in self._bits_eager]  # the entry's units and app are in the mask
        pre: list[int] = []
        if fused:  # the compiled graph applied the site's fused writes
            writes = lay.site_rest_host[site] or []
        elif lay.site_first[site]:  # adds first, in the add kernel (fused adds in eager; adds beside conditions)
            pre = [e for e in lay.site_first[site] if keep[e]]
            writes = lay.site_rest_host[site] or []
        else:
            writes = lay.site_entries_host[site] or []
        writes = [e for e in writes if keep[e]]
        reads = [e for e in (lay.site_reads_host[site] or []) if keep[e]]
        latch_reads = [e for e in reads if lay.entries[e].latch_k >= 0]
        return SitePlan(
            pre=self._idx(pre), writes=self._idx(writes), writes_host=writes,
            # the kernel is the site's, whatever the variant: the row kernel rounds to the dtype
            # after each entry, the add kernel once, so choosing by variant would make a request's
            # values depend on which other apps share its batch
            row=lay.site_has_proj[site] or lay.site_has_cond[site],
            has_cond=any(e in self._cond_set for e in writes),
            reads=self._idx(reads), reads_host=reads, req_reads=[e for e in reads if lay.entries[e].req_k >= 0],
            latch_reads=latch_reads, latch_idx=self._idx(latch_reads))

    def _idx(self, entries: list[int]) -> torch.Tensor | None:
        """Entry indices as an int32 device tensor (one per distinct list), None for none."""
        if not entries:
            return None
        t = self._idx_t.get(tuple(entries))
        if t is None:
            t = self._idx_t[tuple(entries)] = torch.tensor(entries, dtype=torch.int32, device=self.layout.device)
        return t
