"""The ``vllm-xmix`` command: ``apps validate`` against a model's config without an engine, and
``serve`` (vLLM's OpenAI server on CPU with a deployment file whose vectors are files, selected
per request with ``mi_apps``) against the HF oracle."""

from __future__ import annotations

import json
import os
import tomllib
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import HAPPY_LAYERS, HAPPY_SCALE, PROMPTS, V_HAPPY, app_deltas, running_server

from vllm_xmix import cli

N = 8


def write_deployment(folder, layers=HAPPY_LAYERS, vector=V_HAPPY, reserve: str = "") -> str:
    """A YAML deployment whose vector is a .npy file next to it (relative path); ``reserve``: a
    YAML ``reserve:`` block appended."""
    np.save(folder / "happy.npy", vector)
    (folder / "apps.yaml").write_text(
        "apps:\n"
        "  - name: happy\n"
        "    ops:\n"
        "      - primitive: write\n"
        "        kind: add\n"
        "        hook: hook_resid_post\n"
        f"        layers: {json.dumps(layers)}\n"
        "        vector: {path: happy.npy}\n"
        f"        scale: {HAPPY_SCALE:.0e}\n"  # 4e+00: YAML 1.1 reads it as a string, the loader as a float
        + reserve)
    return str(folder / "apps.yaml")


def test_the_console_script_is_declared():
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["vllm-xmix"] == "vllm_xmix.cli:main"


def test_apps_validate_checks_write_sizes_in_the_serving_dtype(tiny_llama, tmp_path, capsys):
    """What engine start refuses, `apps validate` refuses: a write that overflows the dtype the
    model is served in (the config's torch_dtype, or --dtype), naming the vector when its entries
    alone are too large; a NaN entry is named as such however the file spells it; a closed pipe
    after a passing check is no error."""
    import subprocess
    import sys

    v = np.asarray(V_HAPPY, np.float32) / np.abs(V_HAPPY).max() * 300.0  # largest entry 300
    path = write_deployment(tmp_path, vector=v)  # (scale 4: writes up to 1200)
    assert cli.main(["apps", "validate", path, "--model", tiny_llama]) == 0  # float32 (the config's)
    assert "writes checked for float32" in capsys.readouterr().out
    assert cli.main(["apps", "validate", path, "--model", tiny_llama, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "in float16: apps.0(happy).ops.0.vector: app 'happy' op 0 would write values up to 1.2e+03 " in err, err
    assert "largest vector entry 300" in err and "writes up to 256 stay finite" in err, err
    assert cli.main(["apps", "validate", path, "--model", tiny_llama, "--dtype", "int8"]) == 2
    assert "--dtype int8: not a floating-point torch dtype" in capsys.readouterr().err
    for spelled in ("NaN", "nan", ".nan"):
        (tmp_path / "nan.yaml").write_text(
            f"apps:\n- name: n\n  ops: [{{primitive: write, kind: add, hook: hook_resid_post, layers: [1], "
            f"vector: [0.5, {spelled}]}}]\n")
        assert cli.main(["apps", "validate", str(tmp_path / "nan.yaml"), "--model", tiny_llama]) == 2
        assert "apps.0.ops.0.vector: entry 1 is nan" in capsys.readouterr().err, spelled
    r = subprocess.run(f"{sys.executable} -m vllm_xmix.cli apps validate {path} --model {tiny_llama} | true",
                       shell=True, capture_output=True, text=True, timeout=300, executable="/bin/bash",
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.parametrize("neg_inf", ["-.inf", "-inf", "-Infinity"])  # YAML's, Python's and JSON's spelling
def test_the_served_config_keeps_a_router_mask_and_every_float(tmp_path, neg_inf):
    """``vllm-xmix serve`` hands the deployment to vLLM in a ``--config`` YAML file: read back by
    vLLM's own argument parser, a router mask's ``-inf`` stays a float (JSON's ``-Infinity`` would
    read as a string and fail the deployment's check at engine start) and every other number is
    the one the deployment file gave, however the file spells minus infinity."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_xmix.spec import parse_deployment

    (tmp_path / "moe.yaml").write_text(
        "apps:\n"
        "  - name: no_expert_0\n"
        "    ops:\n"
        "      - {primitive: write, kind: router_bias, hook: mlp.hook_router_logits, layers: all,\n"
        f"         vector: [{neg_inf}, 0.0, 1.0e-7, 0.1], scale: 1.0}}\n"
        "  - name: happy\n"
        "    ops:\n"
        "      - {primitive: write, kind: add, hook: hook_resid_post, layers: [1], vector: [0.3, -2.5e-3], scale: 3}\n")
    dep = cli.load_deployment_file(str(tmp_path / "moe.yaml"))
    path = str(tmp_path / "served.yaml")
    cli.write_vllm_config(path, {"xmix": dep})
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--config", path])
    got = parse_deployment(args.additional_config["xmix"])
    mask, add = (a.ops[0] for a in got.apps)
    assert mask.vector == [-float("inf"), 0.0, 1e-7, 0.1] and add.vector == [0.3, -2.5e-3] and add.scale == 3.0
    assert args.additional_config["xmix"] == dep


def test_yaml_keys_and_names_spelled_like_yaml_1_1_booleans_read_as_written(tmp_path):
    """A trigger's ``on:`` key (what ``deploy()`` writes for ``read(...).on(...)``) and an app
    named ``on`` read as strings, YAML 1.2's way (YAML 1.1, which PyYAML follows, reads ``on``,
    ``off``, ``yes`` and ``no`` as booleans, and the trigger was refused as "Keys should be
    strings"): the file gives the deployment the builder gives, and vLLM reads the served config
    back with the key intact."""
    import numpy as np
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_xmix import MIApp, deploy
    from vllm_xmix.spec import parse_deployment

    (tmp_path / "guard.yaml").write_text(
        "apps:\n"
        "  - name: on\n"
        "    ops:\n"
        "      - {primitive: read, kind: linear_probe, hook: hook_resid_post, layers: [1],\n"
        "         weight: [1.0, 0.5], bias: 0.0, sigmoid: true, on: {op: '>', threshold: 0.9, action: stop}}\n"
        "  - name: off\n"
        "    ops:\n"
        "      - {primitive: write, kind: add, hook: hook_resid_post, layers: [1], vector: [0.25, 0.125]}\n")
    got = cli.load_deployment_file(str(tmp_path / "guard.yaml"))
    guard = MIApp("on")
    guard.read("linear_probe", weight=np.array([1.0, 0.5], np.float32), bias=0.0, sigmoid=True).layers([1]).on(
        ">", 0.9, action="stop")
    off = MIApp("off")
    off.write("add", vector=np.array([0.25, 0.125], np.float32)).layers([1])
    want = parse_deployment(deploy(guard, off)["xmix"]).model_dump(mode="json", exclude_none=True)
    assert got == want
    path = str(tmp_path / "served.yaml")
    cli.write_vllm_config(path, {"xmix": got})
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", "--config", path])
    assert args.additional_config["xmix"] == got


def test_apps_validate_checks_against_the_model_config(tiny_llama, tmp_path, capsys):
    path = write_deployment(tmp_path)
    assert cli.main(["apps", "validate", path, "--model", tiny_llama]) == 0
    out = capsys.readouterr().out
    assert "valid for" in out and "happy" in out and "content hash" in out
    assert "write add at blocks.{1,2}.hook_resid_post" in out
    # a read's trigger is listed with it
    w = ", ".join(["0.01"] * len(V_HAPPY))
    with open(path, "a") as f:
        f.write("  - name: guard\n    ops:\n      - {primitive: read, kind: linear_probe, hook: hook_resid_post, "
                f"layers: [2], weight: [{w}], sigmoid: true, on: {{op: '>', threshold: 0.9, action: stop}}}}\n")
    assert cli.main(["apps", "validate", path, "--model", tiny_llama]) == 0
    assert "read linear_probe at blocks.{2}.hook_resid_post on > 0.9 -> stop" in capsys.readouterr().out
    # errors name the file and the field; exit status 2
    bad = tmp_path / "bad"
    bad.mkdir()
    for layers, vector, msg in (([1, 9], V_HAPPY, "apps.0(happy).ops.0.layers: layer index 9"),
                                (HAPPY_LAYERS, V_HAPPY[:10], "apps.0(happy).ops.0")):
        p = write_deployment(bad, layers, vector)
        assert cli.main(["apps", "validate", p, "--model", tiny_llama]) == 2
        err = capsys.readouterr().err
        assert p in err and msg in err, err
    (bad / "x.yaml").write_text("apps: [ {name: a, ops: [ {primitive: write, kind: nope} ] } ]\n")
    assert cli.main(["apps", "validate", str(bad / "x.yaml"), "--model", tiny_llama]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli.main(["apps", "validate", str(bad / "missing.yaml"), "--model", tiny_llama]) == 2
    assert "cannot read the deployment file" in capsys.readouterr().err
    # a deployment no request could select anything on is refused here as at engine start;
    # reserved entries alone make one (apps added while serving)
    (bad / "empty.yaml").write_text("apps: []\n")
    assert cli.main(["apps", "validate", str(bad / "empty.yaml"), "--model", tiny_llama]) == 2
    assert "no apps deployed and no entries reserved" in capsys.readouterr().err
    (bad / "reserve.yaml").write_text("apps: []\nreserve:\n  add: {hook_resid_post: [1]}\n")
    assert cli.main(["apps", "validate", str(bad / "reserve.yaml"), "--model", tiny_llama]) == 0
    capsys.readouterr()
    assert cli.main(["apps", "validate", path, "--model", str(tmp_path / "no-model")]) == 2
    assert "no such model folder" in capsys.readouterr().err


@pytest.mark.one_version  # (its log checks read vLLM 0.26's lines; the server path runs on both in test_serve.py)
def test_serve_with_a_deployment_file(tiny_llama, tmp_path, hf):
    """`vllm-xmix serve MODEL --apps FILE` starts vLLM's OpenAI server with the file's apps; a
    request selects them with a top-level mi_apps field and gets HF's steered tokens. The file's
    reserve block and --admin-key: an app added with the key runs, a wrong key is refused."""
    path = write_deployment(tmp_path, reserve="reserve:\n  add: {hook_resid_post: [3]}\n")
    assert cli.main(["apps", "validate", path, "--model", tiny_llama]) == 0
    log = tmp_path / "server.log"
    args = ["-m", "vllm_xmix.cli", "serve", tiny_llama, "--apps", path, "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--max-num-seqs", "4", "--admin-key", "k1"]
    proc: list = []
    with running_server(args, log, proc_out=proc) as url:
        v = [float(x) for x in V_HAPPY[::-1]]
        new = {"name": "late", "ops": [{"kind": "add", "hook": "hook_resid_post", "layers": [3], "vector": v}]}
        for key, status in (("wrong", 401), ("k1", 201)):
            req = urllib.request.Request(url + "/v1/mi/apps", data=json.dumps(new).encode(),
                                         headers={"Content-Type": "application/json", "X-Admin-Key": key})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    got = r.status
            except urllib.error.HTTPError as e:
                got = e.code
            assert got == status, key
        body = {"model": tiny_llama, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "mi_apps": ["late"]}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            toks = list(json.loads(r.read())["choices"][0]["token_ids"])
        assert toks == hf.greedy(PROMPTS[0], N, {3: np.asarray(v, np.float32)})
        for sel in (None, ["happy"]):
            body = {"model": tiny_llama, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, **({"mi_apps": sel} if sel else {})}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                resp = json.loads(r.read())
            want = hf.greedy(PROMPTS[0], N, app_deltas([{"name": "happy"}] if sel else []))
            assert list(resp["choices"][0]["token_ids"]) == want, sel
        assert "vllm-xmix: serving" in log.read_text()
    # stopped with SIGTERM: vllm-xmix serve gives vLLM a shutdown grace period, so the engine
    # core closes its shared-memory queues itself and nothing is reported leaked at exit
    assert proc[0].returncode is not None
    text = log.read_text()
    assert "'shutdown_timeout': 10" in text, "the default grace period did not reach vLLM"
    assert "leaked shared_memory" not in text and "leaked semaphore" not in text, text[-3000:]
    # the model goes to vLLM as `vllm serve MODEL` does, not as the --model it warns about
    assert "provide the model as a positional argument" not in text, text[-3000:]


def test_serve_passes_api_server_count_to_vllm(tiny_llama, tmp_path, hf):
    """`vllm-xmix serve ... --api-server-count 2` starts two API server processes, as `vllm
    serve` does (the module entry point it used before ignored the option: one server, silently):
    several API servers are how an operator scales a front end that streams read values at
    saturation. Every answer's steered tokens and probe values equal HF's."""
    path = write_deployment(tmp_path)
    w = np.asarray(V_HAPPY[::-1], np.float32) / 8
    np.save(tmp_path / "w.npy", w)
    with open(path, "a") as f:
        f.write("  - name: probe\n    ops:\n      - {primitive: read, kind: linear_probe, hook: hook_resid_post, "
                "layers: [2], weight: w.npy}\n")
    log = tmp_path / "server.log"
    args = ["-m", "vllm_xmix.cli", "serve", tiny_llama, "--apps", path, "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--max-num-seqs", "4", "--api-server-count", "2"]
    with running_server(args, log) as url:
        p = PROMPTS[1]
        want = hf.greedy(p, N, app_deltas([{"name": "happy"}]))
        x = hf.record(list(p) + want[:-1], [(2, "hook_resid_post")], app_deltas([{"name": "happy"}]))[(2, "hook_resid_post")]
        for _ in range(8):  # the kernel spreads connections over the servers' shared port
            body = {"model": tiny_llama, "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "mi_apps": ["happy", "probe"]}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                resp = json.loads(r.read())
            assert list(resp["choices"][0]["token_ids"]) == want
            np.testing.assert_allclose(np.array(resp["mi_results"]["probe"]["probe"]), x.astype(np.float64) @ w,
                                       rtol=1e-4, atol=1e-4)
        text = log.read_text()
    assert "(ApiServer_0 pid=" in text and "(ApiServer_1 pid=" in text, text[-3000:]  # two server processes
