"""Steering vectors and probes from the product's own captures: capture -> extract -> deploy.

The workflow runs on vLLM itself, with no second framework:

1. :func:`capture_app` declares a ``capture`` read (every processed position) at the layers of
   interest; deploy it and :func:`collect_activations` runs a list of prompts through the engine
   and returns the residual stream per layer and prompt (``[positions, d_model]`` float32).
2. Extraction on those arrays:

   * :func:`diff_of_means`: mean of the positive set minus mean of the negative set per layer
     (contrastive activation addition, CAA: Rimsky et al. 2024; the refusal direction of Arditi
     et al. 2024 is the same computation on harmful / harmless prompts);
   * :func:`pca_of_differences`: the first principal component of paired differences, oriented
     so that positives project higher (repeng's ``pca_diff``; Zou et al. 2023, representation
     engineering);
   * :func:`fit_probe`: a logistic-regression probe (scikit-learn) with its held-out accuracy
     (Orgad et al. 2025 train such probes on hidden states for truthfulness).

3. :func:`save_vectors` / :func:`load_vectors` keep per-layer vectors in safetensors (also read:
   repeng / llama.cpp GGUF control vectors, ``.npz`` and JSON dicts); :func:`steering_app` turns
   a per-layer dict into one app; :meth:`LinearProbe.app` turns a probe into a read app.

Arrays are float32 numpy; layers are 0-based decoder-layer indices; activations are
``blocks.{L}.{hook}`` values in the model's units (the residual stream for ``hook_resid_*``).
"""

from __future__ import annotations

import json
import numbers
import os
import reprlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .spec import MIApp, XmixSpecError

CAPTURE_NAME = "acts"


# ------------------------------------------------------------------------------ capture


def capture_app(layers: Sequence[int] | int, hook: str = "hook_resid_post", name: str = "capture") -> MIApp:
    """An app that captures ``blocks.{L}.{hook}`` at every processed position for each ``L`` in
    ``layers`` (result key :data:`CAPTURE_NAME`). Deploy it beside the others and pass its name
    to :func:`collect_activations`. A capture of every position reads the prompt, so its
    requests never take the prompt from the prefix cache."""
    app = MIApp(name)
    app.read("capture", positions="all", name=CAPTURE_NAME).layers(layers).submodule(hook)
    return app


def collect_activations(llm, prompts: Sequence, app: str = "capture", *, skip_first: int = 1,
                        **request) -> dict[int, list[np.ndarray]]:
    """Run ``prompts`` (strings or ``{"prompt_token_ids": [...]}``) through ``llm`` (a
    ``vllm.LLM`` with :func:`capture_app` ``app`` deployed), one generated token each, and return
    ``{layer: [array [P_i - skip_first, d_model] float32 per prompt]}``: the prompt positions'
    activations, without the first ``skip_first`` (the BOS position carries no content).
    ``request``: more ``mi_apps`` for these requests (``apps=[...]``, e.g. a steering app to
    capture under).

    Raises:
        XmixSpecError: ``app`` returned no capture (not deployed, or not a capture app); a prompt
            of no more than ``skip_first`` tokens (it would give no positions); ``skip_first``
            not an integer >= 0; ``prompts`` or ``apps`` one string or one dict rather than a list
            of them (a string would otherwise run as one prompt per character)."""
    from .sampling_params import SamplingParams

    extra = request.pop("apps", [])
    for what, v, example in (("prompts", prompts, "[text]"), ("apps", extra, "['name']")):
        if isinstance(v, (str, bytes, dict)):
            raise XmixSpecError(f"collect_activations: {what} is one {type(v).__name__} ({reprlib.repr(v)}); pass a list "
                                f"of them, e.g. {example}")
    sel = [app, *extra]
    if request:
        raise TypeError(f"collect_activations: unexpected arguments {sorted(request)}")
    if not isinstance(skip_first, numbers.Integral) or isinstance(skip_first, bool) or skip_first < 0:
        raise XmixSpecError(f"collect_activations: skip_first={skip_first!r}: expected an integer >= 0")
    sp = SamplingParams(temperature=0.0, max_tokens=1, mi_apps=sel)
    outs = llm.generate(list(prompts), sp, use_tqdm=False)
    per: dict[int, list[np.ndarray]] = {}
    for i, o in enumerate(outs):
        res = (o.mi_results or {}).get(app, {}).get(CAPTURE_NAME)
        if res is None:
            raise XmixSpecError(f"collect_activations: app {app!r} returned no {CAPTURE_NAME!r} capture; deploy "
                                "vllm_xmix.extract.capture_app(...) under that name")
        if not isinstance(res, dict):  # one layer: the array itself
            layers = [r for r in _capture_layers(llm, app)]
            res = {layers[0]: res}
        P = len(o.prompt_token_ids)
        if P <= skip_first:
            raise XmixSpecError(f"collect_activations: prompt {i} has {P} tokens, and skip_first={skip_first} leaves "
                                "none of its positions; lower skip_first or leave the prompt out")
        for layer, arr in res.items():
            per.setdefault(int(layer), []).append(np.asarray(arr[skip_first:P], dtype=np.float32))
    return per


def _capture_layers(llm, app: str) -> list[int]:
    """The layers of ``app``'s capture in ``llm``'s deployment."""
    from .spec import CONFIG_KEY, parse_deployment

    add = llm.llm_engine.vllm_config.additional_config
    dep = parse_deployment(add[CONFIG_KEY])
    for op in dep.app(app).ops:
        if op.primitive == "read" and op.kind == "capture":
            return list(op.layers) if op.layers != "all" else []
    return []


def _stack(x) -> np.ndarray:
    """``[N, d]`` float64 from an array or a list of ``[n_i, d]`` arrays."""
    if isinstance(x, (str, bytes, Mapping)) or not isinstance(x, (np.ndarray, list, tuple)):
        raise XmixSpecError(f"extract: expected activations [N, d_model] (an array or a list of arrays), "
                            f"got {type(x).__name__}")
    if isinstance(x, np.ndarray):
        a = x
    else:
        parts = [np.asarray(v) for v in x]
        if not parts:
            raise XmixSpecError("extract: an empty set of activations")
        if any(v.ndim != 2 for v in parts) or len({v.shape[1] for v in parts}) != 1:
            raise XmixSpecError(f"extract: expected a list of [n_i, d_model] arrays of one width, got shapes "
                                f"{[list(v.shape) for v in parts][:4]}")
        a = np.concatenate(parts)
    if a.dtype.kind not in "fiu":
        raise XmixSpecError(f"extract: activations must be real numbers, got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] == 0:
        raise XmixSpecError(f"extract: expected activations [N, d_model] with N > 0, got shape {list(a.shape)}")
    if not np.isfinite(a).all():
        raise XmixSpecError("extract: the activations contain NaN or inf")
    return a.astype(np.float64)


def _per_layer(pos, neg) -> list[tuple[int | None, object, object]]:
    if isinstance(pos, Mapping) != isinstance(neg, Mapping):
        raise XmixSpecError("extract: give both sets as {layer: activations} or both as arrays")
    if isinstance(pos, Mapping):
        for k in list(pos) + list(neg):
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                raise XmixSpecError(f"extract: layer keys must be non-negative integers, got {k!r}")
        if set(pos) != set(neg):
            raise XmixSpecError(f"extract: the two sets cover different layers ({sorted(pos)} vs {sorted(neg)})")
        return [(int(layer), pos[layer], neg[layer]) for layer in sorted(pos)]
    return [(None, pos, neg)]


# ------------------------------------------------------------------------------ extraction


def diff_of_means(pos, neg) -> dict[int, np.ndarray] | np.ndarray:
    """Mean of ``pos`` minus mean of ``neg`` (CAA, Rimsky et al. 2024). Each is ``[N, d_model]``
    (or a list of ``[n_i, d_model]``), or ``{layer: that}`` for a vector per layer (then a dict
    is returned). Returns float32 ``[d_model]`` per layer, in activation units (adding it at
    scale 1 moves a negative example's mean onto the positive one's).

    Raises:
        XmixSpecError: empty sets, widths that differ, NaN/inf, or sets over different layers."""
    out = {}
    for layer, p, n in _per_layer(pos, neg):
        P, N = _stack(p), _stack(n)
        if P.shape[1] != N.shape[1]:
            raise XmixSpecError(f"diff_of_means: widths differ ({P.shape[1]} vs {N.shape[1]})")
        out[layer] = (P.mean(0) - N.mean(0)).astype(np.float32)
    return out[None] if None in out else out


def pca_of_differences(pos, neg, center: bool = True) -> dict[int, np.ndarray] | np.ndarray:
    """The first principal component of the paired differences ``pos[i] - neg[i]``, a unit
    vector oriented so that positives project higher than their negatives for most pairs.
    ``center=True`` (default) is repeng's ``pca_diff``: the differences are centred first, so the
    component is the main axis along which the pairs' differences *vary* (it can be nearly
    orthogonal to the mean difference when every pair differs the same way); ``center=False``
    takes the top singular vector of the raw differences, which the mean difference dominates
    when it is large. Sets as in :func:`diff_of_means`, rows paired (the same count). Returns
    float32 ``[d_model]``, norm 1, per layer: scale it to the activations' size to steer.

    Raises:
        XmixSpecError: unpaired sets (row counts differ), fewer than 2 pairs, NaN/inf."""
    out = {}
    for layer, p, n in _per_layer(pos, neg):
        P, N = _stack(p), _stack(n)
        if P.shape != N.shape:
            raise XmixSpecError(f"pca_of_differences: the sets must be paired row by row, got shapes "
                                f"{list(P.shape)} and {list(N.shape)}")
        if P.shape[0] < 2:
            raise XmixSpecError("pca_of_differences: need at least 2 pairs")
        D = P - N
        M = D - D.mean(0) if center else D
        if np.linalg.norm(M) <= 1e-6 * np.linalg.norm(D):  # (also when D is all zero)
            raise XmixSpecError("pca_of_differences: the differences " + ("do not vary (every pair differs the "
                                "same way: use diff_of_means, or center=False)" if center and np.any(D) else
                                "are all zero: the two sets are identical"))
        _, _, vt = np.linalg.svd(M, full_matrices=False)
        v = vt[0]
        if np.mean(P @ v > N @ v) < 0.5:
            v = -v
        out[layer] = (v / np.linalg.norm(v)).astype(np.float32)
    return out[None] if None in out else out


@dataclass(frozen=True)
class LinearProbe:
    """A logistic-regression probe: ``p = sigmoid(x . weight + bias)``, ``x`` the activation at
    ``layer`` (``weight`` float32 ``[d_model]``). Accuracies are shares (0..1) of examples
    classified right at threshold 0.5 (``held_out_accuracy``: None if no held-out set)."""

    weight: np.ndarray
    bias: float
    train_accuracy: float
    held_out_accuracy: float | None
    n_train: int
    n_held_out: int

    def app(self, name: str, layer: int, hook: str = "hook_resid_post") -> MIApp:
        """A read app scoring every processed position (``mi_results[name]["probe"]``, ``[P + G - 1]``
        float32 probabilities) with this probe at ``blocks.{layer}.{hook}``."""
        app = MIApp(name)
        app.read("linear_probe", weight=self.weight, bias=float(self.bias), sigmoid=True).layers([int(layer)]) \
            .submodule(hook)
        return app

    def predict(self, x) -> np.ndarray:
        """Probabilities ``[N]`` float32 for activations ``x`` ``[N, d_model]`` (XmixSpecError:
        another width)."""
        X = _stack(x)
        if X.shape[1] != self.weight.shape[0]:
            raise XmixSpecError(f"LinearProbe.predict: width {X.shape[1]} != the probe's {self.weight.shape[0]}")
        return (1.0 / (1.0 + np.exp(-(X @ self.weight + self.bias)))).astype(np.float32)


def fit_probe(pos, neg, held_pos=None, held_neg=None, *, C: float = 1.0, max_iter: int = 2000,
              seed: int = 0) -> LinearProbe:
    """Fit a logistic-regression probe (scikit-learn ``LogisticRegression``, L2 penalty ``C``)
    that scores ``pos`` activations 1 and ``neg`` 0 (each ``[N, d_model]`` or a list of
    ``[n_i, d_model]``); ``held_pos`` / ``held_neg``: held-out sets for the reported accuracy
    (give examples from documents not in the training sets).

    Raises:
        XmixSpecError: empty sets, NaN/inf, or only one held-out set given.
        ImportError: scikit-learn is not installed (``pip install vllm-xmix[extract]``)."""
    from sklearn.linear_model import LogisticRegression

    P, N = _stack(pos), _stack(neg)
    if P.shape[1] != N.shape[1]:
        raise XmixSpecError(f"fit_probe: widths differ ({P.shape[1]} vs {N.shape[1]})")
    X = np.concatenate([P, N])
    y = np.r_[np.ones(len(P)), np.zeros(len(N))]
    clf = LogisticRegression(C=C, max_iter=max_iter, random_state=seed).fit(X, y)
    held = None
    n_held = 0
    if (held_pos is None) != (held_neg is None):
        raise XmixSpecError("fit_probe: give both held-out sets or neither")
    if held_pos is not None:
        HP, HN = _stack(held_pos), _stack(held_neg)
        if {HP.shape[1], HN.shape[1]} != {P.shape[1]}:
            raise XmixSpecError(f"fit_probe: held-out widths {HP.shape[1]}, {HN.shape[1]} differ from the training "
                                f"width {P.shape[1]}")
        Xh = np.concatenate([HP, HN])
        yh = np.r_[np.ones(len(HP)), np.zeros(len(HN))]
        held = float((clf.predict(Xh) == yh).mean())
        n_held = len(yh)
    return LinearProbe(weight=clf.coef_[0].astype(np.float32), bias=float(clf.intercept_[0]),
                       train_accuracy=float((clf.predict(X) == y).mean()), held_out_accuracy=held,
                       n_train=len(y), n_held_out=n_held)


# ------------------------------------------------------------------------------ files


def save_vectors(path: str | os.PathLike, vectors: Mapping[int, np.ndarray],
                 metadata: Mapping[str, str] | None = None) -> None:
    """Write per-layer vectors to a safetensors file: tensor ``"layer.{L}"`` float32
    ``[d_model]`` per layer ``L``, with string ``metadata``. A ``.gguf`` path writes a
    llama.cpp / repeng control vector instead (:func:`save_control_vector`).

    Raises:
        XmixSpecError: no vectors, a non-integer layer, vectors not 1-D or of different widths, a
        path not ending in ``.safetensors`` / ``.gguf``."""
    vecs = _checked_vectors(vectors, "save_vectors")
    p = _path(path, "save_vectors")
    if p.endswith(".gguf"):
        return save_control_vector(p, vecs, model_hint=(metadata or {}).get("model_hint", "llama"))
    if not p.endswith(".safetensors"):
        raise XmixSpecError(f"save_vectors: {p}: write .safetensors or .gguf (other formats are read only)")
    from safetensors.numpy import save_file

    save_file({f"layer.{L}": v for L, v in vecs.items()}, p, metadata=dict(metadata or {}))


def save_control_vector(path: str | os.PathLike, vectors: Mapping[int, np.ndarray], model_hint: str = "llama") -> None:
    """Write a GGUF control vector the way repeng exports them for llama.cpp: architecture
    ``controlvector``, ``controlvector.model_hint``, ``controlvector.layer_count``, tensor
    ``direction.{L}`` float32 ``[d_model]`` per layer (llama.cpp adds it to the output of layer
    ``L``, i.e. ``blocks.{L}.hook_resid_post``)."""
    import gguf

    vecs = _checked_vectors(vectors, "save_control_vector")
    w = gguf.GGUFWriter(os.fspath(path), "controlvector")
    w.add_string("controlvector.model_hint", model_hint)
    w.add_uint32("controlvector.layer_count", len(vecs))
    for L, v in vecs.items():
        w.add_tensor(f"direction.{L}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_vectors(path: str | os.PathLike) -> dict[int, np.ndarray]:
    """Per-layer vectors from a file, ``{layer: float32 [d_model]}``:

    * ``.gguf``: a repeng / llama.cpp control vector (tensors ``direction.{L}``);
    * ``.safetensors``: tensors ``layer.{L}`` (:func:`save_vectors`) or named by the layer number;
    * ``.npz``: arrays named ``layer.{L}`` or ``{L}``;
    * ``.json``: ``{"L": [floats], ...}``.

    Raises:
        XmixSpecError: an unknown extension, a key that names no layer, vectors not 1-D, of
        different widths, or with NaN/inf; FileNotFoundError: no such file."""
    p = _path(path, "load_vectors")
    if not os.path.exists(p):
        raise FileNotFoundError(f"load_vectors: no such file {p!r}")
    if not p.endswith((".gguf", ".safetensors", ".npz", ".json")):
        raise XmixSpecError(f"load_vectors: {p}: unknown file type (expected .gguf, .safetensors, .npz or .json)")
    try:
        items = _read_items(p)
    except XmixSpecError:
        raise
    except Exception as e:  # a damaged or foreign file: what the format's reader said
        raise XmixSpecError(f"load_vectors: {p}: not a readable {p.rsplit('.', 1)[-1]} file ({type(e).__name__}: "
                            f"{e})") from None
    out: dict[int, np.ndarray] = {}
    for name, key, v in items:
        if not (key.isascii() and key.isdigit() and str(int(key)) == key):
            raise XmixSpecError(f"load_vectors: {p}: {name!r} names no layer (expected 'layer.N' or 'N')")
        if int(key) in out:
            raise XmixSpecError(f"load_vectors: {p}: layer {key} is given twice")
        out[int(key)] = v
    return _checked_vectors(out, f"load_vectors: {p}")


def _path(path, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise XmixSpecError(f"{where}: expected a file path (str or os.PathLike), got {type(path).__name__}")
    return os.fspath(path)


def _read_items(p: str) -> list[tuple[str, str, np.ndarray]]:
    """(name in the file, layer key, array) of every vector in ``p``; arrays as stored (the
    1-D check follows in :func:`_checked_vectors`)."""
    if p.endswith(".gguf"):
        import gguf

        out = []
        for t in gguf.GGUFReader(p).tensors:
            if not t.name.startswith("direction."):
                raise XmixSpecError(f"load_vectors: {p}: tensor {t.name!r} is not a control-vector direction "
                                    "('direction.{layer}')")
            if len([n for n in t.shape if int(n) != 1]) > 1:
                raise XmixSpecError(f"load_vectors: {p}: {t.name} has shape {[int(n) for n in t.shape]}, not a vector")
            out.append((t.name, t.name[len("direction."):], np.asarray(t.data, dtype=np.float32).reshape(-1)))
        return out
    if p.endswith(".safetensors"):
        from safetensors.numpy import load_file

        return [(k, k.removeprefix("layer."), v) for k, v in load_file(p).items()]
    if p.endswith(".npz"):
        with np.load(p, allow_pickle=False) as z:
            return [(k, k.removeprefix("layer."), z[k]) for k in z.files]
    with open(p) as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise XmixSpecError(f"load_vectors: {p}: expected a JSON object {{layer: [floats]}}")
    return [(k, k, np.asarray(v, dtype=np.float64)) for k, v in obj.items()]


def _checked_vectors(vectors: Mapping[int, np.ndarray], where: str) -> dict[int, np.ndarray]:
    if not vectors:
        raise XmixSpecError(f"{where}: no vectors")
    out, width = {}, None
    for L in vectors:
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 0:
            raise XmixSpecError(f"{where}: layer {L!r} is not a non-negative integer")
    for L in sorted(vectors):
        try:
            v = np.asarray(vectors[L])
        except (TypeError, ValueError) as e:
            raise XmixSpecError(f"{where}: layer {L}: not an array of numbers ({e})") from None
        if v.ndim != 1 or v.dtype.kind not in "fiu":
            raise XmixSpecError(f"{where}: layer {L}: expected a 1-D real vector, got shape {list(v.shape)} "
                                f"dtype {v.dtype}")
        if not np.isfinite(v).all():
            raise XmixSpecError(f"{where}: layer {L}: the vector contains NaN or inf")
        if width is not None and v.shape[0] != width:
            raise XmixSpecError(f"{where}: layer {L} has width {v.shape[0]}, others {width}")
        width = v.shape[0]
        out[int(L)] = v.astype(np.float32)
    return out


def steering_app(name: str, vectors: Mapping[int, np.ndarray] | str | os.PathLike, scale: float = 1.0,
                 hook: str = "hook_resid_post", layers: Iterable[int] | None = None) -> MIApp:
    """One app that adds ``scale * vectors[L]`` at ``blocks.{L}.{hook}`` for every layer ``L`` of
    a per-layer dict or file (:func:`load_vectors`: a GGUF control vector applies as llama.cpp
    applies it, at the output of each layer). ``layers``: keep only these. A request's
    ``{"name": ..., "scale": s}`` scales every layer's vector; ``"layers": [...]`` picks a
    subset. Each layer is one add op of the app (a vector per layer).

    Raises:
        XmixSpecError: no vectors left, or a bad file (see :func:`load_vectors`)."""
    if isinstance(vectors, (str, os.PathLike)):
        vecs = load_vectors(vectors)
    elif isinstance(vectors, Mapping):
        vecs = _checked_vectors(vectors, name)
    else:
        raise XmixSpecError(f"steering_app {name!r}: vectors must be a {{layer: vector}} dict or a file path, got "
                            f"{type(vectors).__name__}")
    if layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, range, set)):
            raise XmixSpecError(f"steering_app {name!r}: layers must be a list of integers, got {layers!r}")
        keep = set()
        for x in layers:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise XmixSpecError(f"steering_app {name!r}: layers entry {x!r} is not an integer")
            keep.add(int(x))
        missing = keep - set(vecs)
        if missing:
            raise XmixSpecError(f"steering_app {name!r}: no vector for layers {sorted(missing)} "
                                f"(vectors for {sorted(vecs)})")
        vecs = {L: v for L, v in vecs.items() if L in keep}
        if not vecs:
            raise XmixSpecError(f"steering_app {name!r}: layers=[] leaves no vector")
    app = MIApp(name)
    for L, v in vecs.items():
        app.write("add", vector=v, scale=scale).layers([L]).submodule(hook)
    return app


__all__ = ["CAPTURE_NAME", "capture_app", "collect_activations", "diff_of_means", "pca_of_differences",
           "LinearProbe", "fit_probe", "save_vectors", "save_control_vector", "load_vectors", "steering_app"]
