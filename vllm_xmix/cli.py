"""The ``vllm-xmix`` command: serve a model with a deployment file, check a deployment file
against a model, run the demo.

* ``vllm-xmix serve MODEL --apps apps.yaml [vLLM serve arguments]``: vLLM's OpenAI server
  (``vllm.entrypoints.openai.api_server``, the module ``vllm serve`` runs) with the deployment of
  ``apps.yaml`` as ``additional_config["xmix"]``. The deployment goes to vLLM through a
  ``--config`` YAML file, so vectors stay files (an inline 4096-wide vector would overflow the
  OS's argument limit); vector paths relative to the deployment file are resolved against its
  folder. Works with the CPU wheel too (whose ``vllm`` command fails before parsing).
  ``--admin-key KEY`` guards the routes that change apps on the running server
  (``POST /v1/mi/apps``, ``POST /v1/mi/apps/{name}``; default: vLLM's ``--api-key``); the
  deployment's ``reserve:`` block sizes what they can add.
* ``vllm-xmix apps validate apps.yaml --model MODEL [--dtype DTYPE]``: the checks of engine start
  that need no engine (the architecture and its hook points, layers, vector widths and files,
  token ids, and the largest write that stays finite in the dtype the model will be served in)
  against ``MODEL``'s ``config.json``; prints the apps, their ops and hook sites and content hashes.
* ``vllm-xmix demo [demo options]``: the shipped model's demo (``python -m vllm_xmix.demo``).

A deployment file is YAML or JSON: the ``additional_config["xmix"]`` dict (``apps``,
``fused_writes``, ``reserve``), optionally under a top-level ``xmix`` key, as ``vllm_xmix.deploy`` writes it.
Exit status: 0, or 2 with a message naming what was wrong.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import tempfile

from .spec import CONFIG_KEY, XmixSpecError, parse_deployment


def _yaml_load(f):
    """YAML (or JSON) with numbers such as ``1e3`` read as floats, as in JSON (YAML 1.1, which
    PyYAML follows, needs ``1.0e+3``), and infinity written ``-inf`` or ``-Infinity`` (Python's
    and JSON's spelling; YAML's is ``-.inf``) and ``nan`` / ``NaN`` read as floats too, not as
    strings: a router mask (``router_bias`` with ``-inf`` entries) reads as written, and a NaN
    is refused as a NaN, naming its entry. Booleans are YAML 1.2's (JSON's): only
    ``true`` / ``false`` (also ``True``, ``TRUE``, ``False``, ``FALSE``); YAML 1.1's ``on``, ``off``, ``yes``,
    ``no`` stay strings, so a trigger's ``on:`` key (what ``deploy()`` writes for
    ``read(...).on(...)``) and an app named ``on`` read as written. Raises ValueError for text
    that does not parse."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {  # (a copy: SafeLoader's own table is left as it is)
        first: [(tag, rx) for tag, rx in resolvers if tag != bool_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                      |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                      |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                      |[-+]?\.(?:inf|Inf|INF)
                      |[-+]?(?:inf|Inf|INF|infinity|Infinity|INFINITY)
                      |\.(?:nan|NaN|NAN)
                      |(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789.iInN"))
    try:
        return yaml.load(f, Loader=Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def load_deployment_file(path: str) -> dict:
    """The deployment dict of a YAML/JSON file, vector file paths made absolute (relative ones
    are taken from the file's folder).

    Raises:
        XmixSpecError: the file is missing, not YAML/JSON, or not a valid deployment (the
        message names the file and the field)."""
    try:
        with open(path) as f:
            raw = _yaml_load(f)
    except OSError as e:
        raise XmixSpecError(f"{path}: cannot read the deployment file ({e.strerror})") from None
    except ValueError as e:  # yaml.YAMLError is not one; _yaml_load turns it into one
        raise XmixSpecError(f"{path}: not YAML or JSON ({e})") from None
    if isinstance(raw, dict) and set(raw) == {CONFIG_KEY}:
        raw = raw[CONFIG_KEY]
    if not isinstance(raw, dict):
        raise XmixSpecError(f"{path}: a deployment is a mapping with 'apps' (got {type(raw).__name__})")
    base = os.path.dirname(os.path.abspath(path))
    for app in raw.get("apps") or []:
        for op in (app.get("ops") or []) if isinstance(app, dict) else []:
            for key in ("vector", "weight"):
                v = op.get(key) if isinstance(op, dict) else None
                if isinstance(v, str):  # the short form of {path: ...}
                    v = op[key] = {"path": v}
                if isinstance(v, dict) and isinstance(v.get("path"), str) and not os.path.isabs(v["path"]):
                    op[key] = {**v, "path": os.path.join(base, v["path"])}
    try:
        dep = parse_deployment(raw)
    except XmixSpecError as e:
        raise XmixSpecError(f"{path}: {_in_file(e)}") from None
    return dep.model_dump(mode="json", exclude_none=True)


def _in_file(e: Exception) -> str:
    """An error about the deployment, its fields named as they are in the file."""
    return str(e).replace(f"additional_config.{CONFIG_KEY}.", "").replace(f"additional_config.{CONFIG_KEY}", "deployment")


def _validate(path: str, model: str, dtype: str = "auto") -> str:
    """Check the deployment file against ``model``'s config; returns the report text. ``dtype``:
    the one the model will be served in (``--dtype`` of ``serve``), for the family's dtype rules
    and the largest write that stays finite; ``auto``: the config's ``torch_dtype`` (float32 if
    it has none; vLLM's ``auto`` serves a float32 checkpoint in bfloat16 or float16 depending on
    the platform, whose limits are bfloat16's, within 0.4% of float32's, or float16's)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig

    from .hf_config import text_config
    from .validation.engine import check_family_dtype, validate_for_model
    from .validation.requests import check_combined_magnitude, check_write_magnitude, measure_deployment

    dep_dict = load_deployment_file(path)
    dep = parse_deployment(dep_dict)
    if not os.path.isdir(model):
        raise XmixSpecError(f"--model {model}: no such model folder (a folder with the model's config.json)")
    try:
        cfg = AutoConfig.from_pretrained(model)
    except Exception as e:
        raise XmixSpecError(f"--model {model}: cannot read its config.json ({type(e).__name__}: {e})") from None
    archs = list(getattr(cfg, "architectures", None) or [])
    text = text_config(cfg)
    cfg_dtype = next((d for c in (text, cfg) for d in (c.__dict__.get("dtype"), c.__dict__.get("torch_dtype")) if d),
                     None)  # (from the instance: the torch_dtype property of newer transformers warns)
    name = dtype if dtype != "auto" else str(cfg_dtype or "float32").removeprefix("torch.")
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise XmixSpecError(f"--dtype {dtype}: not a floating-point torch dtype (float32, bfloat16, float16)")
    try:
        validate_for_model(dep, archs, cfg)
        check_family_dtype(dep, archs, text, torch_dtype)
        stand_in = SimpleNamespace(model_config=SimpleNamespace(dtype=torch_dtype, hf_config=cfg))
        info = measure_deployment(stand_in, dep)
        for ai, app in enumerate(dep.apps):
            check_write_magnitude(stand_in, app.name, None, f"additional_config.xmix.apps.{ai}({app.name})",
                                  per_op=True, info=info)
            check_combined_magnitude(stand_in, [(app.name, None, None)], f"additional_config.xmix.apps.{ai}({app.name})",
                                     info=info)
    except XmixSpecError as e:
        raise XmixSpecError(f"{path} for --model {model} in {name}: {_in_file(e)}") from None
    lines = [f"{path}: valid for {model} ({archs[0] if archs else '?'}, {text.num_hidden_layers} layers, "
             f"d_model {text.hidden_size}, writes checked for {name}); fused_writes={dep.fused_writes}"]
    for app in dep.apps:
        lines.append(f"  {app.name}  (content hash {app.content_hash()})")
        for op in app.ops:
            layers = op.layers if isinstance(op.layers, str) else ",".join(map(str, op.layers))
            cond = " if " + json.dumps(op.cond.model_dump(mode="json", exclude_none=True)) if getattr(op, "cond", None) else ""
            on = getattr(op, "on", None)  # a read's trigger (read(...).on(...))
            trig = f" on {on.op} {on.threshold:g} -> {on.action}" if on is not None else ""
            lines.append(f"    {op.primitive} {op.kind} at blocks.{{{layers}}}.{op.hook}{cond}{trig}")
    if dep.reserve is not None:
        lines.append(f"  reserve: {json.dumps(dep.reserve.model_dump(mode='json', exclude_none=True))}")
    return "\n".join(lines)


#: seconds vLLM's server may take to stop on SIGTERM unless ``--shutdown-timeout`` is given: with
#: vLLM's default (0) the engine core is killed before its executor closes its shared-memory
#: queues, and Python's resource tracker reports them as leaked at exit (README, "Stopping and
#: inspecting a server")
SHUTDOWN_TIMEOUT_S = 10


def write_vllm_config(path: str, additional_config: dict) -> None:
    """Write vLLM's ``--config`` YAML file with ``additional_config`` as its ``additional-config``
    (e.g. ``{"xmix": ...}`` as :func:`vllm_xmix.deploy` returns it), read back by vLLM's
    ``yaml.safe_load`` with every number as written. YAML, not JSON: JSON has no infinity, and
    its ``-Infinity`` token (Python's ``json``) reads in YAML as a string, so a ``router_bias``
    mask (``-inf`` entries) would fail the deployment's check at engine start; YAML writes it
    ``-.inf``. Floats keep their ``repr`` digits (float32 values survive exactly).

    Raises:
        OSError: the file cannot be written."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # (libyaml's: ~1 s for 200k numbers)
    text = yaml.dump({"additional-config": additional_config}, Dumper=dumper, default_flow_style=True,
                     width=1 << 30, sort_keys=False)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _serve(model: str, apps: str, rest: list[str], admin_key: str | None = None) -> int:
    dep = load_deployment_file(apps)
    if not any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in rest):
        rest = rest + ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if admin_key:  # the server reads it from its environment (never an argument in the logs)
        from .validation.admin import ADMIN_KEY_ENV

        os.environ[ADMIN_KEY_ENV] = admin_key
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="vllm-xmix-", delete=False) as f:
        cfg_path = f.name
    write_vllm_config(cfg_path, {CONFIG_KEY: dep})
    atexit.register(lambda: os.path.exists(cfg_path) and os.unlink(cfg_path))
    print(f"vllm-xmix: serving {model} with {len(dep.get('apps', []))} apps from {apps} "
          f"(vLLM --config {cfg_path})", flush=True)
    from ._vllm_compat.cli_serve import run_vllm_serve

    run_vllm_serve([model, "--config", cfg_path] + rest)  # as `vllm serve MODEL` (--api-server-count, ...)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="vllm-xmix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="vLLM's OpenAI server with a deployment file",
                       description="vllm-xmix serve MODEL --apps FILE [vLLM serve arguments]")
    s.add_argument("model")
    s.add_argument("--apps", required=True, metavar="FILE", help="deployment file (YAML/JSON)")
    s.add_argument("--admin-key", metavar="KEY", default=None,
                   help="key of the routes that change apps on the running server (POST /v1/mi/apps...), sent "
                        "as 'X-Admin-Key: KEY' or 'Authorization: Bearer KEY'; default: vLLM's --api-key "
                        "(also from the environment variable VLLM_XMIX_ADMIN_KEY)")
    a = sub.add_parser("apps", help="deployment files")
    asub = a.add_subparsers(dest="apps_cmd", required=True, metavar="ACTION")
    v = asub.add_parser("validate", help="check a deployment file against a model's config, without an engine")
    v.add_argument("file")
    v.add_argument("--model", required=True, help="model folder (its config.json)")
    v.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="the dtype the model will be served in (serve's --dtype: float32, bfloat16, float16), "
                        "for the largest write that stays finite; default auto: the config's torch_dtype")
    sub.add_parser("demo", help="the shipped model's demo (its options: vllm-xmix demo --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd == "apps":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "serve":
            return _serve(args.model, args.apps, rest, args.admin_key)
        if args.cmd == "apps":
            text = _validate(args.file, args.model, args.dtype)
            try:
                print(text, flush=True)
            except BrokenPipeError:  # (`| head`: the reader left; the check itself passed)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
            return 0
        from . import demo

        return demo.main(rest)
    except XmixSpecError as e:
        print(f"vllm-xmix: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
