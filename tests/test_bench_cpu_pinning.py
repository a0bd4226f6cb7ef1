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

from benchmarks.xmix_bench import cpu_pinning, serve  # noqa: E402


def _sysfs(root, cores: int, threads: int = 2, packages: int = 1) -> str:
    """A /sys/devices/system/cpu tree: ``packages`` x ``cores`` x ``threads`` logical CPUs."""
    n = packages * cores
    for t in range(threads):
        for k in range(n):
            cpu = t * n + k
            d = root / f"cpu{cpu}" / "topology"
            d.mkdir(parents=True)
            (d / "physical_package_id").write_text(f"{k // cores}\n")
            (d / "core_id").write_text(f"{k % cores}\n")
    return str(root)


def test_logical_cpus_group_by_physical_core(tmp_path):
    sys_cpu = _sysfs(tmp_path, cores=4)
    assert cpu_pinning.physical_cores(set(range(8)), sys_cpu) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # two packages: the same core_id on each is two cores
    sys_cpu = _sysfs(tmp_path / "two", cores=2, packages=2)
    assert cpu_pinning.physical_cores(set(range(8)), sys_cpu) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # only the CPUs this process may use; one without topology is a core of its own
    assert cpu_pinning.physical_cores({1, 5, 9}, _sysfs(tmp_path / "part", cores=4)) == [(1, 5), (9,)]


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
    with pytest.raises(ValueError, match=r"2 physical core\(s\) available \(0\+2, 1\+3\), 7 needed \(3 server\(s\) "
                                         r"at 2 each and the client at 1\)"):
        cpu_pinning.partition([(0, 2), (1, 3)], 3)
    # a server gets two cores at least (its API server's and its engine core's busy threads)
    six = [(c, c + 6) for c in range(6)]
    with pytest.raises(ValueError, match="6 physical core"):
        cpu_pinning.partition(six, 3)
    assert [len(s) for s in cpu_pinning.partition(six, 2)[1]] == [4, 4]


def test_a_server_process_runs_on_its_cpus():
    mine = sorted(os.sched_getaffinity(0))
    want = mine[-1:]
    p = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), os.getsid(0) == os.getpid(), flush=True)"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=serve.server_preexec(want))
    out, _ = p.communicate(timeout=60)
    assert out.strip() == f"{want} True", out
    # without cpus: its own session, the parent's mask
    p = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=serve.server_preexec(None))
    assert p.communicate(timeout=60)[0].strip() == str(mine)


def test_serve_start_refuses_pinning_without_the_cores_and_starts_nothing(tmp_path):
    """On one CPU (the command's mask) no split exists: `serve start --pin-cpus` exits naming
    the cores it found and the servers it needed, before it launches any server."""
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
    assert "--pin-cpus: 1 physical core(s) available" in r.stderr and "7 needed (3 server(s)" in r.stderr, r.stderr[-2000:]
    assert not list(out.glob("*.log"))  # no server was started
