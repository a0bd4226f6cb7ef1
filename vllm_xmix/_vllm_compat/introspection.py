"""Worker: a read-only introspection call for tests and debugging, as a vLLM worker extension
(vLLM's ``--worker-extension-cls`` / ``LLM(worker_extension_cls=...)``; nothing is patched).

``XmixWorkerExtension.xmix_counts()`` returns, as a JSON dict, what the MI runtime of the
worker's model holds per request (``runtime.XmixState.counts``: slots held and free, registered
rows, read snapshots, the per-token device rows that point at a request) and, on a GPU, the
CUDA memory PyTorch holds (``device_allocated_bytes``, ``device_reserved_bytes``), or
``{"deployed": False}`` without a deployment. It changes nothing. How to call it:

* offline: ``LLM(..., worker_extension_cls=EXTENSION)`` then ``llm.collective_rpc("xmix_counts")``
  (one dict per worker);
* on a server started with ``--worker-extension-cls vllm_xmix._vllm_compat.introspection.XmixWorkerExtension``
  and vLLM's development endpoints (``VLLM_SERVER_DEV_MODE=1``, never on a public port):
  ``POST /collective_rpc`` with ``{"method": "xmix_counts"}`` answers ``{"results": [dict, ...]}``.

Used by the soak test (``tests/test_soak.py``): after load, aborts, disconnects and preemption the
counts must return to those of the idle engine, and on a GPU the device memory stays flat.
"""

from __future__ import annotations

from ..runtime import STATE_KEY

#: the qualified name to pass as ``worker_extension_cls``
EXTENSION = "vllm_xmix._vllm_compat.introspection.XmixWorkerExtension"


class XmixWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``); adds
    :meth:`xmix_counts` and nothing else."""

    def xmix_counts(self) -> dict:
        """The worker's MI runtime counts (``XmixState.counts``: ints keyed by name), or
        ``{"deployed": False}`` when no app is deployed. Read-only."""
        runner = getattr(self, "model_runner", None)
        ctx = runner.compilation_config.static_forward_context if runner is not None else {}
        st = ctx.get(STATE_KEY)
        if st is None:
            return {"deployed": False}
        return {"deployed": True, **st.counts(), **_device_memory()}


def _device_memory() -> dict[str, int]:
    """The worker's CUDA memory held by tensors and reserved by PyTorch's caching allocator, in
    bytes (``device_allocated_bytes``, ``device_reserved_bytes``), after a synchronisation; empty
    on a CPU. vLLM allocates the KV cache and the graphs' pool at start-up, so under steady load
    both stay flat: growth across requests is a leak."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    torch.cuda.synchronize()
    return {"device_allocated_bytes": int(torch.cuda.memory_allocated()),
            "device_reserved_bytes": int(torch.cuda.memory_reserved())}
