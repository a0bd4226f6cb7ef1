"""The README's main job (`python -m vllm_xmix.demo`), as a user runs it: default multi-process
engine, the plugin loaded through its entry point in every process, plain vLLM in a child."""

import os
import subprocess
import sys


def test_demo_main_job(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    r = subprocess.run([sys.executable, "-m", "vllm_xmix.demo", "--model", tiny_llama], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "[demo] steering off (probe on) == plain vLLM (plugin not loaded): True" in r.stdout
    assert "[demo] steering on changed 4/4 prompts" in r.stdout
    assert "[demo] one probe score per processed token: True; probe higher with steering on: 4/4" in r.stdout
