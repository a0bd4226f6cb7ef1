"""Apps changed on a running server, on the worker: a replaced app's new parameters, or an added
app, go into entries reserved at engine start (``DeploymentConfig.reserve``), never into entries
a request in flight reads.

Versions: every request runs one *version* of each of its apps, named in its canonical selection
by the front end when the request is added (``RequestApp.version``; 0 is the deployment's own).
A version is a list of entries (``DeviceLayout.version_entries[(app, version)]``), one per
(op, layer) in the app's order. A new version takes

* a free spare copy of a deployed app (``reserve.versions``; same sites, and at each site the
  same place among the other apps' entries as the deployed app, so the order of writes at a site
  is unchanged), or
* reserved entries of its kinds at its sites (``reserve.add`` / ``linear_probe`` / ``cosine``;
  after every deployed entry of the site: the app applies as if deployed last, which for adds,
  which commute, and reads, which see the site's final value, is the same wherever no
  projection write shares the site).

Its parameters are written into those entries' rows of the device tables in place (vectors,
probe biases, sigmoid flags, clamp values, condition thresholds; default scales in the host-side
entries that coefficient rows are built from), so nothing is recompiled or recaptured: CUDA
graphs read the tables by address, and the entries already belong to the hook sites' plans.
Requests in flight keep the version they started with. A version that is neither its app's
current one nor used by a request the front end still tracks (``live``) is released when the
next change is applied, and its entries become free again.

Errors are returned, not raised (they travel back to the API server through ``collective_rpc``):
``{"ok": False, "status": <HTTP status>, "error": <message naming the field>}``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..kernels.read_rows import COSINE, PROBE
from ..spec import AppSpec, XmixSpecError, resolve_layers
from ..spec.errors import _validated
from .layout import RESIDUAL_HOOKS, DeviceLayout, lower_op

logger = logging.getLogger("vllm.xmix")

#: parameter fields a replace may change; everything else of an op is its structure
PARAMETER_FIELDS = ("vector", "weight", "bias", "value", "scale", "sigmoid")


def app_structure(app: AppSpec, n_layers: int) -> list[dict]:
    """What a replace must keep of ``app``: per op its JSON without the parameters
    (:data:`PARAMETER_FIELDS`, a condition's ``threshold``), layers resolved to indices."""
    out = []
    for oi, op in enumerate(app.ops):
        d = op.model_dump(mode="json", exclude=set(PARAMETER_FIELDS))
        if d.get("cond"):
            d["cond"] = {k: v for k, v in d["cond"].items() if k != "threshold"}
        d["layers"] = resolve_layers(op.layers, n_layers, f"ops.{oi}.layers")
        out.append(d)
    return out


def pool_kind(op) -> str | None:
    """The reserved-entry kind an op can take (``"add"``, ``"linear_probe"``, ``"cosine"``), None
    if it can take none (projections, router biases, conditions, condition reads, captures)."""
    if op.primitive == "write":
        return "add" if op.kind == "add" and op.cond is None and op.hook in RESIDUAL_HOOKS else None
    if op.kind in ("linear_probe", "cosine") and op.buffer is None:
        return op.kind
    return None


class UpdateError(Exception):
    """A change that cannot be applied: ``status`` (HTTP) and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AppUpdates:
    """Versions of the apps of one model instance (see the module docstring). ``current[app]``:
    the version new requests get."""

    def __init__(self, layout: DeviceLayout, slots) -> None:
        self.layout, self.slots = layout, slots
        self.current: dict[str, int] = {a.name: 0 for a in layout.deployment.apps}

    # ------------------------------------------------------------------ entry point
    def apply(self, payload: dict) -> dict:
        """Apply one change. ``payload`` (plain JSON data): ``action`` ``"replace"`` or
        ``"add"``, ``name``, ``version`` (the new version's number, chosen by the front end),
        ``app`` (the app's JSON, inline vectors) and ``live`` (``[app, version]`` pairs used by
        requests in flight). Returns ``{"ok": True, "version", "entries"}`` or ``{"ok": False,
        "status", "error"}``."""
        try:
            return self._apply(payload)
        except UpdateError as e:
            return {"ok": False, "status": e.status, "error": str(e)}
        except XmixSpecError as e:
            return {"ok": False, "status": 400, "error": str(e)}

    def _apply(self, payload: dict) -> dict:
        if not isinstance(payload, dict) or payload.get("action") not in ("replace", "add"):
            raise UpdateError(400, "action: expected 'replace' or 'add'")
        action, name, version = payload["action"], payload.get("name"), payload.get("version")
        if not isinstance(version, int) or version < 1:
            raise UpdateError(400, f"version: expected an integer >= 1, got {version!r}")
        app = _validated(AppSpec, payload.get("app"), "body")
        if app.name != name:
            raise UpdateError(400, f"body.name: {app.name!r} != {name!r}")
        self._release(payload.get("live") or [])
        if action == "replace":
            if name not in self.current:
                raise UpdateError(404, f"unknown app {name!r}; deployed apps: {sorted(self.current)}")
            entries = self._place_replace(app)
        else:
            if name in self.current:
                raise UpdateError(409, f"name: app {name!r} is already deployed (replace it with POST "
                                       f"/v1/mi/apps/{name})")
            entries = self._place_pool(app, added=True)
        self._write(entries, app)
        lay = self.layout
        lay.version_entries[(name, version)] = entries
        for e in entries:
            lay.owner[e] = (name, version)
        self.current[name] = version
        self.slots.forget_rows()
        logger.info("vllm_xmix: app %r version %d (%s) in %d entries", name, version, action, len(entries))
        return {"ok": True, "version": version, "entries": len(entries)}

    # ------------------------------------------------------------------ placement
    def _release(self, live) -> None:
        """Free the entries of versions that are neither current nor ``live``."""
        keep = {(str(a), int(v)) for a, v in live} | set(self.current.items())
        lay = self.layout
        for key in [k for k in lay.version_entries if k not in keep]:
            for e in lay.version_entries.pop(key):
                lay.owner[e] = None
        self.slots.forget_rows()

    def _place_replace(self, app: AppSpec) -> list[int]:
        lay = self.layout
        copies = lay.copies.get(app.name)
        if copies is not None:  # a deployed app: same structure, then a free spare copy
            if app_structure(app, lay.n_layers) != app_structure(lay.deployment.app(app.name), lay.n_layers):
                raise UpdateError(400, f"body: app {app.name!r} must keep its ops' kinds, hooks, layers, names, "
                                       f"conditions and triggers; only {', '.join(PARAMETER_FIELDS)} and condition "
                                       "thresholds change")
            for c in copies:
                if all(lay.owner[e] is None for e in c):
                    return list(c)
            if len(copies) == 1:  # nothing reserved for versions: the only copy is the current version's
                why = (f"app {app.name!r} has no spare copy to take the new parameters: its deployment reserved "
                       "none (reserve.versions = 0; give it reserve: {versions: 1} or more to replace apps "
                       "while serving)")
            else:
                why = (f"all {len(copies)} copies of app {app.name!r} (reserve.versions = {len(copies) - 1}) are "
                       "used by its current version or by requests in flight")
            try:
                return self._place_pool(app, added=False)
            except UpdateError as e:
                raise UpdateError(507 if len(copies) > 1 else e.status, f"{why}; reserved entries: {e}") from None
        return self._place_pool(app, added=False)

    def _place_pool(self, app: AppSpec, added: bool) -> list[int]:
        """Free reserved entries for every (op, layer) of ``app``, in order."""
        lay = self.layout
        taken: list[int] = []
        for oi, op in enumerate(app.ops):
            kind = pool_kind(op)
            if kind is None or (added and getattr(op, "on", None) is not None):
                raise UpdateError(422, f"body.ops.{oi}: a {op.primitive} {op.kind!r}"
                                       f"{' with a condition' if getattr(op, 'cond', None) is not None else ''}"
                                       f"{' with a buffer' if getattr(op, 'buffer', None) is not None else ''}"
                                       f"{' with a trigger' if getattr(op, 'on', None) is not None else ''}"
                                       " cannot go into reserved entries (reservable: unconditional adds at "
                                       "residual-stream hooks, linear_probe and cosine reads without buffer or "
                                       "trigger)")
            for L in resolve_layers(op.layers, lay.n_layers, f"body.ops.{oi}.layers"):
                site = lay.sites.get((L, op.hook))
                if kind == "add" and site is not None and lay.site_has_proj[site]:
                    raise UpdateError(422, f"body.ops.{oi}: blocks.{L}.{op.hook} has a projection write (ablate/"
                                           "clamp), which does not commute with an add placed after it")
                pool = lay.pool.get((L, op.hook, kind))
                if not pool:
                    raise UpdateError(422, f"body.ops.{oi}: the deployment reserved no {kind!r} entry at "
                                           f"blocks.{L}.{op.hook} (reserve: {self._reserve_text()})")
                free = next((e for e in pool if lay.owner[e] is None and e not in taken), None)
                if free is None:
                    owners = {lay.owner[e] for e in pool} - {None}
                    held = sorted(f"{a!r} version {v}" for a, v in owners)
                    replacing = not added and any(a == app.name for a, _ in owners)
                    what = (f"the one reserved {kind!r} entry at blocks.{L}.{op.hook} is" if len(pool) == 1 else
                            f"all {len(pool)} reserved {kind!r} entries at blocks.{L}.{op.hook} are")
                    raise UpdateError(507, f"body.ops.{oi}: {what} in use, held by {', '.join(held) or 'entries taken above'}"
                                           " (an app's version, or one that requests in flight still run)"
                                           + ("; a replace puts the new version into free entries while the "
                                              "current one keeps its own until no request runs it: reserve "
                                              "more entries at this site to replace this app" if replacing else ""))
                taken.append(free)
        return taken

    def _reserve_text(self) -> str:
        r = self.layout.deployment.reserve
        return "none" if r is None else str(r.model_dump(mode="json", exclude_none=True))

    # ------------------------------------------------------------------ parameters
    def _write(self, entries: list[int], app: AppSpec) -> None:
        """The parameters of ``app`` into ``entries`` (one per (op, layer), in order): host-side
        entries and lists, then the device tables, in place."""
        lay = self.layout
        ct = lay.conditions
        rows, values, flags, thr = [], [], [], []
        i = 0
        for oi, op in enumerate(app.ops):
            _, v = lower_op(op, f"body.ops.{oi}", lay.d_model, lay.n_experts, lay.width)
            for L in resolve_layers(op.layers, lay.n_layers, f"body.ops.{oi}.layers"):
                e_idx = entries[i]
                i += 1
                e = lay.entries[e_idx]
                rows.append(v)
                if op.primitive == "read":
                    e.value, e.sigmoid, e.name = float(op.bias), bool(op.sigmoid), op.name
                    lay.read_info[e_idx] = (e.positions, e.col, e.width,
                                            "probe" if e.kind in (PROBE, COSINE) else e.positions,
                                            app.name, op.name, L)
                else:
                    e.default_scale, e.value = float(op.scale), float(op.value or 0.0)
                    if op.cond is not None and op.cond.buffer is not None:
                        e.cthr = float(op.cond.threshold)
                        ct.cond_host[e_idx] = (e.ckind, e.cidx, e.cop, int(e.cgen), e.cthr)
                        thr.append((e_idx, e.cthr))
                lay.values_host[e_idx] = e.value
                lay.flags_host[e_idx] = int(e.sigmoid)
                values.append(e.value)
                flags.append(int(e.sigmoid))
        dev = lay.device
        if dev.type == "cuda":  # steps already launched finish with the tables as they were
            torch.cuda.synchronize(dev)
        idx = torch.tensor(entries, dtype=torch.long, device=dev)
        lay.vectors.index_copy_(0, idx, torch.from_numpy(np.stack(rows)).to(dev))
        lay.values.index_copy_(0, idx, torch.tensor(values, dtype=lay.values.dtype, device=dev))
        lay.flags.index_copy_(0, idx, torch.tensor(flags, dtype=lay.flags.dtype, device=dev))
        if thr:
            t = ct.cond_args["cond_thr"]
            t.index_copy_(0, torch.tensor([e for e, _ in thr], dtype=torch.long, device=dev),
                          torch.tensor([x for _, x in thr], dtype=t.dtype, device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
