"""The README's main job (`python -m vllm_xmix.demo`), as a user runs it: the shipped two-style
model, default multi-process engines, the plugin loaded through its entry point in every process,
plain vLLM in a child. The demo's own checks (style shift >= 0.5, probe >= 95% held-out, CAST by
style, apps off == plain vLLM) decide its exit status; the PNG is written when asked for."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)


def test_demo_main_job(tmp_path):
    pytest.importorskip("matplotlib")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    png = tmp_path / "probe.png"
    r = subprocess.run([sys.executable, "-m", "vllm_xmix.demo", "--plot", str(png)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    out = r.stdout
    assert "4. Steering off (probe on) == plain vLLM (plugin not loaded), greedy, 6 prompts: True" in out
    assert "CAST decided by style: True" in out
    assert out.count("-> steered") == 3 and out.count("-> left alone") == 3
    assert png.stat().st_size > 10_000
    assert "   plugin: vllm_xmix " in out and " registered on vLLM " in out  # the README's check that it loaded
    assert "'vector': [" not in out  # the deployment's vectors are not dumped into the demo's screen
