"""The servers and configurations of a serving A/B (``serve``): which servers a start plans
beside vanilla and xmix, and which configurations the rounds run on them.

A configuration is a server plus the per-request selection (``--extra-body '{"vllm_xargs":
{"xmix": [...]}}'``). Configurations (``--configs`` selects a subset; vanilla always runs;
unknown names are an error): vanilla, inactive (apps deployed, none on), steer_one, steer_all,
ablate_all, probe_one, seal, cast, router_mask (MoE models), steer_all_K16 / steer_all_K256
(steer_all with 16 / 256 distinct per-request scales in one stream), all_apps (every app but
router_mask on every request).

``start --second plain`` / ``empty`` calibrate the A/B itself (A/A): the second server is
vLLM without the plugin again, or with the plugin and nothing deployed, and the one
configuration ``aa_plain`` / ``aa_empty`` measures what the pair's offset is without apps.
``start --control`` keeps the normal pair and adds a third server, plain vLLM again
(configuration ``aa_plain``, run next to vanilla in every round): each round then carries
its own A/A line (give each server ``--gpu-mem`` 0.3). ``--control plain,empty`` adds a fourth
as well, the plugin loaded with nothing deployed (``aa_empty``): beside the apps-off line it
splits what the plugin's patches cost from what a deployment's hook ops cost (``--gpu-mem``
0.22 each). A/A lines go to latest.json's
``calibration`` (a row of their own in the Current table, no budget line).
``start --alt-variants MODE`` adds one more server: the plugin with the same deployment and
another CUDA-graph variant policy (:data:`ALT_VARIANTS`: ``onoff``, two variants, app-free and
every site; ``pieces``, per-app FULL graphs and two piecewise tables; ``pieces64``, the same
with per-app FULL graphs up to 64 tokens (larger decode batches with an app on replay the
every-site graphs); ``none``, one capture
with every hook op), port + 4, configurations ``alt_inactive`` and ``alt_<app>``: what the
default per-app variants buy in latency against what they cost in start-up and graph memory
(each server's start-up and capture go to servers.json), measured in the same rounds. Those
lines are not the default setting's: summary.md has them, latest.json does not.

``<out>/sweep/`` (:func:`write_sweep_files`, written by ``serve rounds``): the same experiment
as ``vllm bench sweep serve`` parameter files, with what a sweep cannot express.
"""

from __future__ import annotations

import json
import os

from . import common

K_CONFIGS = (16, 256)

#: ``start --control`` kinds: the extra server's name, its port's offset from vanilla's
CONTROLS = {"plain": ("control", 2), "empty": ("control_empty", 3)}

#: ``start --alt-variants`` modes: the environment that sets the alternative server's CUDA-graph
#: variant policy (``vllm_xmix.runtime.variants``)
ALT_VARIANTS = {"onoff": {"VLLM_XMIX_GRAPH_VARIANTS": "onoff"},
                "pieces": {"VLLM_XMIX_PIECEWISE_VARIANTS": "onoff"},
                "pieces64": {"VLLM_XMIX_PIECEWISE_VARIANTS": "onoff", "VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE": "64"},
                "none": {"VLLM_XMIX_GRAPH_VARIANTS": "0"}}
#: the alternative server's name and its port's offset from vanilla's
ALT_SERVER = ("alt", 4)


def control_kinds(control) -> list[str]:
    """The extra servers of ``start --control`` (``servers.json``'s ``control``: a comma list, or
    a bool as older folders hold it) in :data:`CONTROLS` order.

    Raises:
        ValueError: a kind other than plain / empty."""
    if isinstance(control, bool) or control is None:
        return ["plain"] if control else []
    kinds = [k for k in str(control).split(",") if k]
    bad = [k for k in kinds if k not in CONTROLS]
    if bad:
        raise ValueError(f"--control: unknown server kind(s) {bad}; known: {', '.join(CONTROLS)}")
    return [k for k in CONTROLS if k in kinds]


def configs_for(app_names: list[str], second: str = "xmix", control=False,
                alt: str | None = None) -> dict[str, tuple[str, object]]:
    """name -> (server, the requests' vllm_xargs["xmix"], "K<k>" for k distinct configs, or None).
    ``second`` (``start --second``): ``plain`` / ``empty``: the A/A calibration's one
    configuration, ``aa_plain`` / ``aa_empty``, the second server with no selection.
    ``control`` (``start --control``, see :func:`control_kinds`): ``aa_plain`` / ``aa_empty`` on
    the extra servers, next to vanilla. ``alt`` (``start --alt-variants``, a mode, or None):
    ``alt_inactive`` and ``alt_<app>`` for each app, on the alternative server."""
    if second != "xmix":
        return {"vanilla": ("vanilla", None), f"aa_{second}": ("xmix", None)}
    out = {"vanilla": ("vanilla", None)}
    for kind in control_kinds(control):
        out[f"aa_{kind}"] = (CONTROLS[kind][0], None)
    out["inactive"] = ("xmix", None)
    for n in app_names:
        out[n] = ("xmix", [n])
    for k in K_CONFIGS:  # steer_all with k different per-request scales; k=1 is "steer_all"
        out[f"steer_all_K{k}"] = ("xmix", f"K{k}")
    out["all_apps"] = ("xmix", [n for n in app_names if n != "router_mask"])
    if alt:
        out["alt_inactive"] = (ALT_SERVER[0], None)
        for n in app_names:
            out[f"alt_{n}"] = (ALT_SERVER[0], [n])
    return out


def selected_configs(configs: dict, selection: str) -> dict:
    """``configs`` (name -> (server, selection)) restricted to the comma-separated names of
    ``selection``, in that order, after ``vanilla`` (always first, once). Unknown names are the
    caller's to refuse."""
    names = ["vanilla"] + [n for n in dict.fromkeys(selection.split(",")) if n and n != "vanilla" and n in configs]
    return {n: configs[n] for n in names}


def k_selections(k: int) -> list[dict]:
    return [{"xmix": json.dumps([{"name": "steer_all", "scale": round(0.25 + 0.5 * i / k, 6)}])} for i in range(k)]


def write_sweep_files(out: str, st: dict, dataset_args: list[str], configs: dict, rates: list[str],
                      num_prompts: int) -> None:
    """The same experiment as ``vllm bench sweep serve`` parameter files (``serve_params.json``,
    ``bench_params.json``, ``bench_params_vanilla.json``, ``commands.sh``): one xmix server (the
    deployment's ``--config``), one bench entry per configuration and rate (its ``extra_body``).
    What a sweep cannot express is left out and said so in commands.sh: vanilla needs
    ``VLLM_PLUGINS=`` in the server's environment (a second sweep with the vanilla entries only),
    the K-distinct configurations carry per-request selections, the A/A servers of ``--control``
    are left out, and a sweep runs configurations one after the other per server, not
    interleaved across the servers."""
    os.makedirs(out, exist_ok=True)
    bench, vanilla = {}, {}
    for rate in rates:
        for name, (srv, xmix) in configs.items():
            if isinstance(xmix, str):
                continue  # K distinct configs: per-request selections
            if srv.startswith("control") or srv == ALT_SERVER[0]:
                continue  # the A/A servers (--control) are calibration, the alternative policy another setting
            e = {"request_rate": rate}
            if xmix is not None:
                e["extra_body"] = json.dumps({"vllm_xargs": {"xmix": xmix}})
            (vanilla if srv == "vanilla" else bench)[f"{name}_r{rate}"] = e
    common.write_json(os.path.join(out, "serve_params.json"), {"xmix": {"config": st["xmix_config"]}})
    common.write_json(os.path.join(out, "bench_params.json"), bench)
    common.write_json(os.path.join(out, "bench_params_vanilla.json"), vanilla)
    serve = " ".join(["vllm serve", st["serving_dir"], "--load-format dummy"] + st["server_args"])
    bcmd = " ".join(["vllm bench serve --backend vllm", "--model", st["serving_dir"], "--tokenizer", st["serving_dir"]]
                    + dataset_args + ["--num-prompts", str(num_prompts), "--ignore-eos"])
    with open(os.path.join(out, "commands.sh"), "w") as f:
        f.write(
            "# vllm bench sweep serve: the xmix configurations (one server, configurations in sequence,\n"
            "# the prefix cache reset between runs), then vanilla (plugin not loaded) with its own sweep.\n"
            "# Not expressible as sweep parameters: the K-distinct configurations (per-request\n"
            "# selections), and the interleaving of vanilla and xmix runs (A B A B) of `serve rounds`.\n"
            f"vllm bench sweep serve --serve-cmd '{serve}' --bench-cmd '{bcmd}' \\\n"
            f"    --serve-params {out}/serve_params.json --bench-params {out}/bench_params.json "
            f"-o {out}/results -e xmix\n"
            f"VLLM_PLUGINS= vllm bench sweep serve --serve-cmd '{serve}' --bench-cmd '{bcmd}' \\\n"
            f"    --bench-params {out}/bench_params_vanilla.json -o {out}/results -e vanilla\n")
