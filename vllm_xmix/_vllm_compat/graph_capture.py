"""Graph capture: CUDA graphs captured once per hook variant (``CUDAGraphWrapper``, V1
``GPUModelRunner._warmup_and_capture``, V2 ``ModelCudaGraphManager.capture`` /
``CudaGraphManager.run_fullgraph``; see :func:`patch_graph_variants`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from ..runtime import STATE_KEY
from .core import mark, optional_import

logger = logging.getLogger("vllm.xmix")


def _variants_of(vllm_config):
    """The model instance's graph variants (``runtime.variants.GraphVariants``), None without a
    deployment or with variants off. The wrappers below use it directly: ``CUDAGraphWrapper``
    runs once per piece of a piecewise step, so its added work is kept to plain lookups."""
    st = vllm_config.compilation_config.static_forward_context.get(STATE_KEY)
    if st is None:
        return None
    v = st.variants
    return v if v.variants_enabled else None


@contextlib.contextmanager
def _variant_cost(mask: int, costs: list):
    """Measure one graph variant's capture: seconds, CUDA graphs captured (vLLM's
    ``compilation_counter``), device memory taken (free memory before - after, GiB, as vLLM's
    "Graph capturing finished" line measures it) and how much of it the caching allocator's
    reserved pool explains (GiB; the rest is memory the CUDA driver holds for the graphs
    themselves). Appends a dict to ``costs``."""
    import torch
    from vllm.compilation.counter import compilation_counter

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    res0 = torch.cuda.memory_reserved() if cuda else 0
    n0, t0 = compilation_counter.num_cudagraph_captured, time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
    gib = float(1 << 30)
    taken = (free0 - torch.cuda.mem_get_info()[0]) / gib if cuda else 0.0
    pool = (torch.cuda.memory_reserved() - res0) / gib if cuda else 0.0
    costs.append({"mask": hex(mask), "s": round(time.perf_counter() - t0, 2),
                  "graphs": compilation_counter.num_cudagraph_captured - n0,
                  "gib": round(taken, 3), "pool_gib": round(pool, 3), "driver_gib": round(taken - pool, 3)})


def _log_variant_costs(costs: list) -> None:
    for c in costs:
        logger.info("vllm_xmix: graph variant %s captured in %.1f s: %d CUDA graphs, %.3f GiB "
                    "(allocator pool %.3f GiB, driver %.3f GiB)", c["mask"], c["s"], c["graphs"], c["gib"],
                    c["pool_gib"], c["driver_gib"])


def patch_graph_variants() -> None:
    """CUDA graphs captured once per hook variant (``GraphVariants.graph_variants``: without any hook
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
    without launching when their site is not in the variant's run mask (``GraphVariants.site_plan``),
    which is what each variant's graphs record. ``VLLM_USE_BREAKABLE_CUDAGRAPH`` keeps its own graph tables: variants are
    turned off there (``GraphVariants.variants_enabled``)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    _PIECEWISE = CUDAGraphMode.PIECEWISE

    def wrap_call(orig):
        @functools.wraps(orig)
        def __call__(self, *args, **kwargs):
            gv = _variants_of(self.vllm_config)
            if gv is not None:  # (runs once per piece of a piecewise step: kept short)
                d = self.__dict__
                tables = d.get("_xmix_tables")
                if tables is not None and self.concrete_cudagraph_entries is not d["_xmix_cur"]:
                    tables = d["_xmix_tables"] = None  # vLLM replaced the table (elastic EP re-capture)
                if tables is None and gv.capturing_variants:
                    tables = d["_xmix_tables"] = {gv.all_mask: self.concrete_cudagraph_entries}
                if tables is not None:
                    # piecewise wrappers may share the every-site pieces (VLLM_XMIX_PIECEWISE_VARIANTS)
                    mask = gv.piecewise_mask() if self.runtime_mode is _PIECEWISE else gv.run_mask
                    t = tables.get(mask)
                    if t is None:
                        if not gv.capturing_variants:
                            raise RuntimeError(f"vllm_xmix: no CUDA graphs were captured for hook variant "
                                               f"{mask:#x} (captured: {[hex(m) for m in tables]})")
                        t = tables[mask] = {}
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

    mark("CUDAGraphWrapper.__call__", CUDAGraphWrapper, "__call__", wrap_call)
    mark("CUDAGraphWrapper.clear_graphs", CUDAGraphWrapper, "clear_graphs", wrap_clear)

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap_v1_capture(orig):
        @functools.wraps(orig)
        def _warmup_and_capture(self, desc, *args, **kwargs):
            gv = _variants_of(self.vllm_config)
            if gv is None:
                return orig(self, desc, *args, **kwargs)
            if gv.app_capture_size is not None:
                raise RuntimeError("vllm_xmix: VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE needs vLLM's V2 model runner "
                                   "(which knows a step's FULL graph size when the step's tables are filled); this "
                                   "engine captures with the V1 runner: unset it")
            masks = gv.graph_variants()  # app-free first, every site last
            mode = kwargs.get("cudagraph_runtime_mode", args[0] if args else None)
            if mode == CUDAGraphMode.PIECEWISE:
                masks = [m for m in masks if gv.captures_pieces(m)]
            *rest, last = masks
            for mask in rest:
                with gv.capture_variant(mask):
                    orig(self, desc, *args, **kwargs)
            with gv.capture_variant(last):
                return orig(self, desc, *args, **kwargs)

        return _warmup_and_capture

    mark("V1 GPUModelRunner._warmup_and_capture", GPUModelRunner, "_warmup_and_capture", wrap_v1_capture)

    found = optional_import("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "ModelCudaGraphManager")
    if found is None:
        return
    CudaGraphManager, ModelCudaGraphManager = found

    def wrap_v2_capture(orig):
        @functools.wraps(orig)
        def capture(self, *args, **kwargs):
            gv = _variants_of(self.vllm_config)
            if gv is None:
                return orig(self, *args, **kwargs)
            tables, costs = {}, []
            descs = self._capture_descs
            for mask in gv.graph_variants():  # app-free first, every site last
                self.graphs = {}
                own = descs
                if not gv.captures_pieces(mask):  # FULL graphs only (VLLM_XMIX_PIECEWISE_VARIANTS=onoff)
                    own = {m: d for m, d in own.items() if m != CUDAGraphMode.PIECEWISE}
                if gv.app_capture_size is not None:  # a per-app variant's FULL graphs up to that size
                    own = {m: [x for x in d if gv.captures_full(mask, x.num_tokens)] if m == CUDAGraphMode.FULL else d
                           for m, d in own.items()}
                self._capture_descs = own
                try:
                    with _variant_cost(mask, costs), gv.capture_variant(mask):
                        orig(self, *args, **kwargs)
                finally:
                    self._capture_descs = descs
                tables[mask] = self.graphs
            _log_variant_costs(costs)  # what each extra variant costs (time, graphs, memory)
            self._xmix_graphs = tables
            self.graphs = tables[gv.all_mask]

        return capture

    def wrap_v2_replay(orig):
        @functools.wraps(orig)
        def run_fullgraph(self, desc):
            tables = self.__dict__.get("_xmix_graphs")
            if tables is not None:
                gv = _variants_of(self.vllm_config)
                mask = gv.run_mask if gv is not None else max(tables)
                if mask not in tables:
                    raise RuntimeError(f"vllm_xmix: no CUDA graphs were captured for hook variant {mask:#x}")
                if desc not in tables[mask]:  # (the step fill picks a variant that captured the size)
                    raise RuntimeError(f"vllm_xmix: hook variant {mask:#x} has no FULL CUDA graph of {desc.num_tokens} "
                                       "tokens (VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE), and the step was not "
                                       "given the every-site variant")
                self.graphs = tables[mask]
            return orig(self, desc)

        return run_fullgraph

    mark("V2 ModelCudaGraphManager.capture", ModelCudaGraphManager, "capture", wrap_v2_capture)
    mark("V2 CudaGraphManager.run_fullgraph", CudaGraphManager, "run_fullgraph", wrap_v2_replay)
