"""Model runners, V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, also the base of the
CPU runner) and V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``):

* ``execute_model``: before, the request registry follows the scheduler output and the hook
  self-check runs; after, the step's read values are copied out (``ReadTransport.snapshot``);
* ``_prepare_inputs`` (V1) / ``prepare_inputs`` (V2): after, the per-token fill of the device
  tables for this step's batch (``StepFill.fill``);
* ``_dummy_run`` (V1) / ``execute_model(dummy_run=True)`` (V2): the slot table is cleared;
* under tensor parallelism, the first forward whose hook ops run in Python also checks that every
  hook site sees the same whole tensor on every rank (``runtime.replicas``; vLLM's dummy forwards
  cannot: their inputs are uninitialised memory);
* ``sample_tokens``: the step's read values ride on its ``ModelRunnerOutput`` as
  ``xmix_reads`` (for async outputs, when ``get_output()`` runs)."""

from __future__ import annotations

import functools
import inspect
import logging

from ..runtime import STATE_KEY
from .core import mark, optional_import

logger = logging.getLogger("vllm.xmix")


def _state_of(runner):
    return runner.compilation_config.static_forward_context.get(STATE_KEY)


def _keeps_outputs(runner) -> bool:
    """Whether vLLM's executor uses this worker's ``ModelRunnerOutput``: the multiprocess and
    Ray executors take the output of TP rank 0 (and context-parallel rank 0) of the last pipeline
    stage only and drop the others' (``MultiprocExecutor._get_output_rank``); with the
    ``external_launcher`` backend every rank runs its own engine and keeps its own."""
    if runner.vllm_config.parallel_config.distributed_executor_backend == "external_launcher":
        return True
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    keep = ps.get_tp_group().rank_in_group == 0 and ps.get_pp_group().is_last_rank
    pcp = getattr(ps, "get_pcp_group", None)
    if keep and pcp is not None:
        keep = pcp().rank_in_group == 0
    return keep


def _tp_world(runner) -> int:
    return int(runner.vllm_config.parallel_config.tensor_parallel_size)


def _check_replicas(runner, st) -> None:
    """After a forward whose hook values were recorded (``ReplicaCheck.start`` in
    :func:`_pre_execute`): gather the records over the TP group and compare them
    (``ReplicaCheck.finish`` raises on every rank alike, since all compare the same records). Every
    rank takes the same branch: the same batch runs the hook ops in Python (eager, compiled on
    CPU, a step without CUDA graphs) or replays a graph on all of them."""
    rep = st.replicas
    rep.on = False
    if not rep.recorded():
        return  # a graph replay (or no forward): the next step records
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    mine = rep.stats.to("cpu")
    parts = [torch.empty_like(mine) for _ in range(tp.world_size)]
    dist.all_gather(parts, mine, group=tp.cpu_group)  # gloo: any dtype, any device type
    rep.finish(torch.stack(parts), st.layout.site_names)
    logger.info("vllm_xmix: %d hook site(s) see the same whole tensor on the %d tensor-parallel ranks",
                int((rep.stats[:, 0] != 0).sum()), tp.world_size)


def _pre_execute(runner, scheduler_output) -> None:
    st = _state_of(runner)
    if st is None:
        return
    if not getattr(st, "keep_known", False):
        st.reads.keep, st.keep_known = _keeps_outputs(runner), True
    if not st.replicas.done and _tp_world(runner) > 1:
        st.replicas.start(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
    st.verify_hooks_fired()
    st.update_requests(scheduler_output)


def _post_execute(runner, out):
    st = _state_of(runner)
    if st is not None:
        if st.replicas.on:
            _check_replicas(runner, st)
        st.verify_hooks_fired()  # before sampling: a step without its hooks never emits a token
        st.snapshot()
        if out is not None:  # the step ended without a separate sample_tokens call
            out = _attach_reads(runner, out)
    return out


def _attach_reads(runner, out):
    """Give the step's read values to its output (``ModelRunnerOutput.xmix_reads``: ``{req_id:
    [chunk, ...]}``, see ``ReadTransport.reads_of``); for an async output when ``get_output()`` runs."""
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


def patch_v1_runner() -> None:
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

    mark("V1 GPUModelRunner.execute_model", GPUModelRunner, "execute_model", wrap_exec)
    mark("V1 GPUModelRunner._dummy_run", GPUModelRunner, "_dummy_run", wrap_dummy)
    mark("V1 GPUModelRunner.sample_tokens", GPUModelRunner, "sample_tokens", _wrap_sample)
    mark("V1 GPUModelRunner._prepare_inputs", GPUModelRunner, "_prepare_inputs", wrap_prep)


def patch_v2_runner() -> None:
    found = optional_import("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
    if found is None:
        return
    (V2Runner,) = found

    def wrap_exec(orig):
        @functools.wraps(orig)
        def execute_model(self, scheduler_output, *args, **kwargs):
            if kwargs.get("dummy_run", False):
                if _state_of(self) is not None:
                    _state_of(self).dummy_forward()
                return orig(self, scheduler_output, *args, **kwargs)
            _pre_execute(self, scheduler_output)
            return _post_execute(self, orig(self, scheduler_output, *args, **kwargs))

        return execute_model

    from vllm.config import CUDAGraphMode

    _FULL = CUDAGraphMode.FULL

    def wrap_prep(orig):
        # where the batch descriptor comes among the arguments (after self; it moved between vLLM
        # versions), found once here rather than per step
        params = list(inspect.signature(orig).parameters)
        at = params.index("batch_desc") - 1 if "batch_desc" in params else None

        @functools.wraps(orig)
        def prepare_inputs(self, *args, **kwargs):
            ib = orig(self, *args, **kwargs)
            st = _state_of(self)
            if st is not None:
                # the FULL CUDA graph this step replays, where per-app variants capture only some
                # sizes (VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE: the fill needs its size)
                full = None
                if st.variants.app_capture_size is not None:
                    if at is None:
                        raise RuntimeError("vllm_xmix: VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE needs the batch "
                                           "descriptor in GPUModelRunner.prepare_inputs, which this vLLM does not "
                                           "pass: unset it")
                    desc = args[at] if len(args) > at else kwargs["batch_desc"]
                    full = desc.num_tokens if desc.cg_mode == _FULL else None
                st.fill(ib.req_ids[: ib.num_reqs], ib.num_scheduled_tokens[: ib.num_reqs],
                        n_padded=ib.num_tokens_after_padding, full_tokens=full)
            return ib

        return prepare_inputs

    mark("V2 GPUModelRunner.execute_model", V2Runner, "execute_model", wrap_exec)
    mark("V2 GPUModelRunner.sample_tokens", V2Runner, "sample_tokens", _wrap_sample)
    mark("V2 GPUModelRunner.prepare_inputs", V2Runner, "prepare_inputs", wrap_prep)
