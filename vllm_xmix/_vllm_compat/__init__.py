"""Everything that touches vLLM internals, in one place, one module per vLLM component it
patches. The tested vLLM versions are :data:`.core.SUPPORTED_VLLM` (0.26.x, the primary one, and
0.32.x); on any other version only the refusal patch is applied (an engine with apps deployed does
not start, naming the installed and the tested versions). The component modules are written once
for every tested version; what differs between versions is stated in :mod:`.versions`, one small
table per version series (:mod:`.versions.v0_26`, :mod:`.versions.v0_32`), which they consult
(:func:`.versions.table`) instead of testing version numbers. Each patch wraps the original (kept
as ``__wrapped__``), is applied once (:func:`apply_patches` is idempotent) and initialises no CUDA:

* :mod:`.engine_args` -- ``EngineArgs.create_engine_config``: the deployment is checked against
  the model and engine when the engine is configured (on an unsupported vLLM: refused);
* :mod:`.input_processor` -- ``InputProcessor.process_inputs``: each request's app selection is
  checked when it is added, written in canonical form, and salted for the prefix cache;
* :mod:`.model_construction` -- decoder-layer and model ``__init__`` of each adapter's classes:
  the hooks are installed at construction, before Dynamo traces the model;
* :mod:`.fused_moe` -- a ``FusedMoE`` runner's ``gate``: taken out where a router hook is
  deployed, so the MoE block computes its router logits in the model's graph;
* :mod:`.model_runner` -- V1 and V2 ``GPUModelRunner`` (``execute_model``, ``_prepare_inputs`` /
  ``prepare_inputs``, ``_dummy_run``, ``sample_tokens``): the request registry, the per-step fill
  and the read values' copy-out;
* :mod:`.graph_capture` -- ``CUDAGraphWrapper``, V1 ``_warmup_and_capture``, V2
  ``ModelCudaGraphManager`` / ``CudaGraphManager``: CUDA graphs per hook variant;
* :mod:`.scheduler` -- ``Scheduler.update_from_output``: read values travel per request to the
  front end;
* :mod:`.output_processor` -- ``OutputProcessor.add_request`` (the state of a request with apps
  is switched to a subclass of ``RequestState`` whose ``make_request_output`` makes its read
  values ``RequestOutput.mi_results``); ``RequestOutput.add``: outputs merged for a slow consumer
  keep the newest values;
* :mod:`.openai_server` -- ``create_completion`` / ``create_chat_completion``: bad selections are
  an HTTP 400 before the response starts; ``completion_stream_generator`` /
  ``chat_completion_stream_generator``: the chunks of a request with apps carry its read values
  (a request without apps gets vLLM's generator itself);
* :mod:`.api_server` -- ``register_vllm_serve_api_routers``: the ``/v1/mi/apps`` routes (list, replace, add apps on a
  running server);
* :mod:`.worker` -- ``WorkerBase.xmix_admin``: an app change applied on each worker, reached
  through ``collective_rpc``;
* :mod:`.args_log` -- the logger of ``log_non_default_args``: a deployment's inline vectors are
  shortened in the start-up line;
* :mod:`.envs` -- ``vllm.envs.environment_variables``: the plugin's ``VLLM_XMIX_*`` variables are
  known to vLLM's environment check.

Not patches: :mod:`.introspection` is a vLLM worker extension (``worker_extension_cls``) with one
read-only call, ``xmix_counts``, for tests and debugging; :mod:`.cli_serve` starts vLLM's server
as ``vllm serve`` does, for ``vllm-xmix serve``.

The patches call into the runtime (:mod:`vllm_xmix.runtime`) and the checks
(:mod:`vllm_xmix.validation`); neither imports this package.
"""

from __future__ import annotations

from .core import _PATCHED, PRIMARY_VLLM, SUPPORTED_VLLM, supported_text, version_supported, vllm_version
from .engine_args import patch_refusal as _patch_refusal


def apply_patches() -> list[str]:
    """Apply every patch (idempotent); returns the names of what is patched."""
    from .api_server import patch_api_server
    from .args_log import patch_args_log
    from .envs import patch_envs
    from .engine_args import patch_engine_args
    from .graph_capture import patch_graph_variants
    from .input_processor import patch_input_processor
    from .model_construction import patch_layer_classes
    from .model_runner import patch_v1_runner, patch_v2_runner
    from .openai_server import patch_openai_server
    from .output_processor import patch_output_processor
    from .scheduler import patch_scheduler
    from .worker import patch_worker

    patch_engine_args()
    patch_input_processor()
    patch_layer_classes()
    patch_v1_runner()
    patch_v2_runner()
    patch_graph_variants()
    patch_scheduler()
    patch_output_processor()
    patch_openai_server()
    patch_api_server()
    patch_worker()
    patch_args_log()
    patch_envs()
    return list(_PATCHED)


__all__ = ["PRIMARY_VLLM", "SUPPORTED_VLLM", "apply_patches", "supported_text", "version_supported", "vllm_version"]
