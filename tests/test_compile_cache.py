"""Hooks must never vanish silently: torch.compile caches, AOT artifacts and the self-check.

vLLM keys its compile/AOT cache by the config hash. An engine started without the plugin (or a
cache written by one) must never make a steered request come back unsteered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import PROMPTS, app_deltas, deployment

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

HERE = os.path.dirname(__file__)


def _child(model, mode, cfg, apps, tmp_path, name, **env):
    out = tmp_path / f"{name}.json"
    e = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
             VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    r = subprocess.run([sys.executable, os.path.join(HERE, "child_generate.py"), model, mode, json.dumps(cfg),
                        json.dumps(apps), str(out)], env=e, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"child {name} died rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_cache_from_plugin_free_engine_is_not_reused(tiny_llama, hf, tmp_path):
    """1) vLLM without the plugin, compiled, with the same additional_config a user passes,
    fills the compile cache; 2) with the plugin, same cache root: steered tokens == HF steered
    (the plugin stamps its runtime into additional_config, so the hash differs).
    In-process engines: the plugin is kept out of the first by a test switch in the child."""
    cache = str(tmp_path / "cache")
    cfg = deployment()
    apps = [{"name": "happy", "scale": 5.0}]
    plain = _child(tiny_llama, "compiled", cfg, None, tmp_path, "plain", XMIX_TEST_BLOCK_PLUGIN="1",
                   VLLM_CACHE_ROOT=cache)
    assert "error" not in plain, plain
    assert plain["tokens"] == [hf.greedy(p, 10) for p in PROMPTS]
    steered = _child(tiny_llama, "compiled", cfg, apps, tmp_path, "steered", VLLM_CACHE_ROOT=cache)
    assert "error" not in steered, steered
    assert steered["tokens"] == [hf.greedy(p, 10, app_deltas(apps)) for p in PROMPTS]
    assert steered["tokens1"] == [t[:1] for t in steered["tokens"]]


def test_stale_graph_without_hooks_never_gives_unsteered_tokens(tiny_llama, hf, tmp_path):
    """Adversarial: a plugin-free engine given the *exact* canonical config (the plugin's runtime
    stamp included) writes the cache under the same hash as the plugin's engine. The plugin's
    engine then either recompiles (vLLM rejects the artifact; what vLLM 0.26 on CPU does) and
    steers correctly, or loads a graph without its ops and must stop with an error (the
    runtime's self-check). It must never return unsteered tokens, not even a first token."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=tiny_llama, additional_config=deployment()).create_engine_config().additional_config
    assert cfg["xmix"]["runtime"].startswith("vllm-xmix ")
    cache = str(tmp_path / "cache")
    apps = [{"name": "happy"}]
    plain = _child(tiny_llama, "compiled", cfg, None, tmp_path, "plain", XMIX_TEST_BLOCK_PLUGIN="1",
                   VLLM_CACHE_ROOT=cache)
    assert "error" not in plain, plain
    steered = _child(tiny_llama, "compiled", cfg, apps, tmp_path, "steered", VLLM_CACHE_ROOT=cache)
    if "error" in steered:
        assert "never executed" in steered["error"] and "stale torch.compile cache" in steered["error"]
    else:
        want = [hf.greedy(p, 10, app_deltas(apps)) for p in PROMPTS]
        assert steered["tokens"] == want
        assert steered["tokens1"] == [w[:1] for w in want]
        assert steered["tokens1"] != [t[:1] for t in plain["tokens"]]


def test_self_check_names_the_missing_sites():
    """The runtime's check on its own (real XmixState, CPU): uninstalled or silent sites raise."""
    import torch

    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    st = XmixState.build(parse_deployment(deployment()["xmix"]), 4, 64, torch.device("cpu"), 32, 4)
    st.verify_hooks_fired()  # nothing ran yet: nothing to check
    st.fill(["r"], np.array([3]))
    with pytest.raises(RuntimeError, match=r"blocks\.0\.hook_resid_post.*were not installed"):
        st.verify_hooks_fired()
    st.installed.update(range(len(st.sites)))
    with pytest.raises(RuntimeError, match=r"never executed"):
        st.verify_hooks_fired()
    st.calls = [1] * len(st.sites)
    st.verify_hooks_fired()
    assert st.verified
