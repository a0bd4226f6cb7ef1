"""Which hook sites each hosting norm carries (deployment ``fused_writes="norm"``).

With ``fused_writes="norm"`` a residual-stream site's hook op is vLLM's fused residual add +
RMSNorm that follows it (``ops.hook_norm_``, installed by ``adapters._residual._install_norm``).
The op finds its sites from the norm's ``weight`` (its data pointer), not from integer
arguments: integer constants would make every layer's piece of vLLM's piecewise graph differ,
and vLLM compiles isomorphic pieces once (``CompilerManager.compile``: pieces with the same
structure share one Inductor artifact). With the sites out of the graph, the pieces of
identically hooked layers are isomorphic again, so torch.compile at engine start costs what it
costs plain vLLM instead of one Inductor compile per layer.
"""

from __future__ import annotations

import torch


class NormHosts:
    """Hosting norms and their sites: ``add`` at install time, ``sites_of`` in the hook op."""

    def __init__(self) -> None:
        self._norms: list[tuple[torch.nn.Module, tuple[int, int]]] = []
        self._by_ptr: dict[int, tuple[int, int]] = {}

    def add(self, norm: torch.nn.Module, sites: tuple[int, int]) -> None:
        """Record that ``norm`` (a module with a ``weight`` parameter) hosts ``sites`` (site
        indices ``(a, b)``, -1 for none), applied in that order before its add + RMSNorm."""
        self._norms.append((norm, sites))
        self._by_ptr = {}

    def __len__(self) -> int:
        return len(self._norms)

    def sites_of(self, weight: torch.Tensor) -> tuple[int, int]:
        """The sites of the norm whose weight is ``weight`` ``[d_model]`` (the tensor the hook op
        received: the parameter's storage).

        Raises:
            RuntimeError: no hosting norm has this weight (a norm whose parameter was replaced
            after the hooks were installed and then not found again), or two hosting norms
            share one weight tensor (tied norms cannot tell their sites apart)."""
        sites = self._by_ptr.get(weight.data_ptr())
        if sites is None:
            self._rebuild()  # a parameter replaced after install: look the modules up again
            sites = self._by_ptr.get(weight.data_ptr())
            if sites is None:
                raise RuntimeError(
                    "vllm_xmix: a hook op of the fused add + RMSNorm was called with a weight that no hosting "
                    f"norm has ({len(self._norms)} norms host sites): the norm's parameter was replaced "
                    "outside vLLM's weight loading; restart the engine")
        return sites

    def _rebuild(self) -> None:
        by_ptr: dict[int, tuple[int, int]] = {}
        for norm, sites in self._norms:
            p = norm.weight.data_ptr()
            if p in by_ptr and by_ptr[p] != sites:
                raise RuntimeError(
                    f"vllm_xmix: two norms that host hook sites share one weight tensor (sites {by_ptr[p]} and "
                    f"{sites}): set fused_writes='none' for this model")
            by_ptr[p] = sites
        self._by_ptr = by_ptr
