"""Worker: ``WorkerBase`` gets the method ``xmix_admin(payload)``, which the API server reaches
through vLLM's own ``EngineClient.collective_rpc("xmix_admin", args=(payload,))`` (a method
name and plain JSON data, sent with msgpack; no callable is shipped) to apply a replaced or
added app version on every worker (:meth:`vllm_xmix.runtime.updates.AppUpdates.apply`). The
engine core runs it between steps, in the order requests and calls arrived."""

from __future__ import annotations

from ..runtime import get_state_from_config
from .core import add_method


def patch_worker() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    def xmix_admin(self, payload: dict) -> dict:
        """Apply an app change on this worker's model (see ``runtime.updates``); returns its
        result as plain data (``{"ok": ...}``)."""
        st = get_state_from_config(self.vllm_config)
        if st is None:
            return {"ok": False, "status": 404, "error": "no apps are deployed on this engine"}
        return st.updates.apply(payload)

    add_method("WorkerBase.xmix_admin", WorkerBase, "xmix_admin", xmix_admin)
