"""The apps on the shipped two-style model (Python code / King James prose), where they mean
something: the whole workflow on vLLM (capture -> extract -> deploy), with thresholds fixed here.

* extraction from the product's captures equals the same computation on HF hidden states;
* a difference-of-means vector (CAA) moves the style measure by at least 0.5, both ways;
* a logistic probe classifies at least 95% of held-out tokens, scored through the read path;
* CAST decides by the prompt's style, and steers only the prompts it decided for;
* SEAL changes nothing before its first trigger token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import close_llm, make_llm

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

LAYERS = [1, 2, 3]
STEER_LAYER = 2
PROSE_PROMPTS = ["And he said unto them,", "Blessed are the", "In the beginning", "And it came to pass"]
CODE_PROMPTS = ["def get(self, key):\n", "import os\n", "class Foo:\n", "    def __init__(self"]


@pytest.fixture(scope="module")
def two_style():
    from vllm_xmix.models import two_style_path, two_style_texts

    return two_style_path(), two_style_texts()


@pytest.fixture(scope="module")
def captured(two_style):
    """Activations at LAYERS of every shipped excerpt, through a capture app in vLLM."""
    from vllm_xmix import deploy
    from vllm_xmix.extract import capture_app, collect_activations
    from vllm_xmix.spec import XmixSpecError

    model, texts = two_style
    llm = make_llm(model, "eager", max_model_len=512, additional_config=deploy(capture_app(LAYERS)))
    try:
        acts = {(s, k): collect_activations(llm, texts[s][k]) for s in ("code", "prose") for k in ("train", "held")}
        # a prompt that skip_first would leave without positions is refused, not returned empty
        with pytest.raises(XmixSpecError, match=r"prompt 1 has 2 tokens, and skip_first=2 leaves none"):
            collect_activations(llm, [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 6]}], skip_first=2)
        assert [a.shape[0] for a in collect_activations(llm, [{"prompt_token_ids": [5, 6, 7]}], skip_first=2)[1]] == [1]
        # one prompt, or one app name, where a list is expected is refused (a string would run
        # as one prompt per character, or select an app per character)
        for bad, kw, what in (("In the beginning", {}, "prompts is one str"),
                              ({"prompt_token_ids": [5, 6, 7]}, {}, "prompts is one dict"),
                              (["In the beginning"], {"apps": "st"}, "apps is one str")):
            with pytest.raises(XmixSpecError, match=f"collect_activations: {what} .*; pass a list"):
                collect_activations(llm, bad, **kw)
    finally:
        close_llm(llm)
    return acts


@pytest.fixture(scope="module")
def extracted(captured):
    from vllm_xmix.extract import diff_of_means, fit_probe

    L = STEER_LAYER
    caa = diff_of_means(captured[("code", "train")][L], captured[("prose", "train")][L])
    probe = fit_probe(captured[("code", "train")][L], captured[("prose", "train")][L],
                      captured[("code", "held")][L], captured[("prose", "held")][L])
    cond = diff_of_means(captured[("code", "train")][1], captured[("prose", "train")][1])
    cond = cond / np.linalg.norm(cond)

    def prompt_cos(per_prompt):
        return np.array([np.mean(a @ cond / np.linalg.norm(a, axis=1)) for a in per_prompt])

    thr = float((prompt_cos(captured[("code", "train")][1]).mean() + prompt_cos(captured[("prose", "train")][1]).mean()) / 2)
    return {"caa": caa, "probe": probe, "cond": cond, "thr": thr}


@pytest.fixture(scope="module")
def apps_llm(two_style, extracted):
    from vllm_xmix import deploy
    from vllm_xmix.apps import cast, seal, single_layer_steering

    model, _ = two_style
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    newline = [i for i in range(len(tok)) if "\n" in tok.decode([i])]
    e = extracted
    apps = [single_layer_steering(e["caa"], STEER_LAYER, name="to_code"),
            e["probe"].app("style_probe", STEER_LAYER),
            cast(e["cond"], 1, e["thr"], -e["caa"], [STEER_LAYER], report=True, name="code_to_prose"),
            seal(e["caa"], newline, [STEER_LAYER], scale=8.0, name="seal_code")]
    llm = make_llm(model, "eager", max_model_len=512, additional_config=deploy(*apps))
    llm.newline = set(newline)
    yield llm
    close_llm(llm)


def test_captures_equal_hf_hidden_states(two_style, captured):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_xmix.extract import diff_of_means

    model, texts = two_style
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    ref = {}
    seen = {}
    # the output of decoder layer L, blocks.L.hook_resid_post (HF's last hidden_states entry is
    # after the final norm, so a forward hook rather than output_hidden_states)
    handles = [hf.model.layers[L].register_forward_hook(
        lambda m, a, out, L=L: seen.__setitem__(L, (out[0] if isinstance(out, tuple) else out)[0].numpy().copy()))
        for L in LAYERS]
    with torch.no_grad():
        for s in ("code", "prose"):
            for i, t in enumerate(texts[s]["train"][:6]):
                hf(torch.tensor([tok(t)["input_ids"]]))
                for L in LAYERS:
                    got = captured[(s, "train")][L][i]
                    want = seen[L][1:]
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
                    ref.setdefault((s, L), []).append(want)
    for h in handles:
        h.remove()
    for L in LAYERS:
        got = diff_of_means(captured[("code", "train")][L][:6], captured[("prose", "train")][L][:6])
        np.testing.assert_allclose(got, diff_of_means(ref[("code", L)], ref[("prose", L)]), rtol=1e-4, atol=1e-4)


def _style(llm, prompts, apps, n=8, seed0=0):
    """Mean code share over ``n`` sampled continuations (temperature 0.8, 48 tokens) per prompt."""
    from vllm_xmix import SamplingParams
    from vllm_xmix.models import code_share

    sps = [SamplingParams(temperature=0.8, max_tokens=48, seed=seed0 + i, mi_apps=apps or None)
           for _ in prompts for i in range(n)]
    outs = llm.generate([p for p in prompts for _ in range(n)], sps, use_tqdm=False)
    return float(np.mean([code_share(o.outputs[0].text) for o in outs]))


def test_steering_moves_the_style(apps_llm):
    off = _style(apps_llm, PROSE_PROMPTS, [])
    on = _style(apps_llm, PROSE_PROMPTS, ["to_code"])
    assert on - off >= 0.5, (off, on)
    off_c = _style(apps_llm, CODE_PROMPTS, [])
    away = _style(apps_llm, CODE_PROMPTS, [{"name": "to_code", "scale": -1.0}])
    assert off_c - away >= 0.5, (off_c, away)


def test_probe_accuracy_through_the_read_path(two_style, apps_llm, extracted):
    from vllm_xmix import SamplingParams

    _, texts = two_style
    assert extracted["probe"].held_out_accuracy >= 0.95  # scikit-learn's own held-out score
    right = total = 0
    for style, label in (("code", 1), ("prose", 0)):
        outs = apps_llm.generate(texts[style]["held"], SamplingParams(temperature=0, max_tokens=1,
                                                                        mi_apps=["style_probe"]), use_tqdm=False)
        for o in outs:
            p = o.mi_results["style_probe"]["probe"][1:len(o.prompt_token_ids)]  # prompt positions after BOS
            right += int(((p > 0.5) == label).sum())
            total += len(p)
    assert total > 3000
    assert right / total >= 0.95, right / total


def test_cast_decides_by_the_prompts_style(two_style, apps_llm, extracted):
    from vllm_xmix import SamplingParams

    _, texts = two_style
    prompts = {s: [t[:160] for t in texts[s]["held"][:8]] for s in ("code", "prose")}
    for style, code in (("code", True), ("prose", False)):
        on = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, mi_apps=["code_to_prose"])
        off = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        a = apps_llm.generate(prompts[style], on, use_tqdm=False)
        b = apps_llm.generate(prompts[style], off, use_tqdm=False)
        changed = 0
        for x, y in zip(a, b):
            sim = x.mi_results["code_to_prose"]["similarity"][: len(x.prompt_token_ids)]
            assert (float(sim.mean()) > extracted["thr"]) == code, (style, float(sim.mean()), extracted["thr"])
            changed += list(x.outputs[0].token_ids) != list(y.outputs[0].token_ids)
        if code:
            assert changed >= len(a) // 2, changed  # steered away from code
        else:
            assert changed == 0  # decided against: generated exactly as with the app off


def test_seal_changes_nothing_before_its_trigger(two_style, apps_llm):
    from vllm_xmix import SamplingParams

    _, texts = two_style
    prompts = [t[:120] for t in texts["prose"]["held"][:8]]
    on = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, mi_apps=["seal_code"])
    off = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    a = apps_llm.generate(prompts, on, use_tqdm=False)
    b = apps_llm.generate(prompts, off, use_tqdm=False)
    triggered = differs = 0
    for x, y in zip(a, b):
        t_on, t_off = list(x.outputs[0].token_ids), list(y.outputs[0].token_ids)
        first = next((j for j, t in enumerate(t_off) if t in apps_llm.newline), None)
        if first is None or first == len(t_off) - 1:
            assert t_on == t_off  # no trigger fed back: nothing steered
            continue
        triggered += 1
        assert t_on[: first + 1] == t_off[: first + 1]  # up to and including the trigger token
        differs += t_on != t_off
    assert triggered >= 2 and differs >= 1, (triggered, differs)
