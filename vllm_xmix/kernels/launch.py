"""A Triton kernel launched through its compiled handle, without the JIT's per-launch work.

``JITFunction.run`` (``kernel[grid](*args)``) binds and specializes every argument on every
launch (a generated binder over the whole signature, the cache key, the device and stream
lookups, Triton 3.6's launch-hook chains), and its launcher then calls each tensor's
``data_ptr()`` and asks the driver about that address (``cuPointerGetAttribute``). For a kernel
of 45 parameters, 22 of them pointers, that was ~100 us of host time per launch on an H100's
host (benchmarks/RESULTS.md 2026-12-05), paid by every step that runs without
CUDA graphs (more tokens than the largest captured size) once per hosted norm with an app on.

:class:`CompiledLaunch` launches a kernel already compiled for a specialization the way the
JIT's own last line does (``CompiledKernel.run(grid, stream, function, packed_metadata,
launch_metadata, enter hook, exit hook, *args)``, every parameter of the signature in order,
constexprs included), with pointers passed as integers (device addresses, which the launcher
takes as they are). The first launch of each specialization goes through the JIT with tensors,
which compiles it or finds it in Triton's cache. The caller names the specialization with a key:
any hashable value that determines what Triton specializes the arguments on (each tensor's
dtype and whether its address is 16-byte aligned, :func:`tensor_spec`; each specialized
integer's value class; the constexprs' values; ``num_warps``; the device). The tests check that
equal keys mean equal specializations under the installed Triton. Under ``TRITON_INTERPRET=1``
(CPU) the JIT returns no compiled kernel, so every launch goes through the interpreter. What the
compiled launch does not do: a registered launch hook or pre-run hook sends launches through
the JIT again, but a change of ``knobs.runtime.debug`` or of the instrumentation options after a
kernel's first launch does not recompile it.
"""

from __future__ import annotations

import torch


def tensor_spec(t: torch.Tensor) -> tuple:
    """What Triton specializes a tensor argument on: its dtype and whether its address is
    16-byte aligned."""
    return t.dtype, t.data_ptr() % 16 == 0


def as_pointers(args: tuple) -> tuple:
    """``args`` with each tensor replaced by its device address (what the compiled launch takes)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class CompiledLaunch:
    """Launches of one ``@triton.jit`` ``kernel`` on a grid of up to 3 dims (module docstring):
    :meth:`compiled` gives the compiled kernel of a specialization key the JIT has launched (None
    before, or while a launch or pre-run hook is set), :meth:`run` launches it, :meth:`jit`
    launches through the JIT and keeps the compiled kernel for its key; calling the object does
    all three with the key taken from the arguments (:meth:`key_and_pointers`)."""

    __slots__ = ("kernel", "_compiled")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict = {}

    def __call__(self, grid: tuple, args: tuple, num_warps: int | None = None) -> None:
        """Launch on ``grid`` (up to 3 dims) with ``args`` (every parameter of the signature in
        order, constexprs included, tensors as tensors), on the current CUDA device's current
        stream, the key taken from the arguments themselves (:meth:`key_and_pointers`). For
        kernels of a few dozen arguments whose non-tensor arguments take few values (no token
        count among them)."""
        key, ptrs = self.key_and_pointers(args, num_warps)
        k = self.compiled(key)
        if k is not None:
            self.run(k, grid, key[-1], ptrs)
        else:
            self.jit(key, grid, args, num_warps)

    @staticmethod
    def key_and_pointers(args: tuple, num_warps: int | None) -> tuple[tuple, tuple]:
        """(the launch's key, ``args`` with tensors as device addresses). The key holds each
        tensor's dtype, 16-byte alignment and whether it is on CUDA (a CPU tensor gets the JIT's
        error, not an address the kernel would fault on), every other argument's type and value
        (``True``, ``1`` and ``1.0`` are equal in Python, not to Triton), ``num_warps``, and last
        the current CUDA device (-1 without a CUDA tensor), whose compiled kernel the JIT made."""
        ptrs, key, dev = [], [num_warps], -1
        for a in args:
            if isinstance(a, torch.Tensor):
                p = a.data_ptr()
                ptrs.append(p)
                cuda = a.is_cuda
                key.append((a.dtype, p % 16 == 0, cuda))
                if cuda and dev < 0:
                    dev = torch._C._cuda_getDevice()
            else:
                ptrs.append(a)
                key.append((type(a), a))
        key.append(dev)
        return tuple(key), tuple(ptrs)

    def compiled(self, key):
        """The compiled kernel of ``key``, or None: not launched yet, or a launch hook (a
        profiler's, e.g. Proton) or a pre-run hook of the kernel is set, which only the JIT
        calls."""
        k = self._compiled.get(key)
        if k is None or _launch_hooks() is not None or getattr(self.kernel, "pre_run_hooks", None):
            return None
        return k

    def run(self, k, grid: tuple, device: int, ptr_args: tuple) -> None:
        """Launch compiled kernel ``k`` on ``grid`` (up to 3 dims) on the current CUDA stream of
        ``device`` (its index); ``ptr_args``: every parameter of the signature in order,
        constexprs included, tensors as their device addresses (:func:`as_pointers`)."""
        n = len(grid)
        k.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
              k.function, k.packed_metadata, None, None, None, *ptr_args)

    def jit(self, key, grid: tuple, args: tuple, num_warps: int | None) -> None:
        """Launch through the JIT (``args``: the signature's parameters in order, constexprs
        included, tensors as tensors) and keep the compiled kernel for ``key``."""
        k = self.kernel[grid](*args) if num_warps is None else self.kernel[grid](*args, num_warps=num_warps)
        # (the interpreter returns no compiled kernel)
        if getattr(k, "packed_metadata", None) is not None and getattr(k, "function", None) is not None:
            self._compiled[key] = k


_RUNTIME_KNOBS: list = []  # [triton.knobs.runtime] once looked up ([None] without it)


def _launch_hooks():
    """Triton's launch enter/exit hooks if either is set, else None. Triton 3.6 keeps each as a
    ``HookChain`` (a list of hooks, empty unless a profiler registered one): an empty chain is
    no hook."""
    if not _RUNTIME_KNOBS:
        try:
            from triton import knobs

            _RUNTIME_KNOBS.append(knobs.runtime)
        except ImportError:  # (a Triton without knobs has no such hooks)
            _RUNTIME_KNOBS.append(None)
    rt = _RUNTIME_KNOBS[0]
    if rt is None:
        return None
    enter, exit_ = getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None)
    return None if not (_is_set(enter) or _is_set(exit_)) else (enter, exit_)


def _is_set(hook) -> bool:
    """Whether ``hook`` (None, a callable, or a ``HookChain``) would call anything."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


__all__ = ["CompiledLaunch", "as_pointers", "tensor_spec"]
