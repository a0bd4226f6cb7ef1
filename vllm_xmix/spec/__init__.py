"""MI app specifications: the builder users write, the plain data it lowers to, validation.

An *app* is plain data (pydantic models, JSON-serialisable): a name and a list of ops. The
builder (``MIApp("name").write("add", vector=v).layers([3, 5]).submodule("hook_resid_post")``)
follows the xMIx paper's programming interface (Blum et al., section 4.1) and produces that data.
Apps are *deployed* when the engine starts (``LLM(..., additional_config=deploy(app, ...))``), so
the set of hook sites is part of vLLM's config hash and therefore of the torch.compile cache key.
Requests then only *switch* deployed apps on, with their own scale
(``SamplingParams(mi_apps=[{"name": "happy", "scale": 4.0}])``).

Supported now: the write kinds ``add`` (activation addition, Turner et al. 2023), ``ablate``
(directional ablation, Arditi et al. 2024), ``clamp`` and ``router_bias`` (SteerMoE, Fayyaz et
al. 2026) and the read kinds ``linear_probe``, ``cosine`` and ``capture`` at the TransformerLens
hook points of :data:`SUPPORTED_HOOKS` (see docs/hooks.md). A write can be conditional
(:class:`Cond`: on the current or the previous token, or on a condition read of the same app
compared with a threshold, per token or once per request, or latched on from the first
position where a read's trigger fires; see docs/design.md, docs/hooks.md). What is not
implemented (conditional reads, conditional ``router_bias`` writes) is rejected with a clear
:class:`XmixSpecError`: a declared op never silently does nothing.

Modules (each imports only those above it):

* :mod:`.errors`: :class:`XmixSpecError`, and turning JSON and pydantic errors into it;
* :mod:`.names`: the config key, hook names, op kinds, capture positions; hook-name normalisation;
* :mod:`.model`: the pydantic data model (:class:`AppSpec`, :class:`WriteOp`, :class:`ReadOp`,
  :class:`Cond`, :class:`DeploymentConfig`, :class:`RequestApp`) and its validators;
* :mod:`.vectors`: loading an op's vector (inline or from a file) and checking its width;
* :mod:`.deployment`: parsing ``additional_config["xmix"]`` and checking it against the model;
* :mod:`.request`: parsing a request's app selection and checking it against the deployment;
* :mod:`.builder`: :class:`MIApp` and :func:`deploy`.
"""

from .builder import MIApp, _OpBuilder, deploy
from .deployment import parse_deployment, resolve_layers, validate_deployment
from .errors import XmixSpecError
from .model import (RESERVE_KINDS, AppSpec, Cond, DeploymentConfig, Layers, Number, Op, ReadOp, RequestApp, Reserve,
                    Trigger, VectorFile, WriteOp)
from .names import (CAPTURE_POSITIONS, CONFIG_KEY, KNOWN_HOOKS, KNOWN_READ_KINDS, KNOWN_WRITE_KINDS, ROUTER_HOOK,
                    SUPPORTED_HOOKS, SUPPORTED_WRITE_KINDS)
from .request import (check_request_against_deployment, check_router_masks, parse_request_apps, request_to_wire,
                      router_masks)
from .vector_files import load_vector
from .vectors import hook_width, load_op_vector

__all__ = [
    # errors, names
    "XmixSpecError", "CONFIG_KEY", "SUPPORTED_HOOKS", "KNOWN_HOOKS", "ROUTER_HOOK", "SUPPORTED_WRITE_KINDS",
    "KNOWN_WRITE_KINDS", "KNOWN_READ_KINDS", "CAPTURE_POSITIONS",
    # data model
    "Layers", "Number", "VectorFile", "Cond", "Trigger", "WriteOp", "ReadOp", "Op", "AppSpec", "DeploymentConfig", "RequestApp",
    "Reserve", "RESERVE_KINDS",
    # vectors, deployment, request
    "load_vector", "load_op_vector", "hook_width", "parse_deployment", "resolve_layers", "validate_deployment",
    "parse_request_apps", "check_request_against_deployment", "check_router_masks", "request_to_wire", "router_masks",
    # builder
    "MIApp", "deploy",
]
