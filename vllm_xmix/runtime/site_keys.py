"""Which hook sites a hook op call carries, looked up from a tensor the call passes.

A hook op (``ops.hook_write_``, ``ops.hook_norm_``) does not take its site indices as integer
arguments: integer constants would make every layer's piece of vLLM's piecewise graph differ,
and vLLM compiles isomorphic pieces once (``CompilerManager.compile``: pieces with the same
structure share one Inductor artifact). Instead each call passes a tensor of its module: the
hosting norm's ``weight`` (``fused_writes="norm"``) or a one-element key buffer the adapter
registers on the hooked module (``xmix_key_<hook>``). Buffers and parameters are inputs of the
compiled graph, so identically hooked layers compile to isomorphic pieces, and torch.compile at
engine start costs what it costs plain vLLM instead of one Inductor compile per layer.
"""

from __future__ import annotations

import torch


def key_buffer(module: torch.nn.Module, name: str) -> str:
    """Register a one-element key buffer ``xmix_key_<name>`` on ``module`` (non-persistent, on
    the device modules are built on) and return its attribute name."""
    attr = f"xmix_key_{name.replace('.', '_')}"
    if not hasattr(module, attr):
        module.register_buffer(attr, torch.zeros(1, dtype=torch.int8), persistent=False)
    return attr


class SiteKeys:
    """Modules' key tensors and the sites they stand for: ``add`` at install time, ``sites_of``
    in the hook ops."""

    def __init__(self) -> None:
        self._keys: list[tuple[torch.nn.Module, str, tuple[int, ...]]] = []
        # data pointer -> (sites, their bits, the dict of the module that holds its tensor, the
        # attribute): a hit counts only while the module's tensor has the pointer (see lookup)
        self._by_ptr: dict[int, tuple[tuple[int, ...], int, dict, str]] = {}

    def add(self, module: torch.nn.Module, attr: str, sites: tuple[int, ...]) -> None:
        """Record that calls passing ``getattr(module, attr)`` (a tensor) carry ``sites`` (site
        indices in the order they apply, -1 for none)."""
        self._keys.append((module, attr, tuple(sites)))
        self._by_ptr = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        """``(module, attr, sites)`` of every key recorded by :meth:`add`, in that order."""
        return iter(self._keys)

    def sites_of(self, key: torch.Tensor) -> tuple[int, ...]:
        """The sites of the module whose key tensor is ``key`` (the tensor the hook op received:
        the parameter's or buffer's storage). Errors: as :meth:`lookup`."""
        return self.lookup(key)[0]

    def lookup(self, key: torch.Tensor) -> tuple[tuple[int, ...], int, dict, str]:
        """``(sites, bits, holder, attr)`` of the module whose key tensor is ``key``: its site
        indices in the order they apply (-1 for none), the run-mask bits of those sites (``1 <<
        site`` each; a hook op none of whose bits is in the step's run mask applies nothing), and
        where the module keeps the tensor (``holder[attr]``: its ``_parameters``, ``_buffers`` or
        ``__dict__``).

        Raises:
            RuntimeError: no hooked module has this key (a key tensor replaced after the hooks
            were installed and then not found again), or two hooked modules share one key tensor
            (tied norm weights cannot tell their sites apart)."""
        ptr = key.data_ptr()
        hit = self._by_ptr.get(ptr)
        # a hit counts only while that module's tensor is still there: memory of a tensor that was
        # replaced (or of a temporary copy, as CPU weight offloading passes a layer's weights) can
        # come back as another module's tensor (read from the module's own dict: the attribute
        # through nn.Module.__getattr__ is a Python call per hook op)
        t = None if hit is None else hit[2].get(hit[3])
        if t is None or t.data_ptr() != ptr:
            self._rebuild()  # a parameter replaced or moved after install: look the modules up again
            hit = self._by_ptr.get(ptr)
            if hit is None:
                raise RuntimeError(
                    "vllm_xmix: a hook op was called with a key tensor that no hooked module has "
                    f"({len(self._keys)} keys): a module's parameter or key buffer was replaced outside vLLM's "
                    "weight loading; restart the engine")
        return hit

    def _rebuild(self) -> None:
        by_ptr: dict[int, tuple[tuple[int, ...], int, dict, str]] = {}
        for module, attr, sites in self._keys:
            p = getattr(module, attr).data_ptr()
            if p in by_ptr and by_ptr[p][0] != sites:
                raise RuntimeError(
                    f"vllm_xmix: two hooked modules share one key tensor ({attr}; sites {by_ptr[p][0]} and {sites}): "
                    "tied norm weights cannot host sites; set fused_writes='none' for this model")
            holder = next((d for d in (module._parameters, module._buffers, module.__dict__) if attr in d),
                          module.__dict__)
            bits = 0
            for s in sites:
                if s >= 0:
                    bits |= 1 << s
            by_ptr[p] = (sites, bits, holder, attr)
        self._by_ptr = by_ptr
