"""Tensor parallelism: the check that every hook site sees the whole, replicated tensor on every
rank, so that a write applied on each rank is applied once per token.

Under tensor parallelism vLLM shards attention heads and MLP columns across the ranks of the TP
group and all-reduces the sub-layers' outputs (``RowParallelLinear``, ``FusedMoE`` with
``reduce_results``); the residual stream, the sub-layer outputs after their all-reduce and the
router logits (a replicated gate on the replicated stream) are then identical on every rank, and
each rank applies the same writes to its replica. A hook on a tensor that is not yet reduced (a
partial sum: vLLM deferring the all-reduce, e.g. a MoE block built with ``reduce_results=False``,
or fusing it with the next norm) would add the write on every rank before the sum, i.e. ``tp``
times; a hook on a sharded tensor would see ``d_model / tp`` columns.

:class:`ReplicaCheck` records, during the first forward in which the hook ops run in Python
(every step of an eager engine and of a compiled one on CPU; with CUDA graphs, the first step
that replays none), on the step's scheduled tokens, per site the width of the hook's value and three float64
statistics of it (sum, sum of squares, sum of absolute values); the model-runner patch gathers
them across the TP group and :func:`compare_replicas` fails the engine start on every rank alike
(so no rank waits in a collective for another) when a site's width is not the model's or its
values differ between ranks (:data:`RTOL`).
"""

from __future__ import annotations

import torch

#: per site: width, sum, sum of squares, sum of |x| of the hook's value (float64)
N_STATS = 4
#: relative tolerance between ranks: the same reduced tensor may round differently on another rank
#: (all-reduce or thread order; bfloat16), by far less than 0.1% of these sums; partial sums of
#: different ranks differ by about their own size
RTOL = 1e-3


class ReplicaCheck:
    """The statistics of the hook values of the first forward that runs the hook ops in Python
    (see the module docstring).

    ``expected[site]``: the width the site's value must have (``d_model``; ``n_experts`` at the
    router logits). ``on``: recording (set by :meth:`start` before a step, cleared after it);
    ``done``: the check ran (it runs once per engine)."""

    def __init__(self, n_sites: int, expected: list[int], device: torch.device) -> None:
        self.expected = expected
        self.stats = torch.zeros((n_sites, N_STATS), dtype=torch.float64, device=device)
        self.on = False
        self.done = False
        self.n_tokens = 0
        self.any = False

    def start(self, n_tokens: int) -> None:
        """Record the next forward's hook values, on its first ``n_tokens`` rows (the scheduled
        tokens; padding rows may hold anything); no-op once the check ran. Host-side only (a
        step that replays CUDA graphs records nothing, and nothing is launched for it)."""
        if not self.done:
            self.n_tokens = n_tokens
            self.on = True

    def recorded(self) -> bool:
        """Whether some site was recorded since construction (the hook ops ran in Python while
        :attr:`on`); host-side, no device read."""
        return self.any

    def record(self, site: int, h: torch.Tensor, other: torch.Tensor | None) -> None:
        """Statistics of the hook's value ``h + other`` (``h`` alone if ``other`` is None),
        ``[T, width]`` any float dtype, at ``site``; before the site's writes."""
        self.any = True
        n = self.n_tokens
        x = (h[:n] if other is None else h[:n] + other[:n]).double()
        s = self.stats[site]
        s[0] = float(x.shape[-1]) if x.dim() else 0.0
        s[1] = x.sum()
        s[2] = x.square().sum()
        s[3] = x.abs().sum()

    def finish(self, gathered: torch.Tensor | None, site_names: dict[int, str]) -> None:
        """End recording; ``gathered`` ``[world, n_sites, N_STATS]``: every rank's :attr:`stats`
        in rank order (None: one rank, only the widths are checked).

        Raises:
            RuntimeError: naming the sites whose value is not the model's width or differs
            between ranks (the same on every rank, since all see the same ``gathered``)."""
        self.on = False
        if self.done:
            return
        self.done = True
        g = self.stats.unsqueeze(0) if gathered is None else gathered
        compare_replicas(g.to("cpu", torch.float64), self.expected, site_names)


def compare_replicas(gathered: torch.Tensor, expected: list[int], site_names: dict[int, str]) -> None:
    """``gathered`` ``[world, n_sites, N_STATS]`` float64 (:class:`ReplicaCheck` statistics of
    each rank); ``expected[site]``: the width the site's value must have. A site that no rank
    recorded (width 0 everywhere: not called in that forward) is skipped.

    Raises:
        RuntimeError: a site whose width is not ``expected`` on some rank, or whose sum, sum of
        squares or sum of absolute values differ between ranks by more than :data:`RTOL` of
        rank 0's sum of absolute values / sum of squares (the tensor is not the same replica on
        every rank: a write there would be applied once per rank)."""
    bad_width, differ = [], []
    for site in range(gathered.shape[1]):
        s = gathered[:, site]
        widths = s[:, 0]
        if not bool((widths != 0).any()):
            continue
        name = site_names.get(site, str(site))
        if bool((widths != expected[site]).any()):
            bad_width.append(f"{name} (widths {[int(w) for w in widths]} per rank, model {expected[site]})")
            continue
        finite = torch.isfinite(s[:, 1:]).all(dim=1)
        if not bool(finite.any()):
            continue  # non-finite on every rank: nothing to compare
        if not bool(finite.all()):
            differ.append(f"{name} (non-finite on some ranks only)")
            continue
        ref = s[0]
        tol_sum = RTOL * float(ref[3]) + 1e-300
        tol_sq = RTOL * float(ref[2]) + 1e-300
        if any(abs(float(r[1] - ref[1])) > tol_sum or abs(float(r[2] - ref[2])) > tol_sq
               or abs(float(r[3] - ref[3])) > tol_sum for r in s[1:]):
            differ.append(f"{name} (sum of squares per rank {[float(r[2]) for r in s]})")
    if bad_width:
        raise RuntimeError(
            f"vllm_xmix: hook sites {bad_width} see a tensor that is not the model's width on this "
            "rank (sharded by tensor parallelism?): writes and reads there are not supported")
    if differ:
        raise RuntimeError(
            f"vllm_xmix: hook sites {differ} see different values on the tensor-parallel ranks (a "
            "partial sum before vLLM's all-reduce?): a write there would be applied once per rank. "
            "Deploy these hook points with tensor_parallel_size=1")
