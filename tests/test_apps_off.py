"""A request with every app off against vLLM without the plugin (the product's promise that an
app that is off leaves a request as vLLM computes it): compiled engines (the default mode), in
child processes, one without the plugin and one per ``fused_writes`` setting with apps deployed
and none selected.

* ``fused_writes="none"``: the hook ops return before launching anything; the compiled graph
  around them computes what plain vLLM's does: the same tokens and bit-identical logprobs.
* ``"norm"`` (what ``"auto"`` chooses here): the residual add + RMSNorm that hosts the sites is
  the plugin's op, which runs vLLM's own (uncompiled) implementation of it where no app is on,
  instead of the kernel plain vLLM's compiled graph generates: the same greedy tokens, and
  logprobs equal up to the last bits of float32 (the reduction order differs).
"""

from __future__ import annotations

import os

import numpy as np
from conftest import PROMPTS, deployment
from test_compile_cache import _child

HERE = os.path.dirname(__file__)


def test_apps_off_against_vllm_without_the_plugin(tiny_llama, hf, tmp_path):
    plain = _child(tiny_llama, "compiled", {}, None, tmp_path, "plain", XMIX_TEST_BLOCK_PLUGIN="1",
                   VLLM_CACHE_ROOT=str(tmp_path / "cache-plain"))
    assert "error" not in plain, plain
    assert plain["tokens"] == [hf.greedy(p, 10) for p in PROMPTS]
    for fw in ("none", "norm"):
        cfg = deployment()
        cfg["xmix"]["fused_writes"] = fw
        off = _child(tiny_llama, "compiled", cfg, None, tmp_path, f"off-{fw}", VLLM_CACHE_ROOT=str(tmp_path / fw))
        assert "error" not in off, (fw, off)
        assert off["tokens"] == plain["tokens"], fw
        a, b = np.array(off["logprobs"]), np.array(plain["logprobs"])
        if fw == "none":
            assert np.array_equal(a, b), f"apps off with fused_writes='none': max |diff| {np.abs(a - b).max()}"
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4, err_msg=fw)
