"""Whole physical CPU cores for each server of a serving A/B and for its client (``serve start
--pin-cpus``).

Two servers measured side by side share the host's CPUs with each other and with the benchmark
client. Where the OS puts a server's busy threads (an API server's event loop, an engine core's
busy loop) on the two hardware threads of one physical core, or beside the other server's, that
server's host work runs slower for as long as the placement lasts, which can be the server's
whole life: vLLM's own ``Scheduler.schedule``, which the plugin does not wrap, has run 9-35%
longer in one server of a pair than in the other through a whole run sequence, apps off
included (benchmarks/RESULTS.md), a difference such placement would make, and host time is step
time in the steps that carry prompts. Pinning gives each server, and the client, cores of its own
(both hardware threads of each), so the servers of a pair run their host work under the same
conditions and a difference left between them is not the placement's.

:func:`physical_cores` reads the topology from sysfs (``/sys/devices/system/cpu/cpuN/topology``);
:func:`partition` splits the cores; :func:`pin` is what a server's process runs before ``exec``
(its children, the engine core and workers, inherit the mask)."""

from __future__ import annotations

import os

SYS_CPU = "/sys/devices/system/cpu"


def physical_cores(cpus: set[int] | None = None, sys_cpu: str = SYS_CPU) -> list[tuple[int, ...]]:
    """The logical CPUs of ``cpus`` (default: those this process may run on) grouped by physical
    core (same ``physical_package_id`` and ``core_id``), each group sorted, groups in order of
    their first CPU. A CPU whose topology cannot be read is a core of its own."""
    cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
    groups: dict[tuple, list[int]] = {}
    for c in sorted(cpus):
        try:
            with open(f"{sys_cpu}/cpu{c}/topology/physical_package_id") as f:
                pkg = int(f.read())
            with open(f"{sys_cpu}/cpu{c}/topology/core_id") as f:
                core = int(f.read())
            key = (pkg, core)
        except (OSError, ValueError):
            key = ("cpu", c)
        groups.setdefault(key, []).append(c)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


#: physical cores a server gets at least: its API server's event loop and its engine core's busy
#: loop are two busy threads, which on one core would share its hardware threads
MIN_SERVER_CORES = 2


def partition(cores: list[tuple[int, ...]], n_servers: int, client_cores: int = 1,
              min_server_cores: int = MIN_SERVER_CORES) -> tuple[list[int], list[list[int]]]:
    """``(client CPUs, [CPUs of server i])``: the first ``client_cores`` physical cores to the
    client, the rest dealt out whole and evenly, in order, to the servers (a remainder goes to
    the client: no server gets more than another).

    Raises:
        ValueError: fewer than ``client_cores + n_servers * min_server_cores`` physical cores
        (naming both)."""
    if n_servers < 1 or client_cores < 1 or min_server_cores < 1:
        raise ValueError(f"partition: n_servers ({n_servers}), client_cores ({client_cores}) and min_server_cores "
                         f"({min_server_cores}) must be >= 1")
    need = client_cores + n_servers * min_server_cores
    if len(cores) < need:
        raise ValueError(f"--pin-cpus: {len(cores)} physical core(s) available ({_text(cores)}), {need} needed "
                         f"({n_servers} server(s) at {min_server_cores} each and the client at {client_cores})")
    per = (len(cores) - client_cores) // n_servers
    servers = [cores[client_cores + i * per: client_cores + (i + 1) * per] for i in range(n_servers)]
    client = cores[:client_cores] + cores[client_cores + n_servers * per:]
    flat = lambda gs: sorted(c for g in gs for c in g)  # noqa: E731
    return flat(client), [flat(s) for s in servers]


def pin(cpus: list[int]) -> None:
    """This process (and the processes it starts from now on) to ``cpus``."""
    os.sched_setaffinity(0, set(cpus))


def _text(cores: list[tuple[int, ...]]) -> str:
    return ", ".join("+".join(map(str, g)) for g in cores) or "none"
