"""vllm_xmix.extract: the extraction maths against independent references, the vector files
(safetensors, GGUF control vectors as repeng writes them, npz, JSON), their errors, and a GGUF
control vector deployed with steering_app against HF hooks (CPU, real vLLM, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import D_MODEL, PROMPTS, close_llm, make_llm


def _sets(seed=0, n=40, d=16):
    rng = np.random.default_rng(seed)
    shift = rng.standard_normal(d)
    neg = rng.standard_normal((n, d))
    pos = neg + shift + 0.1 * rng.standard_normal((n, d))
    return pos, neg, shift


def test_diff_of_means_per_layer_and_lists():
    from vllm_xmix.extract import diff_of_means

    pos, neg, _ = _sets()
    want = pos.mean(0) - neg.mean(0)
    np.testing.assert_allclose(diff_of_means(pos, neg), want, rtol=1e-6, atol=1e-6)
    got = diff_of_means({3: [pos[:10], pos[10:]], 5: pos}, {3: [neg], 5: neg})  # lists of per-prompt arrays
    assert set(got) == {3, 5} and got[3].dtype == np.float32
    np.testing.assert_allclose(got[3], want, rtol=1e-6, atol=1e-6)


def test_pca_of_differences_matches_sklearn_and_is_oriented():
    from sklearn.decomposition import PCA

    from vllm_xmix.extract import pca_of_differences

    pos, neg, shift = _sets(1)
    for a, b in ((pos, neg), (neg, pos)):
        v = pca_of_differences(a, b)
        ref = PCA(n_components=1).fit(a - b).components_[0]
        assert abs(abs(float(v @ ref)) - 1.0) < 1e-5  # the same axis, unit norm
        assert np.mean(a @ v > b @ v) > 0.5  # oriented: the first set projects higher
    raw = pca_of_differences(pos, neg, center=False)  # uncentred: the shared shift dominates
    assert float(raw @ shift) / np.linalg.norm(shift) > 0.99
    from vllm_xmix import XmixSpecError

    with pytest.raises(XmixSpecError, match="paired"):
        pca_of_differences(pos, neg[:-1])
    with pytest.raises(XmixSpecError, match="identical"):
        pca_of_differences(pos, pos)
    with pytest.raises(XmixSpecError, match="do not vary"):
        pca_of_differences(neg + shift, neg)


def test_fit_probe_held_out_accuracy():
    from vllm_xmix.extract import fit_probe

    pos, neg, _ = _sets(2, n=200)
    p = fit_probe(pos[:150], neg[:150], pos[150:], neg[150:])
    assert p.held_out_accuracy is not None and p.held_out_accuracy > 0.95 and p.n_held_out == 100
    # the read kernel's formula (sigmoid(x . w + b)) on the held-out rows gives the same classes
    x = np.concatenate([pos[150:], neg[150:]])
    y = np.r_[np.ones(50), np.zeros(50)]
    assert np.mean((1 / (1 + np.exp(-(x @ p.weight + p.bias))) > 0.5) == y) == p.held_out_accuracy
    from vllm_xmix import XmixSpecError

    with pytest.raises(XmixSpecError, match="both held-out"):
        fit_probe(pos, neg, pos)


@pytest.mark.parametrize("ext", ["safetensors", "gguf", "npz", "json"])
def test_vector_files_round_trip(tmp_path, ext):
    from vllm_xmix.extract import load_vectors, save_vectors

    rng = np.random.default_rng(3)
    vecs = {0: rng.standard_normal(8).astype(np.float32), 2: rng.standard_normal(8).astype(np.float32)}
    path = tmp_path / f"v.{ext}"
    if ext in ("safetensors", "gguf"):
        save_vectors(path, vecs)
    elif ext == "npz":
        np.savez(path, **{f"layer.{k}": v for k, v in vecs.items()})
    else:
        path.write_text(json.dumps({str(k): v.tolist() for k, v in vecs.items()}))
    got = load_vectors(path)
    assert sorted(got) == [0, 2]
    for k in vecs:
        np.testing.assert_array_equal(got[k], vecs[k])


def test_gguf_is_a_control_vector_as_repeng_writes_it(tmp_path):
    """The file is what llama.cpp reads: architecture controlvector, its two keys, direction.N."""
    import gguf

    from vllm_xmix.extract import save_control_vector

    path = tmp_path / "cv.gguf"
    save_control_vector(path, {1: np.ones(4, np.float32), 3: np.full(4, 2.0, np.float32)}, model_hint="llama")
    r = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in r.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(fields["controlvector.model_hint"].parts[-1]).decode() == "llama"
    assert int(fields["controlvector.layer_count"].parts[-1][0]) == 2
    assert sorted(t.name for t in r.tensors) == ["direction.1", "direction.3"]


def test_vector_file_errors(tmp_path):
    from vllm_xmix import XmixSpecError
    from vllm_xmix.extract import load_vectors, save_vectors, steering_app

    with pytest.raises(FileNotFoundError):
        load_vectors(tmp_path / "missing.gguf")
    (tmp_path / "v.txt").write_text("1 2 3")
    with pytest.raises(XmixSpecError, match="unknown file type"):
        load_vectors(tmp_path / "v.txt")
    (tmp_path / "bad.json").write_text(json.dumps({"x": [1.0]}))
    with pytest.raises(XmixSpecError, match="names no layer"):
        load_vectors(tmp_path / "bad.json")
    (tmp_path / "w.json").write_text(json.dumps({"0": [1.0, 2.0], "1": [1.0]}))
    with pytest.raises(XmixSpecError, match="width"):
        load_vectors(tmp_path / "w.json")
    (tmp_path / "nan.json").write_text(json.dumps({"0": [1.0, float("nan")]}))
    with pytest.raises(XmixSpecError, match="NaN"):
        load_vectors(tmp_path / "nan.json")
    with pytest.raises(XmixSpecError, match="no vectors"):
        save_vectors(tmp_path / "e.safetensors", {})
    with pytest.raises(XmixSpecError, match=r"no vector for layers \[5\]"):
        steering_app("s", {0: np.ones(4)}, layers=[5])
    with pytest.raises(XmixSpecError, match="layers must be a list of integers"):
        steering_app("s", {0: np.ones(4), 2: np.ones(4)}, layers="02")  # never read as layers 0 and 2
    with pytest.raises(XmixSpecError, match="write .safetensors or .gguf"):
        save_vectors(tmp_path / "v.json", {0: np.ones(4)})  # would write safetensors bytes under .json
    from safetensors.numpy import save_file

    save_file({"layer.1": np.ones(4, np.float32), "1": np.ones(4, np.float32)}, str(tmp_path / "dup.safetensors"))
    with pytest.raises(XmixSpecError, match="layer 1 is given twice"):
        load_vectors(tmp_path / "dup.safetensors")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(XmixSpecError, match="not a readable gguf file"):
        load_vectors(tmp_path / "junk.gguf")


@pytest.mark.one_version
def test_gguf_control_vector_deployed_equals_hf(tiny_llama, hf, tmp_path):
    """A control vector file applies as llama.cpp applies it: direction.L added at the output of
    layer L, scaled per request."""
    from vllm_xmix import SamplingParams, deploy
    from vllm_xmix.extract import save_vectors, steering_app

    rng = np.random.default_rng(4)
    vecs = {1: 3 * rng.standard_normal(D_MODEL).astype(np.float32),
            3: 3 * rng.standard_normal(D_MODEL).astype(np.float32)}
    path = tmp_path / "cv.gguf"
    save_vectors(path, vecs)
    llm = make_llm(tiny_llama, "eager", additional_config=deploy(steering_app("cv", path)))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2,
                            [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, mi_apps=["cv"])] * 4 +
                            [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                            mi_apps=[{"name": "cv", "scale": -0.5}])] * 4, use_tqdm=False)
    finally:
        close_llm(llm)
    for i, p in enumerate(PROMPTS):
        assert list(outs[i].outputs[0].token_ids) == hf.greedy(p, 6, deltas=vecs)
        half = {k: np.float32(-0.5) * v for k, v in vecs.items()}
        assert list(outs[4 + i].outputs[0].token_ids) == hf.greedy(p, 6, deltas=half)
    assert [list(o.outputs[0].token_ids) for o in outs[:4]] != [hf.greedy(p, 6) for p in PROMPTS]
