"""Whole physical CPU cores for each server of a serving A/B and for its client (``serve start
--pin-cpus``).

Two servers measured side by side share the host's CPUs with each other and with the benchmark
client. Where the OS puts a server's busy threads (an API server's event loop, an engine core's
busy loop) on the two hardware threads of one physical core, or beside the other server's, that
server's host work runs slower than its twin's for as long as the placement lasts, and host time
is step time in the steps that carry prompts (benchmarks/RESULTS.md has the host times of such
pairs). Pinning gives each server, and the client, cores of its own (every hardware thread of
each), so the servers of a pair run their host work under the same conditions.

The split is of the CPUs the calling process may use (its affinity mask): two experiments side
by side on one host (one per GPU) each start under a ``taskset -c`` of their own half.

:func:`physical_cores` reads the topology from sysfs (``/sys/devices/system/cpu/cpuN/topology``);
:func:`partition` splits the cores; :func:`pin` is what a server's process runs before ``exec``
(its children, the engine core and workers, inherit the mask)."""

from __future__ import annotations

import os

SYS_CPU = "/sys/devices/system/cpu"


class PinningError(ValueError):
    """The CPUs cannot be split as ``--pin-cpus`` promises (the message says why)."""


def _cpu_list(text: str) -> set[int]:
    """A sysfs CPU list (``"0,8"``, ``"0-1"``, ``"0-3,8-11"``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(cpus: set[int] | None = None, sys_cpu: str = SYS_CPU) -> list[tuple[int, ...]]:
    """The logical CPUs of ``cpus`` (default: those this process may use) grouped by physical
    core: a CPU's ``topology/core_cpus_list`` (or, on older kernels, ``thread_siblings_list``)
    names its core's hardware threads. Groups sorted, in order of their first CPU.

    Raises:
        PinningError: a CPU's topology cannot be read, or a core has hardware threads outside
        ``cpus`` (pinned to part of a core, a server would share it with whatever runs on the
        rest); the message names the CPU."""
    cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
    groups: set[tuple[int, ...]] = set()
    for c in sorted(cpus):
        siblings = None
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                with open(f"{sys_cpu}/cpu{c}/topology/{name}") as f:
                    siblings = _cpu_list(f.read())
                break
            except (OSError, ValueError):
                continue
        if not siblings or c not in siblings:
            raise PinningError(f"--pin-cpus: the topology of CPU {c} cannot be read ({sys_cpu}/cpu{c}/topology/"
                               "core_cpus_list): its core's hardware threads are unknown")
        if not siblings <= cpus:
            raise PinningError(f"--pin-cpus: CPU {c}'s core has hardware threads {sorted(siblings)}, of which this "
                               f"process may use only {sorted(siblings & cpus)}: a server pinned there would share "
                               "the core (give the command whole cores, e.g. taskset -c with both threads of each)")
        groups.add(tuple(sorted(siblings)))
    return sorted(groups, key=lambda g: g[0])


#: physical cores a server gets at least: its API server's event loop and its engine core's busy
#: loop are two busy threads, which on one core would share its hardware threads
MIN_SERVER_CORES = 2


def partition(cores: list[tuple[int, ...]], n_servers: int, client_cores: int = 1,
              min_server_cores: int = MIN_SERVER_CORES) -> tuple[list[int], list[list[int]]]:
    """``(client CPUs, [CPUs of server i])``: the first ``client_cores`` physical cores to the
    client, the rest dealt out whole and evenly, in order, to the servers (a remainder goes to
    the client): every server gets as many cores, and as many CPUs, as every other.

    Raises:
        PinningError: fewer than ``client_cores + n_servers * min_server_cores`` physical cores,
        or cores with different numbers of hardware threads (the servers' shares would differ);
        the message names what was found.
        ValueError: a count below 1."""
    if n_servers < 1 or client_cores < 1 or min_server_cores < 1:
        raise ValueError(f"partition: n_servers ({n_servers}), client_cores ({client_cores}) and min_server_cores "
                         f"({min_server_cores}) must be >= 1")
    need = client_cores + n_servers * min_server_cores
    if len(cores) < need:
        raise PinningError(f"--pin-cpus: {len(cores)} physical core(s) available ({_text(cores)}), {need} needed "
                           f"({n_servers} server(s) at {min_server_cores} each and the client at {client_cores})")
    sizes = sorted({len(g) for g in cores})
    if len(sizes) > 1:
        raise PinningError(f"--pin-cpus: the cores have different numbers of hardware threads ({_text(cores)}): "
                           "the servers' shares would differ")
    per = (len(cores) - client_cores) // n_servers
    servers = [cores[client_cores + i * per: client_cores + (i + 1) * per] for i in range(n_servers)]
    client = cores[:client_cores] + cores[client_cores + n_servers * per:]
    flat = lambda gs: sorted(c for g in gs for c in g)  # noqa: E731
    return flat(client), [flat(s) for s in servers]


def pin(cpus: list[int]) -> None:
    """The calling thread (in a process that has not started threads yet: the process) and the
    processes it starts from now on, to ``cpus``.

    Raises:
        PinningError: ``cpus`` is not within the CPUs this process may use now (a command run
        under another mask, or on another machine, than the start that chose them)."""
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise PinningError(f"--pin-cpus: CPUs {sorted(set(cpus) - allowed)} of {sorted(cpus)} are not among the CPUs "
                           f"this process may use ({sorted(allowed)})")
    os.sched_setaffinity(0, set(cpus))


def _text(cores: list[tuple[int, ...]]) -> str:
    return ", ".join("+".join(map(str, g)) for g in cores) or "none"
