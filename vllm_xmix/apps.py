"""The paper's seven MI apps (Table 1 of the xMIx paper, Blum et al.), one constructor each.

Each returns an :class:`~vllm_xmix.MIApp` to deploy (``deploy(app, ...)``) and switch on per
request (``SamplingParams(mi_apps=[name])``). Vectors are float arrays ``[d_model]`` (numpy,
torch, lists) or file paths; layers are 0-based decoder-layer indices. The vectors themselves
come from :mod:`vllm_xmix.extract` (difference of means, PCA of paired differences, logistic
probes) or from files (GGUF control vectors, safetensors).

| # | app | paper | primitive | trigger | target |
|---|---|---|---|---|---|
| 1 | :func:`refusal_ablation` | Arditi et al. 2024 | write (ablate) | unconditional | every layer |
| 2 | :func:`seal` | Chen et al. 2025 | conditional write (add) | current token | chosen layers |
| 3 | :func:`cast` | Lee et al. 2025 | conditional write (add) | prompt activations | chosen layers |
| 4 | :func:`truthfulness_probe` | Orgad et al. 2025 | read (logistic probe) | – | one layer |
| 5 | :func:`single_layer_steering` | SAKE, Scialanga et al. 2025; CAA, Rimsky et al. 2024 | write (add) | unconditional | one layer |
| 6 | :func:`multi_layer_steering` | Stickland et al. 2024 | write (add) | unconditional | several layers |
| 7 | :func:`steer_moe` | Fayyaz et al. 2026 | write (router bias) | unconditional | router logits |
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from .spec import MIApp, XmixSpecError


def _index(x, what: str, field: str, lo: int = 0) -> int:
    """``x`` as an int >= ``lo``; bools, floats, strings and the like are refused by name."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise XmixSpecError(f"{what}: {field} must be an integer, got {type(x).__name__} {x!r}")
    if int(x) < lo:
        raise XmixSpecError(f"{what}: {field} must be >= {lo}, got {x}")
    return int(x)


def _indices(xs, what: str, field: str, allow_empty: bool = False) -> list[int]:
    """A list / tuple / range / 1-D array of non-negative ints (a string or a bare int is refused)."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, (list, tuple, range, np.ndarray)):
        raise XmixSpecError(f"{what}: {field} must be a list of integers, got {type(xs).__name__} {xs!r}")
    out = [_index(x, what, f"{field} entry") for x in (xs.tolist() if isinstance(xs, np.ndarray) else xs)]
    if not out and not allow_empty:
        raise XmixSpecError(f"{what}: no {field} given")
    return out


def _layers(layers, what: str) -> list[int] | str:
    if isinstance(layers, str) and layers == "all":
        return layers
    return _indices(layers, what, "layers")


def _flag(x, what: str, field: str) -> bool:
    if not isinstance(x, bool):
        raise XmixSpecError(f"{what}: {field} must be True or False, got {type(x).__name__} {x!r}")
    return x


def _number(x, what: str, field: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not math.isfinite(float(x)):
        raise XmixSpecError(f"{what}: {field} must be a finite number, got {type(x).__name__} {x!r}")
    return float(x)


def refusal_ablation(direction, n_layers: int, name: str = "refusal_ablation") -> MIApp:
    """Directional ablation of the refusal direction at every layer (Arditi et al. 2024, "Refusal
    in language models is mediated by a single direction").

    Primitive: write (``ablate``), unconditional, every token of the request. With ``r =
    direction / |direction|`` each of these becomes ``h - (h . r) r``: ``blocks.{L}.hook_resid_pre``
    and ``blocks.{L}.hook_resid_mid`` for every ``L < n_layers``, and the last layer's
    ``hook_resid_post``. So no component of the residual stream along ``r`` reaches any
    attention block, MLP or the final norm: exactly what the paper's *weight orthogonalisation*
    does (``W <- W - r r^T W`` for the token embedding and every matrix that writes to the stream:
    attention output and MLP down projections), since the ablated stream is the orthogonalised
    model's stream at every one of these points (tested against an HF model with orthogonalised
    weights). ``direction``: ``[d_model]`` (diff of means of harmful minus harmless prompts at
    the paper's chosen layer and position); ``n_layers``: the model's ``num_hidden_layers``.

    Raises:
        XmixSpecError: ``n_layers`` not an integer >= 1, or a bad vector."""
    n = _index(n_layers, name, "n_layers", lo=1)
    app = MIApp(name)
    app.write("ablate", vector=direction).layers("all").submodule("hook_resid_pre")
    app.write("ablate", vector=direction).layers("all").submodule("hook_resid_mid")
    app.write("ablate", vector=direction).layers([n - 1]).submodule("hook_resid_post")
    return app


def seal(vector, trigger_tokens: Sequence[int], layers, scale: float = 1.0, generated_only: bool = True,
         hook: str = "hook_resid_post", name: str = "seal") -> MIApp:
    """SEAL, token-triggered steering (Chen et al. 2025, "SEAL: steerable reasoning calibration
    of large language models for free").

    Primitive: conditional write (``add``). Trigger: the current (input) token is one of
    ``trigger_tokens`` (SEAL steers at the tokens that end a reasoning step, e.g. ``"\\n\\n"``).
    Target: ``blocks.{L}.{hook}`` for ``L`` in ``layers``. Semantics: ``h[t] += scale * vector``
    at every position ``t`` whose input token is a trigger, and nowhere else; with
    ``generated_only`` (default) only at generated positions, so the prompt's KV is untouched
    and keeps sharing the prefix cache. Later positions change only through attention to the
    steered ones.

    Raises:
        XmixSpecError: no trigger tokens, no layers, a bad vector."""
    tokens = _indices(trigger_tokens, name, "trigger_tokens")
    gen = _flag(generated_only, name, "generated_only")
    app = MIApp(name)
    op = app.write("add", vector=vector, scale=scale).layers(_layers(layers, name)).submodule(hook)
    op.cond(tokens=tokens, **({"positions": "generated"} if gen else {}))
    return app


def cast(condition_vector, condition_layer: int, threshold: float, vector, layers, scale: float = 1.0,
         op: str = ">", hook: str = "hook_resid_post", report: bool = False, name: str = "cast") -> MIApp:
    """CAST, conditional activation steering (Lee et al. 2025, "Programming refusal with
    conditional activation steering").

    Primitive: conditional write (``add``). Trigger: the prompt's activations: the cosine
    similarity of ``blocks.{condition_layer}.{hook}`` with ``condition_vector``, averaged over
    the prompt's tokens, compared by ``op`` with ``threshold``. Decided once the prompt has been
    processed (identical for every chunking of the prompt); then ``h[t] += scale * vector`` at
    ``blocks.{L}.{hook}`` for ``L`` in ``layers`` at every position from the last prompt token
    on (every generated token). A prompt that does not meet the condition is generated as with
    the app off. Condition reads stay on the device; with ``report`` the app also returns the
    per-position similarity, ``mi_results[name]["similarity"]`` float32 ``[P + G - 1]``, whose
    mean over the ``P`` prompt positions is the decided value (one more read at that layer).

    Raises:
        XmixSpecError: an unknown ``op``, a threshold that is not a number in [-1, 1] (a cosine),
        a layer that is not a non-negative integer, a bad vector."""
    cl = _index(condition_layer, name, "condition_layer")
    thr = _number(threshold, name, "threshold")
    if not -1.0 <= thr <= 1.0:
        raise XmixSpecError(f"{name}: threshold {thr} is outside [-1, 1], the range of a cosine similarity: "
                            "the condition would be decided the same way for every prompt")
    app = MIApp(name)
    app.read("cosine", weight=condition_vector, buffer="condition", scope="request").layers([cl]).submodule(hook)
    if _flag(report, name, "report"):
        app.read("cosine", weight=condition_vector, name="similarity").layers([cl]).submodule(hook)
    app.write("add", vector=vector, scale=scale).layers(_layers(layers, name)).submodule(hook).cond(
        buffer="condition", op=op, threshold=thr)
    return app


def truthfulness_probe(weight, bias: float, layer: int, hook: str = "hook_resid_post", sigmoid: bool = True,
                       name: str = "truthfulness_probe") -> MIApp:
    """A linear probe at one layer (Orgad et al. 2025, "LLMs know more than they show": a
    logistic-regression probe on hidden states predicts whether an answer is correct).

    Primitive: read (``linear_probe``). Semantics: at every processed position ``t``,
    ``p[t] = sigmoid(h[t] . weight + bias)`` (``sigmoid=False``: the logit), ``h`` the value
    of ``blocks.{layer}.{hook}``. Returned per request as ``mi_results[name]["probe"]``,
    float32 ``[P + G - 1]`` (position ``i``: the state that predicts token ``i + 1``; the
    paper scores the exact answer tokens: pick those positions from the array). ``weight``,
    ``bias``: e.g. :func:`vllm_xmix.extract.fit_probe`'s.

    Raises:
        XmixSpecError: a bad weight vector."""
    app = MIApp(name)
    app.read("linear_probe", weight=weight, bias=_number(bias, name, "bias"), sigmoid=_flag(sigmoid, name, "sigmoid")) \
        .layers([_index(layer, name, "layer")]).submodule(hook)
    return app


def single_layer_steering(vector, layer: int, scale: float = 1.0, hook: str = "hook_resid_post",
                          name: str = "caa") -> MIApp:
    """An unconditional write at one layer: SAKE (Scialanga et al. 2025, "SAKE: steering
    activations for knowledge editing") and contrastive activation addition (CAA, Rimsky et al.
    2024, "Steering Llama 2 via contrastive activation addition").

    Primitive: write (``add``), every token of the request. Semantics: ``h[t] += scale *
    vector`` at ``blocks.{layer}.{hook}``; CAA's vector is the mean difference of activations on
    contrastive prompt pairs (:func:`vllm_xmix.extract.diff_of_means`), scaled per request by
    ``{"name": ..., "scale": s}`` (negative scales steer away).

    Raises:
        XmixSpecError: a bad vector."""
    app = MIApp(name)
    app.write("add", vector=vector, scale=scale).layers([_index(layer, name, "layer")]).submodule(hook)
    return app


def multi_layer_steering(vector, layers, scale: float = 1.0, hook: str = "hook_resid_post",
                         name: str = "multi_layer_steering") -> MIApp:
    """An unconditional write at several layers (Stickland et al. 2024, "Steering without side
    effects": one steering vector added at a range of layers).

    Primitive: write (``add``), every token. Semantics: ``h[t] += scale * vector`` at
    ``blocks.{L}.{hook}`` for every ``L`` in ``layers`` (``"all"``: every layer). For a vector
    per layer use :func:`vllm_xmix.extract.steering_app`.

    Raises:
        XmixSpecError: no layers, a bad vector."""
    app = MIApp(name)
    app.write("add", vector=vector, scale=scale).layers(_layers(layers, name)).submodule(hook)
    return app


def steer_moe(n_experts: int, layers="all", deactivate: Iterable[int] = (), activate: Iterable[int] = (),
              boost: float = 10.0, name: str = "steer_moe") -> MIApp:
    """SteerMoE, expert (de)activation through the router logits (Fayyaz et al. 2026, "Steering
    MoE LLMs via expert (de)activation").

    Primitive: write (``router_bias``) at ``blocks.{L}.mlp.hook_router_logits``, before top-k.
    Semantics: at every token, ``logits[e] = -inf`` for each expert in ``deactivate`` (never
    routed to) and ``logits[e] += boost`` for each in ``activate``. The paper picks the experts
    by how much more often they are routed to on one behaviour's tokens than on the contrasting
    one's; which experts is the caller's input here.

    Shipped form: unconditional, every token of a request that has the app on. The paper's
    table lists SteerMoE as a conditional write because the write targets the router logits; its
    method applies the same (de)activation at every token during generation, which is this
    form. Router writes guarded by a per-token predicate are refused at deployment
    (``cond`` on a ``router_bias`` op).

    Raises:
        XmixSpecError: no expert named, an expert index outside ``0..n_experts-1``, an expert in
        both sets, a non-finite or non-positive boost."""
    n_experts = _index(n_experts, name, "n_experts", lo=1)
    de = sorted(set(_indices(list(deactivate) if isinstance(deactivate, (set, frozenset)) else deactivate, name,
                             "deactivate", allow_empty=True)))
    ac = sorted(set(_indices(list(activate) if isinstance(activate, (set, frozenset)) else activate, name,
                             "activate", allow_empty=True)))
    if not de and not ac:
        raise XmixSpecError(f"{name}: name experts to deactivate and/or activate")
    bad = [e for e in de + ac if not 0 <= e < n_experts]
    if bad:
        raise XmixSpecError(f"{name}: experts {bad} outside 0..{n_experts - 1}")
    both = set(de) & set(ac)
    if both:
        raise XmixSpecError(f"{name}: experts {sorted(both)} are both deactivated and activated")
    if _number(boost, name, "boost") <= 0:
        raise XmixSpecError(f"{name}: boost must be a finite positive number, got {boost}")
    bias = np.zeros(n_experts, dtype=np.float64)
    bias[ac] = boost
    app = MIApp(name)
    vec = bias.tolist()
    for e in de:
        vec[e] = -math.inf
    app.write("router_bias", vector=vec).layers(_layers(layers, name)).submodule("mlp.hook_router_logits")
    return app


__all__ = ["refusal_ablation", "seal", "cast", "truthfulness_probe", "single_layer_steering", "multi_layer_steering",
           "steer_moe"]
