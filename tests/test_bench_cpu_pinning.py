"""`serve start --pin-cpus`: the host's physical cores split between the servers and the client.
The topology is read from a sysfs tree written here (two hardware threads per core, numbered as
Linux numbers them on x86: cpu N and cpu N + cores are one core's threads); the mask is checked
on a real child process started the way `serve start` starts a server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

from benchmarks.xmix_bench import cpu_pinning, serve_servers  # noqa: E402


def _sysfs(root, cores: int, threads: int = 2, name: str = "core_cpus_list") -> str:
    """A /sys/devices/system/cpu tree of ``cores`` x ``threads`` logical CPUs, each CPU's
    ``topology/<name>`` listing its core's threads (cpu k and cpu k + cores, as on x86)."""
    for t in range(threads):
        for k in range(cores):
            d = root / f"cpu{t * cores + k}" / "topology"
            d.mkdir(parents=True)
            (d / name).write_text(",".join(str(u * cores + k) for u in range(threads)) + "\n")
    return str(root)


def test_logical_cpus_group_by_physical_core(tmp_path):
    sys_cpu = _sysfs(tmp_path, cores=4)
    assert cpu_pinning.physical_cores(set(range(8)), sys_cpu) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # older kernels: thread_siblings_list; ranges in the list format
    old = _sysfs(tmp_path / "old", cores=2, name="thread_siblings_list")
    assert cpu_pinning.physical_cores(set(range(4)), old) == [(0, 2), (1, 3)]
    (tmp_path / "range" / "cpu0" / "topology").mkdir(parents=True)
    (tmp_path / "range" / "cpu0" / "topology" / "core_cpus_list").write_text("0-1\n")
    (tmp_path / "range" / "cpu1" / "topology").mkdir(parents=True)
    (tmp_path / "range" / "cpu1" / "topology" / "core_cpus_list").write_text("0-1\n")
    assert cpu_pinning.physical_cores({0, 1}, str(tmp_path / "range")) == [(0, 1)]
    # only the CPUs this process may use, whole cores of them
    assert cpu_pinning.physical_cores({1, 5}, sys_cpu) == [(1, 5)]


def test_part_of_a_core_or_an_unknown_topology_is_refused(tmp_path):
    sys_cpu = _sysfs(tmp_path, cores=4)
    with pytest.raises(cpu_pinning.PinningError, match=r"CPU 1's core has hardware threads \[1, 5\], of which this "
                                                       r"process may use only \[1\]"):
        cpu_pinning.physical_cores({0, 4, 1}, sys_cpu)
    with pytest.raises(cpu_pinning.PinningError, match="the topology of CPU 9 cannot be read"):
        cpu_pinning.physical_cores({1, 5, 9}, sys_cpu)
    with pytest.raises(cpu_pinning.PinningError, match="different numbers of hardware threads"):
        cpu_pinning.partition([(0, 8), (1, 9), (2, 10), (3, 11), (4,), (5, 13), (6, 14)], 2)


def test_servers_get_equal_whole_cores_and_the_client_the_rest():
    cores = [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]  # 16 CPUs, 8 cores
    client, servers = cpu_pinning.partition(cores, 2)
    assert servers == [[1, 2, 3, 9, 10, 11], [4, 5, 6, 12, 13, 14]]
    assert client == [0, 7, 8, 15]  # its core and the one left over
    client, servers = cpu_pinning.partition(cores, 3)  # with the A/A control
    assert [len(s) for s in servers] == [4, 4, 4] and client == [0, 7, 8, 15]
    everything = client + [c for s in servers for c in s]
    assert sorted(everything) == list(range(16))  # each CPU once: no two share a hardware thread


def test_too_few_cores_is_refused_naming_what_is_there():
    with pytest.raises(cpu_pinning.PinningError, match=r"2 physical core\(s\) available \(0\+2, 1\+3\), 7 needed \(3 server\(s\) "
                                         r"at 2 each and the client at 1\)"):
        cpu_pinning.partition([(0, 2), (1, 3)], 3)
    # a server gets two cores at least (its API server's and its engine core's busy threads)
    six = [(c, c + 6) for c in range(6)]
    with pytest.raises(cpu_pinning.PinningError, match="6 physical core"):
        cpu_pinning.partition(six, 3)
    assert [len(s) for s in cpu_pinning.partition(six, 2)[1]] == [4, 4]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to fewer than all")
def test_a_server_process_runs_on_its_cpus():
    mine = sorted(os.sched_getaffinity(0))
    want = mine[-1:]
    assert want != mine
    p = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), os.getsid(0) == os.getpid(), flush=True)"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=serve_servers.server_preexec(want))
    out, _ = p.communicate(timeout=60)
    assert out.strip() == f"{want} True", out
    # CPUs outside this process's mask (a start made under another mask, or on another machine)
    with pytest.raises(cpu_pinning.PinningError, match=r"CPUs \[100000\] of \[100000\] are not among"):
        cpu_pinning.pin([100000])
    assert sorted(os.sched_getaffinity(0)) == mine
    # without cpus: its own session, the parent's mask
    p = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=serve_servers.server_preexec(None))
    assert p.communicate(timeout=60)[0].strip() == str(mine)


def test_serve_start_refuses_pinning_without_the_cores_and_starts_nothing(tmp_path):
    """On one CPU (the command's mask) no split exists: `serve start --pin-cpus` exits naming
    what it found (the one core, or, where that CPU has a sibling thread, the part of a core),
    before it writes anything into --out or launches any server."""
    from benchmarks.xmix_bench import common

    model = common.write_model_config(str(tmp_path / "cfg"), layers=2, d_model=64, vocab=512)
    out = tmp_path / "serve"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH")) if x))
    one = sorted(os.sched_getaffinity(0))[:1]
    r = subprocess.run([sys.executable, "-m", "benchmarks.xmix_bench", "serve", "start", "--out", str(out),
                        "--model", model, "--no-latest", "--pin-cpus", "--control"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                       preexec_fn=lambda: os.sched_setaffinity(0, one))
    assert r.returncode != 0
    assert (("--pin-cpus: 1 physical core(s) available" in r.stderr and "7 needed (3 server(s)" in r.stderr)
            or "of which this process may use only" in r.stderr), r.stderr[-2000:]
    assert not out.exists() or not list(out.iterdir())  # nothing written, no server started
