"""Every script in examples/ runs as a user runs it (``python examples/<name>.py``, default
multi-process engines) and prints what its app did; the numbers behind those lines are checked
with thresholds in test_two_style.py and test_apps.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# per script: a line it must print (what the app did)
EXPECT = {
    "caa.py": r"scale \+1\.0: code share from prose prompts +\d+%",
    "multi_layer.py": r"\['per_layer'\] +code share from prose prompts",
    "refusal_ablation.py": r"ablated +code share from code prompts",
    "seal.py": r"first generated newline at token \d+; first difference at token \d+",
    "cast.py": r"mean cos [+-]\d\.\d+ -> steered",
    "probe.py": r"through vLLM's read path: \d+\.\d% of \d+ held-out tokens",
    "steer_moe.py": r"steer_moe\+routes +layer-0 top-2 expert counts over \d+ positions: \[0, ",
    "workflow.py": r"\['control_vector'\] +code share from prose prompts",
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")) == sorted(EXPECT)


def _failure(r: subprocess.CompletedProcess) -> str:
    """A failed run's output for the assertion message: the stdout's end, the stderr's first
    traceback (a worker's root cause: vLLM's engine core re-raises it far above the end), and
    the stderr's end."""
    first = r.stderr.find("Traceback")
    head = r.stderr[first: first + 6000] + "\n...\n" if first >= 0 else ""
    return r.stdout[-3000:] + head + r.stderr[-5000:]


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    args = [str(tmp_path)] if name == "workflow.py" else []
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                       timeout=900, cwd=tmp_path)
    assert r.returncode == 0, _failure(r)
    assert re.search(EXPECT[name], r.stdout), r.stdout[-3000:]
