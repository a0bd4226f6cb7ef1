"""serve: serving A/B with vLLM's own client (`vllm bench serve`): plain vLLM against the
plugin's server, each app on every request, rounds interleaved, ratios to plain vLLM.

Two servers on the same GPU (each ``--gpu-mem`` 0.42 by default): ``vanilla`` (vLLM without the
plugin, ``VLLM_PLUGINS=""``) and ``xmix`` (the benchmark deployment, ``common.serving_apps``,
given through vLLM's ``--config`` YAML as ``additional-config``: vectors in safetensors files,
since an inline deployment can exceed the OS limit on one argument). Dummy weights; a word-level
tokenizer over "t0".."t{V-1}" with the model's exact vocabulary, so prompt text is re-encoded by
the server to exactly the intended tokens. vLLM defaults otherwise: torch.compile,
FULL_AND_PIECEWISE CUDA graphs, prefix caching, chunked prefill.

Actions (so that short GPU access counts: start the servers once, run rounds in later commands):

* ``start``: builds the serving folder under ``--out``, starts the two servers one after the
  other with ``setsid`` (so that they outlive this command), waits until
  both answer, and records in ``<out>/servers.json`` and latest.json their start-up time (launch
  to the first answer of ``/health``) and CUDA-graph capture (seconds, GiB, from the logs). Each
  server compiles into caches of its own (vLLM's, Inductor's and Triton's, under
  ``<out>/caches/<server>``, :func:`server_caches`): with one shared cache the server started
  second finds kernels and graphs the first one compiled, and its start-up reads short. A
  server's caches are ``cold`` at its first start in ``--out`` and ``warm`` at a later one
  (``serve stop``, then ``start`` again: both servers warm); servers.json and latest.json record
  which, and the report judges the start-up line only where both servers' caches were alike.
  ``--shared-caches`` keeps the environment's caches (recorded as ``shared``). ``--pin-cpus``
  puts each server, and the client of the rounds, on whole physical cores of its own
  (``cpu_pinning.py``; the split in servers.json).
* ``rounds``: against the running servers: for each ``--rates`` rate, ``--warmup`` discarded
  rounds, then ``--repeats`` rounds; in each round every configuration once (vanilla, inactive,
  app1, app2, ..., and with ``--order abba``, the default, the even-numbered rounds of the
  folder in reverse: a run's position in its round, after the GPU ran another server's run or
  sat idle, and drift over the rounds cancel over pairs of rounds). A configuration
  is a server plus the per-request selection (``--extra-body '{"vllm_xargs": {"xmix": [...]}}'``).
  ``vllm bench serve`` runs in this process, and every run replaces the first token of each
  prompt with a fresh one, so no run is served from another run's prefix cache. Rounds add to
  ``<out>/results.json`` (numbered on from the rounds already there; written after every run),
  then ``summary.md`` (per rate: medians and the ratio to vanilla with a bootstrap 95% CI over
  rounds), ``overhead.png`` (with matplotlib), latest.json (per configuration the median ratio
  and its range for mean ITL, P99 ITL, mean TTFT, throughput) and ``sweep/`` (the same experiment
  as ``vllm bench sweep serve`` parameter files, with what a sweep cannot express).
  ``--profile CONFIGS`` (servers started with ``--profiler``): afterwards one run of vanilla and
  of each listed configuration under vLLM's torch profiler; vLLM's per-kernel tables are kept
  as ``profile_<config>.txt``, each trace's per-step summary (``profile trace``) as
  ``trace_<config>.json``, and ``trace_<config>_vs_vanilla.md`` sets them side by side; the raw
  traces stay in ``prof_vanilla/`` and ``prof_xmix/``. ``--api-sample CONFIGS`` (any servers):
  afterwards one run of vanilla and of each listed configuration with py-spy sampling the
  server's API server (``api_sample``: GIL-held microseconds per output token, the functions
  whose time grew); ``--api-profile CONFIGS`` (servers started with ``--profile-api``) the same
  under cProfile (calls exact, times inflated).
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
  every site; ``pieces``, per-app FULL graphs and two piecewise tables; ``none``, one capture
  with every hook op), port + 4, configurations ``alt_inactive`` and ``alt_<app>``: what the
  default per-app variants buy in latency against what they cost in start-up and graph memory
  (each server's start-up and capture go to servers.json), measured in the same rounds. Those
  lines are not the default setting's: summary.md has them, latest.json does not.
  Every run also records the CPU time of the server's processes over the run
  (``cpu_usage.CpuMeter``: the API server and the engine core, each busy fraction and its
  busiest thread's), so a throughput line can be traced to the process that bounded it, and
  the split of its mean TTFT by vLLM's own per-request metrics (``server_metrics``: front end,
  queue, prefill; a table of its own in summary.md), so a TTFT line can be traced to the part
  of the serving path it lies in. With ``start --record-steps`` every server (through
  ``recorded_server.py``) records each engine step its engine core runs (``engine_steps``), and
  every run carries a summary of the steps that ran during it (``engine_steps`` in results.json:
  step periods of decode steps and of prefill-carrying steps up to / over 512 tokens, the host
  time of the scheduler's two calls; a table of its own in summary.md).
* ``stop``: stops the servers (SIGTERM to their process groups, then SIGKILL).
* ``all``: start, rounds, stop in one process (the servers are stopped on exit and on SIGTERM).
* ``summarize``: rebuilds summary.md / overhead.png from results.json.

Datasets (``--dataset``): ``sharegpt`` (default): ShareGPT-format conversations whose prompt
lengths follow LogNormal(mu=5.0, sigma=0.9) tokens clipped to [4, ``--max-prompt-len``] (median
~150, mean ~220: an approximation of ShareGPT v3 prompt lengths under a Llama-3 tokenizer, no
download); ``random``: vLLM's random dataset, ``--input-len`` tokens +-``--range-ratio``. Outputs
are ``--output-len`` tokens (ignore_eos).

Configurations (``--configs`` selects a subset; vanilla always runs; unknown names are an error):
vanilla, inactive (apps deployed, none on), steer_one, steer_all, ablate_all, probe_one, seal,
cast, router_mask (MoE models), steer_all_K16 / steer_all_K256 (steer_all with 16 / 256 distinct
per-request scales in one stream), all_apps (every app but router_mask on every request).

With one round a ratio's interval is the point itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from . import common
from .cpu_usage import CpuMeter
from .cpu_usage import summary as cpu_summary
from . import api_sample, cpu_pinning, engine_steps, profiled_server, server_metrics

HELP = "serving A/B with `vllm bench serve`: plain vLLM vs the plugin, each app on every request"
K_CONFIGS = (16, 256)
STATE = "servers.json"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = sub.add_parser("start", help="start the servers (they keep running after this command)")
    rounds = sub.add_parser("rounds", help="run rounds against the running servers")
    stop = sub.add_parser("stop", help="stop the servers of --out")
    everything = sub.add_parser("all", help="start, rounds, stop in one command")
    summ = sub.add_parser("summarize", help="rebuild summary.md / overhead.png from results.json")
    for q in (start, rounds, stop, everything, summ):
        q.add_argument("--out", required=True, help="the experiment's folder (servers.json, results.json, ...)")
    for q in (start, everything):
        _server_options(q)
    for q in (rounds, everything):
        _round_options(q)
    for q in (start, rounds, everything):
        q.add_argument("--latest", default=str(common.LATEST), help="latest.json to update")
        q.add_argument("--no-latest", action="store_true", help="do not update latest.json")


def _server_options(q) -> None:
    q.add_argument("--model", required=True, help="model config folder (benchmarks/models/...)")
    q.add_argument("--gpu-mem", type=float, default=0.42, help="--gpu-memory-utilization of each server")
    q.add_argument("--max-model-len", type=int, default=4096)
    q.add_argument("--dtype", default="bfloat16")
    q.add_argument("--fused-writes", choices=["auto", "none", "adds", "all", "norm"], default="auto",
                   help="the deployment's fused_writes (what compiled graphs apply as torch ops)")
    q.add_argument("--server-args", default="", help="extra arguments for both servers (e.g. --enforce-eager)")
    q.add_argument("--shared-caches", action="store_true",
                   help="the servers compile into the environment's caches, not each into its own under "
                        "<out>/caches (the start-up of the server started second then reads short)")
    q.add_argument("--second", choices=["xmix", "plain", "empty"], default="xmix",
                   help="the second server: xmix (the benchmark deployment); for an A/A calibration of the "
                        "A/B itself, plain (vLLM without the plugin again: configuration aa_plain) or empty "
                        "(the plugin loaded, nothing deployed: aa_empty)")
    q.add_argument("--control", nargs="?", const="plain", default="", type=_control_arg, metavar="KINDS",
                   help="extra servers measured next to vanilla in every round, a comma list of: plain (vLLM "
                        "without the plugin again: configuration aa_plain, port + 2; the default of a bare "
                        "--control), so that every round measures the pair's own offset beside the apps; empty "
                        "(the plugin loaded, nothing deployed: aa_empty, port + 3)")
    q.add_argument("--alt-variants", choices=sorted(ALT_VARIANTS), default=None, metavar="MODE",
                   help="one more server, port + 4: the plugin with the same deployment and another CUDA-graph "
                        "variant policy (onoff: app-free and every site; pieces: per-app FULL graphs, two "
                        "piecewise tables; none: one capture, every hook op): configurations alt_inactive, "
                        "alt_<app>, in summary.md, not in latest.json")
    q.add_argument("--servers", default="", metavar="NAMES",
                   help="start only these of the servers (comma-separated: vanilla, xmix, control, ...), e.g. "
                        "one at a time where two do not fit on the GPU (Mixtral-8x7B on an 80 GB card): start "
                        "vanilla, its rounds, stop; then start xmix in the same --out, its rounds (paired with "
                        "vanilla's by round number), stop. The records of servers started earlier in --out are "
                        "kept, so start-up and graph memory still compare both")
    q.add_argument("--port", type=int, default=8101, help="vanilla server port (xmix: port + 1)")
    q.add_argument("--start-timeout", type=float, default=900, help="seconds each server may take to answer")
    q.add_argument("--profiler", action="store_true",
                   help="start both servers with vLLM's torch profiler configured (for rounds --profile)")
    q.add_argument("--profile-steps", default="100,600", metavar="DELAY,MAX",
                   help="engine steps skipped before the profiler starts, and the most steps it records "
                        "(vLLM's delay_iterations / max_iterations; 0,0: the whole run)")
    q.add_argument("--profile-stack", action="store_true",
                   help="record Python stacks in the profiles (larger traces; `profile compare` then lists "
                        "the Python functions whose host time per step grew)")
    q.add_argument("--profile-api", action="store_true",
                   help="every server's API server (its main thread) can be profiled by signal (profiled_server.py) "
                        "into <out>/api_profile_<server>/; rounds --api-profile then profiles one run per configuration")
    q.add_argument("--record-steps", action="store_true",
                   help="every server records each engine step it runs (engine_steps: schedule and update host "
                        "times, the step's output arrival, tokens) to <out>/steps_<server>/; rounds then attach "
                        "each run's step periods (decode, mixed <=512 / >512 tokens) to its record")
    q.add_argument("--pin-cpus", action="store_true",
                   help="each server, and the rounds' client, on whole physical CPU cores of its own "
                        "(cpu_pinning.py: of the CPUs this command may use, the first core to the client, the "
                        "others dealt evenly to the servers, two at least each, every hardware thread of each): "
                        "the servers of a pair then run their host work under the same conditions; pinned rounds "
                        "pair only with pinned rounds, and their workload in latest.json says so")


def _round_options(q) -> None:
    q.add_argument("--rates", default="8,32,inf", help="comma-separated request rates (inf: saturation)")
    q.add_argument("--repeats", type=int, default=3, help="measured rounds (0: warm-up rounds only)")
    q.add_argument("--warmup", type=int, default=1, help="discarded rounds before them")
    q.add_argument("--warmup-prompts", type=_non_negative, default=0,
                   help="prompts per run of a discarded round (0: --num-prompts); a short warm-up round per "
                        "rate takes the first run of each server at that rate out of the measured rounds")
    q.add_argument("--num-prompts", type=int, default=250)
    q.add_argument("--output-len", type=int, default=128)
    q.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    q.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: longest prompt")
    q.add_argument("--input-len", type=int, default=256, help="random: mean prompt length")
    q.add_argument("--range-ratio", type=float, default=0.9, help="random: prompt lengths input-len * (1 +- this)")
    q.add_argument("--configs", default="",
                   help="comma-separated subset, run in this order after vanilla (which always runs first; abba "
                        "reverses the whole order in odd rounds). ABBA cancels a linear drift, not a hump in the "
                        "middle of a pair of rounds: a configuration expected at zero (the A/A control aa_plain, "
                        "or inactive) placed last, at the centre of the pair, witnesses one")
    q.add_argument("--order", choices=["abba", "fixed"], default="abba",
                   help="configurations per round: abba (rounds with an even number, counted over the "
                        "folder's results.json, in reverse, so that a run's position in its round, e.g. after a "
                        "loaded or an idle GPU, cancels over pairs of rounds: give an even --repeats) or fixed "
                        "(vanilla, the A/A lines, inactive, then the deployment's apps, in every round)")
    q.add_argument("--wait", type=float, default=900, help="seconds to wait for the servers to answer")
    q.add_argument("--profile", default="", metavar="CONFIGS",
                   help="after the rounds, one run of vanilla and of each of these configurations (comma-separated; "
                        "at the first rate, at most 100 prompts) under vLLM's torch profiler (servers started with "
                        "--profiler): <out>/profile_<config>.txt, trace_<config>.json, trace_<config>_vs_vanilla.md")
    q.add_argument("--api-profile", default="", metavar="CONFIGS",
                   help="after the rounds, one run of vanilla and of each of these configurations (comma-separated; "
                        "at the first rate) with the API server's main thread under cProfile (servers started with "
                        "--profile-api): Python calls and profiled CPU per output token, the plugin's share, the "
                        "functions whose time grew; <out>/api_profile.json (each configuration's latest profile; "
                        "vanilla is profiled again in every call) and api_profile_<config>.prof")
    q.add_argument("--api-sample", default="", metavar="CONFIGS",
                   help="after the rounds, one run of vanilla and of each of these configurations (comma-separated; "
                        "at the first rate) with the server's API server sampled by py-spy (the GIL-holding thread; "
                        "any server, py-spy on PATH or at $XMIX_PY_SPY): GIL-held us per output token, the functions "
                        "whose self and inclusive time grew; <out>/api_sample.json (each configuration's latest run; "
                        "vanilla again in every call) and api_sample_<config>.txt (py-spy's raw stacks)")


def main(args) -> int:
    if args.action == "summarize":
        runs = common.read_json(os.path.join(args.out, "results.json"), []) or []
        if not runs:
            args._parser.error(f"no runs in {args.out}/results.json (missing, or only warm-up rounds were run)")
        print(summarize(runs, args.out))
        return 0
    if args.action == "stop":
        stop(args.out)
        return 0
    if args.action == "start":
        start(args)
        return 0
    if args.action == "rounds":
        return rounds(args)
    # all: the servers run under their own setsid and would outlive a SIGTERM (e.g. `timeout`)
    # of this process; the handler ends it through the finally below, which stops them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        start(args, profiler=args.profiler or bool(args.profile))
        return rounds(args)
    finally:
        stop(args.out)


# ------------------------------------------------------------------------------ set-up


def build_serving_dir(model_dir: str, out_dir: str) -> str:
    """Config + a word-level tokenizer with exactly the model's vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = common.load_config(model_dir)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no special tokens: every id decodes to visible text, so streamed chunks (and ITL) never
    # vanish when dummy weights make the model emit the BOS/EOS ids (ignore_eos is on)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)
    return out_dir


def build_sharegpt(path: str, n: int, vocab: int, seed: int = 0, output_len: int = 128, max_len: int = 1024) -> None:
    """ShareGPT-format conversations; prompt lengths LogNormal(5.0, 0.9) clipped to [4, max_len]
    (vLLM's ShareGPT loader drops prompts over 1024 tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(5.0, 0.9, n)), 4, max_len).astype(int)
    convs = []
    for i, L in enumerate(lens):
        ids = rng.integers(10, vocab - 10, int(L))
        out_ids = rng.integers(10, vocab - 10, output_len)
        convs.append({"id": f"synth-{i}", "conversations": [
            {"from": "human", "value": " ".join(f"t{x}" for x in ids)},
            {"from": "gpt", "value": " ".join(f"t{x}" for x in out_ids)}]})
    common.write_json(path, convs, indent=None)


#: ``start --control`` kinds: the extra server's name, its port's offset from vanilla's
CONTROLS = {"plain": ("control", 2), "empty": ("control_empty", 3)}

#: ``start --alt-variants`` modes: the environment that sets the alternative server's CUDA-graph
#: variant policy (``vllm_xmix.runtime.variants``)
ALT_VARIANTS = {"onoff": {"VLLM_XMIX_GRAPH_VARIANTS": "onoff"},
                "pieces": {"VLLM_XMIX_PIECEWISE_VARIANTS": "onoff"},
                "none": {"VLLM_XMIX_GRAPH_VARIANTS": "0"}}
#: the alternative server's name and its port's offset from vanilla's
ALT_SERVER = ("alt", 4)
def _xmix_settings() -> tuple[str, ...]:
    """The plugin's settings among its environment variables (those that enter the compile cache
    key; not the admin key): servers.json records the xmix server's, the alternative server drops
    them."""
    from vllm_xmix._vllm_compat.envs import PLUGIN_ENV

    return tuple(k for k, setting in PLUGIN_ENV.items() if setting)


def _control_arg(text: str) -> str:
    """``--control``'s value, checked when the command line is parsed (see :func:`control_kinds`)."""
    try:
        return ",".join(control_kinds(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return n


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


# ------------------------------------------------------------------------------ servers


#: the module that runs ``vllm serve`` with its engine steps recorded (``start --record-steps``)
RECORDED_SERVER = "benchmarks.xmix_bench.recorded_server"


class Server:
    """One ``vllm serve`` started with setsid (its process group id is its pid)."""

    def __init__(self, name: str, port: int, log: str, pid: int, steps_dir: str | None = None,
                 api_profile: str | None = None, cpus: list[int] | None = None):
        self.name, self.port, self.log, self.pid = name, port, log, pid
        #: the logical CPUs its processes are pinned to (``start --pin-cpus``), else None
        self.cpus = cpus
        #: the folder its engine steps are recorded in (``start --record-steps``), else None
        self.steps_dir = steps_dir
        #: the path prefix of its API server's profiles (``start --profile-api``), else None
        self.api_profile = api_profile
        self.proc: subprocess.Popen | None = None

    @classmethod
    def launch(cls, name: str, serving_dir: str, port: int, log: str, args: list[str], env: dict,
               steps_dir: str | None = None, api_profile: str | None = None,
               cpus: list[int] | None = None) -> "Server":
        """``steps_dir``: run ``vllm serve`` through :data:`RECORDED_SERVER` (the same arguments),
        recording its engine steps there (the folder is emptied first); ``api_profile``: the
        same launcher, its API server profiled by signal (``profiled_server.py``) into files
        named ``<api_profile>.<k>`` (its folder is emptied first); ``cpus``: the logical CPUs the
        server's processes run on (:func:`server_preexec`)."""
        serve_args = ["serve", serving_dir, "--port", str(port), "--host", "127.0.0.1", "--load-format", "dummy"]
        if steps_dir:
            shutil.rmtree(steps_dir, ignore_errors=True)
            os.makedirs(steps_dir)
            env = dict(env, **{engine_steps.ENV: steps_dir})
        if api_profile:
            shutil.rmtree(os.path.dirname(api_profile), ignore_errors=True)
            os.makedirs(os.path.dirname(api_profile))
            env = dict(env, **{profiled_server.ENV: api_profile})
        if steps_dir or api_profile:
            cmd = [sys.executable, "-m", RECORDED_SERVER] + serve_args + args
        else:
            cmd = common.TOOL + ["vllm"] + serve_args + args
        with open(log, "w") as f:
            # setsid in the child: the server outlives this command (the next commands run rounds)
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=common.REPO,
                                    preexec_fn=server_preexec(cpus))
        s = cls(name, port, log, proc.pid, steps_dir, api_profile, cpus)
        s.proc = proc
        return s

    @classmethod
    def from_record(cls, r: dict) -> "Server":
        return cls(r["name"], r["port"], r["log"], r["pid"], r.get("steps_dir"), r.get("api_profile"), r.get("cpus"))

    def record(self) -> dict:
        out = {"name": self.name, "port": self.port, "log": self.log, "pid": self.pid}
        if self.steps_dir:
            out["steps_dir"] = self.steps_dir
        if self.api_profile:
            out["api_profile"] = self.api_profile
        if self.cpus:
            out["cpus"] = self.cpus
        return out

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:  # started by an earlier command: ours if its command line is this tool's server
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            return False
        return (b"benchmarks.xmix_bench" in cmd or RECORDED_SERVER.encode() in cmd) and b"serve" in cmd

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
            return True
        except Exception:
            return False

    def wait(self, timeout: float = 900) -> float:
        """Seconds until the server answers (raises if it exits or takes longer)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.healthy():
                return time.time() - t0
            if not self.alive():
                raise RuntimeError(f"{self.name} server is not running; see {self.log}")
            time.sleep(2)
        raise RuntimeError(f"{self.name} server did not answer in {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; returns once no process of
        the group is left (its engine core, which holds the GPU memory, exits after the API
        server: a server started next on the same GPU measures the memory free)."""
        if not self.alive():
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
            for _ in range(60):
                if self.proc is not None:
                    self.proc.poll()
                if not self.alive():
                    break
                time.sleep(1)
            else:
                os.killpg(self.pid, signal.SIGKILL)
            for _ in range(120):
                if self.proc is not None:
                    self.proc.poll()
                os.killpg(self.pid, 0)  # (ProcessLookupError once the group is gone)
                time.sleep(0.5)
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def server_preexec(cpus: list[int] | None):
    """What a server's process runs before ``exec``: its own session (``setsid``: the server
    outlives the command that started it, and its process group is its pid), and with ``cpus``
    its CPU mask (inherited by the engine core and workers it starts)."""
    def preexec() -> None:
        os.setsid()
        if cpus:
            cpu_pinning.pin(cpus)

    return preexec


GRAPH_LINE = re.compile(r"Graph capturing finished in (\d+(?:\.\d+)?) secs, took (\d+(?:\.\d+)?) GiB")
_F = r"(-?\d+(?:\.\d+)?)"
VARIANT_LINE = re.compile(rf"graph variant (0x[0-9a-f]+) captured in {_F} s: (\d+) CUDA graphs, {_F} GiB "
                          rf"\(allocator pool {_F} GiB, driver {_F} GiB\)")


def graph_capture(log: str) -> dict:
    """Seconds and GiB of the CUDA-graph capture, from a server log (None without graphs)."""
    try:
        with open(log, errors="replace") as f:
            m = [GRAPH_LINE.search(line) for line in f]
    except OSError:
        return {}
    m = [x for x in m if x]
    out = {"graph_s": float(m[-1].group(1)), "graph_gib": float(m[-1].group(2))} if m else {}
    with open(log, errors="replace") as f:  # the plugin's per-variant capture costs, when logged
        v = [x.groups() for x in map(VARIANT_LINE.search, f) if x]
    if v:
        out["variants"] = [{"mask": a, "s": float(b), "graphs": int(c), "gib": float(d), "pool_gib": float(e),
                            "driver_gib": float(g)} for a, b, c, d, e, g in v]
    return out


#: compile caches a server keeps under ``<out>/caches/<server>`` (variable -> sub-folder)
CACHE_VARS = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def server_caches(out: str, name: str, env: dict) -> tuple[dict, str]:
    """``env`` with the server's own compile caches (:data:`CACHE_VARS` under
    ``<out>/caches/<name>``) and their state: ``"cold"`` (nothing there yet: the server compiles
    everything) or ``"warm"`` (an earlier start in ``out`` left compiled code in them: vLLM's
    ``torch_compile_cache``, Inductor's or Triton's cache; vLLM's model-registry entries alone
    do not count)."""
    root = os.path.join(out, "caches", name)
    compiled = [os.path.join(root, CACHE_VARS["VLLM_CACHE_ROOT"], "torch_compile_cache"),
                os.path.join(root, CACHE_VARS["TORCHINDUCTOR_CACHE_DIR"]), os.path.join(root, CACHE_VARS["TRITON_CACHE_DIR"])]
    warm = any(os.path.isdir(d) and any(os.scandir(d)) for d in compiled)
    return dict(env, **{k: os.path.join(root, sub) for k, sub in CACHE_VARS.items()}), "warm" if warm else "cold"


def start(args, profiler: bool | None = None) -> dict:
    """Start the servers (all of them, or those of ``--servers``), one after the other (each
    start-up measures its own memory)."""
    from vllm_xmix import deploy

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    old = common.read_json(os.path.join(out, STATE))
    if old and any(Server.from_record(old["servers"][n]).alive()
                   for n in (old.get("up") or list(old["servers"])) if n in old["servers"]):
        raise SystemExit(f"{out}: servers of an earlier start are still running (serve stop --out {args.out})")
    # every server this start plans, in launch order (a start of some of them keeps their CPU shares)
    planned = (["vanilla", "xmix"] + [CONTROLS[k][0] for k in control_kinds(args.control)]
               + ([ALT_SERVER[0]] if getattr(args, "alt_variants", None) else []))
    split = None
    if getattr(args, "pin_cpus", False):  # (before anything is written: a refused split leaves --out as it was)
        try:
            split = cpu_pinning.partition(cpu_pinning.physical_cores(), len(planned))
        except cpu_pinning.PinningError as e:
            raise SystemExit(str(e)) from None
    cfg = common.load_config(args.model)
    serving = build_serving_dir(args.model, os.path.join(out, "model"))
    apps = common.serving_apps(cfg, os.path.join(out, "vectors"))
    # the deployment goes in through vLLM's --config YAML (JSON is YAML): a token set of 25k ids
    # would make an --additional-config argument longer than the OS allows (128 KiB)
    xmix_cfg = os.path.join(out, "xmix_config.yaml")
    common.write_json(xmix_cfg, {"additional-config": deploy(*apps, fused_writes=args.fused_writes)}, indent=None)
    server_args = ["--gpu-memory-utilization", str(args.gpu_mem), "--max-model-len", str(args.max_model_len),
                   "--dtype", args.dtype] + args.server_args.split()
    profiler = args.profiler if profiler is None else profiler
    prof_args = {}
    if profiler:
        delay, most = (int(x) for x in args.profile_steps.split(","))
        for srv in ("vanilla", "xmix"):
            prof_args[srv] = ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": os.path.join(out, f"prof_{srv}"),
                "torch_profiler_with_stack": args.profile_stack, "torch_profiler_use_gzip": True,
                "ignore_frontend": True, "delay_iterations": delay, "max_iterations": most})]
    st = {"model": os.path.abspath(args.model), "model_name": common.model_name(args.model),
          "vocab_size": cfg["vocab_size"], "serving_dir": serving, "xmix_config": xmix_cfg,
          "apps": [a.name for a in apps] if args.second == "xmix" else [], "second": args.second,
          "fused_writes": args.fused_writes, "server_args": server_args,
          "xmix_env": {k: os.environ[k] for k in _xmix_settings() if k in os.environ},
          "profiler": profiler, "commit": common.git_commit(), "date": common.today(), "card": common.gpu_card(),
          "command": common.command_line(), "servers": {}}
    record_steps = getattr(args, "record_steps", False)
    if record_steps:
        st["record_steps"] = True
    profile_api = getattr(args, "profile_api", False)
    if profile_api:
        st["profile_api"] = True
    second_args = ["--config", xmix_cfg] if args.second == "xmix" else []
    second_env = dict(os.environ, VLLM_PLUGINS="") if args.second == "plain" else dict(os.environ)
    plans = (("vanilla", args.port, server_args + prof_args.get("vanilla", []), dict(os.environ, VLLM_PLUGINS="")),
             ("xmix", args.port + 1, server_args + second_args + prof_args.get("xmix", []), second_env))
    kinds = control_kinds(args.control)
    if kinds and args.second != "xmix":
        raise SystemExit("--control: only with --second xmix (the A/A pair already is one)")
    for kind in kinds:
        name, offset = CONTROLS[kind]
        env = dict(os.environ, VLLM_PLUGINS="") if kind == "plain" else dict(os.environ)
        plans += ((name, args.port + offset, server_args, env),)
    st["control"] = ",".join(kinds)
    alt = getattr(args, "alt_variants", None)
    if alt:
        if args.second != "xmix":
            raise SystemExit("--alt-variants: only with --second xmix (it serves the same deployment)")
        # the mode's settings only: variables of the plugin set in this shell would change its policy
        alt_env = {k: v for k, v in os.environ.items() if k not in _xmix_settings()}
        alt_env.update(ALT_VARIANTS[alt])
        plans += ((ALT_SERVER[0], args.port + ALT_SERVER[1], server_args + second_args, alt_env),)
        st["alt_variants"] = {"mode": alt, "env": ALT_VARIANTS[alt]}
    assert [p[0] for p in plans] == planned, ([p[0] for p in plans], planned)
    if split is not None:
        st["pin_cpus"] = {"client": split[0], "servers": dict(zip(planned, split[1]))}
    wanted = [n for n in dict.fromkeys(getattr(args, "servers", "").split(",")) if n]
    if wanted:
        unknown = sorted(set(wanted) - {p[0] for p in plans})
        if unknown:
            raise SystemExit(f"--servers: unknown server(s) {unknown}; this start has {', '.join(p[0] for p in plans)}")
        if len(wanted) < len(plans):  # (all of them named: the usual start, interleaved rounds)
            st["one_at_a_time"] = True
        plans = tuple(p for p in plans if p[0] in wanted)
        # servers started earlier in this folder (stopped since: checked above) keep their records
        # (start-up, graph capture); their runs in results.json pair with this start's, so they
        # must have served the same model and deployment the same way
        kept = {n: r for n, r in (old or {}).get("servers", {}).items() if n not in wanted}
        setup = ("model", "apps", "second", "fused_writes", "server_args", "xmix_env", "profiler", "record_steps",
                 "profile_api", "card", "pin_cpus")
        differ = [k for k in setup if kept and old.get(k) != st.get(k)]
        if differ:
            raise SystemExit(f"{out}: the servers started there before ({', '.join(kept)}) ran with other settings "
                             f"({', '.join(differ)}); their runs would pair with this start's: use another --out")
        st["servers"] = kept
        if kept:  # (the servers of an earlier start and this one's: one at a time)
            st["one_at_a_time"] = True
    st["up"] = [p[0] for p in plans]
    launched = []
    try:
        for name, port, sargs, env in plans:
            if getattr(args, "shared_caches", False):
                cache = "shared"
            else:
                env, cache = server_caches(out, name, env)
            s = Server.launch(name, serving, port, os.path.join(out, f"{name}.log"), sargs, env,
                              steps_dir=os.path.join(out, f"steps_{name}") if record_steps else None,
                              api_profile=os.path.join(out, f"api_profile_{name}", "prof") if profile_api else None,
                              cpus=(st.get("pin_cpus") or {}).get("servers", {}).get(name))
            launched.append(s)
            st["servers"][name] = dict(s.record(), compile_cache=cache)
            common.write_json(os.path.join(out, STATE), st)  # a cut start-up still knows what to stop
            st["servers"][name].update(startup_s=round(s.wait(args.start_timeout), 1), **graph_capture(s.log))
            common.write_json(os.path.join(out, STATE), st)
            print(f"{name} server up: {st['servers'][name]}", flush=True)
    except BaseException:
        for s in launched:  # a failed start leaves nothing running
            s.stop()
        raise
    if not args.no_latest and args.second == "xmix" and {"vanilla", "xmix"} <= set(st["servers"]):
        _latest_startup(args.latest, st)
    return st


def stop(out: str) -> None:
    st = common.read_json(os.path.join(out, STATE))
    servers = (st or {}).get("servers", {})
    # the servers the last start launched (start --servers: not the records kept from earlier
    # starts, whose process ids may belong to other processes by now)
    for n in (st or {}).get("up") or list(servers):
        if n in servers:
            Server.from_record(servers[n]).stop()
    if st:
        print(f"servers of {out} stopped", flush=True)


# ------------------------------------------------------------------------------ rounds


def _dataset(args, st: dict) -> tuple[list[str], str]:
    """vllm bench serve's dataset arguments and the workload's title."""
    if args.dataset == "random":
        lo, hi = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
        return (["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                 str(args.output_len), "--random-range-ratio", str(args.range_ratio)],
                f"{os.path.basename(st['model'])}, random dataset {args.input_len} input tokens "
                f"+-{args.range_ratio:.0%} ({lo}-{hi}), {args.num_prompts} prompts, {args.output_len} output tokens")
    name = f"sharegpt_{args.num_prompts}_{args.output_len}_{args.max_prompt_len}.json"
    path = os.path.join(os.path.abspath(args.out), name)
    if not os.path.exists(path):
        build_sharegpt(path, args.num_prompts, st["vocab_size"], output_len=args.output_len,
                       max_len=args.max_prompt_len)
    title = (f"{os.path.basename(st['model'])}, ShareGPT-like prompt lengths (LogNormal(5.0, 0.9), 4-"
             f"{args.max_prompt_len} tokens), {args.num_prompts} prompts, {args.output_len} output tokens")
    return ["--dataset-name", "sharegpt", "--dataset-path", path, "--sharegpt-output-len", str(args.output_len)], title


def bench(server: Server, st: dict, dataset_args: list[str], rate: str, n: int, sel, result: str, seed: int,
          run_mark: int, profile: bool = False, api_profile: bool = False, api_sample_to: str | None = None) -> dict:
    """One ``vllm bench serve`` run (vLLM's client and metrics, in this process). ``api_profile``:
    the server's API-server profiler (``start --profile-api``) runs from just before the client
    starts (its ready check skipped) to the run's end; ``api_sample_to``: likewise py-spy samples
    the server's API server into that file (:class:`api_sample.Sampler`)."""
    argv = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}", "--model", st["serving_dir"],
            "--tokenizer", st["serving_dir"]] + dataset_args + [
            "--num-prompts", str(n), "--ignore-eos", "--request-rate", rate, "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", os.path.dirname(result), "--result-filename", os.path.basename(result),
            "--disable-tqdm", "--save-detailed"] + (["--profile"] if profile else [])
    if isinstance(sel, list):
        argv += ["--extra-body", json.dumps({"vllm_xargs": {"xmix": sel}})]
    common.XARGS_CYCLE = k_selections(int(sel[1:])) if isinstance(sel, str) else None
    common.RUN_MARK = f"t{run_mark}"  # a fresh first token: no prefix-cache hits across runs
    parts = server_metrics.MetricsMeter(f"http://127.0.0.1:{server.port}")  # where the TTFT went, by vLLM's metrics
    meter = CpuMeter(server.pid)  # which of the server's processes was busy during the run (after the
    # metrics read, whose rendering is API-server work of its own)
    steps = engine_steps.StepMeter(server.steps_dir) if server.steps_dir else None  # the run's engine steps
    on_ready = [steps.restart] if steps is not None else []
    if api_profile or api_sample_to:  # from the run's first request: no ready check (its request alone is not the run's)
        argv += ["--ready-check-timeout-sec", "0"]
    if api_profile:
        os.kill(server.pid, signal.SIGUSR1)
    sampler = api_sample.Sampler(server.pid, api_sample_to) if api_sample_to else None
    res = None
    try:
        with _after_ready_check(on_ready):
            res = common.bench_serve(argv)
    finally:
        common.XARGS_CYCLE = None
        if api_profile:
            os.kill(server.pid, signal.SIGUSR2)
        if sampler is not None:
            try:
                sampler.stop()
            except RuntimeError as e:
                if res is not None:  # the run itself succeeded: the sampler's failure is the error
                    raise
                # the run failed: its error propagates, the sampler's is only reported
                print(f"[serve] {result}: the API-server sampler failed too: {e}", file=sys.stderr)
    res["cpu"] = meter.stop(active_s=res.get("duration"))  # fractions of the benchmark's own duration
    if steps is not None:
        res["engine_steps"] = steps.stop(requests=res.get("completed"), save_to=os.path.splitext(result)[0] + "_steps.npz")
    res["server_metrics"] = parts.stop(expect=res.get("completed"))
    if res.get("completed", n) != n:
        raise RuntimeError(f"{result}: only {res.get('completed')} of {n} requests completed")
    res["timeline"] = timeline(res)
    return res


@contextlib.contextmanager
def _after_ready_check(callbacks: list):
    """While ``vllm bench serve`` runs: each of ``callbacks`` is called at the end of the
    client's ready check, which first sends one whole request alone (the full output length
    with ``--ignore-eos``: a mixed step and ``output_len - 1`` decode steps at batch 1 that are
    not the run's): the step meter's restart."""
    if not callbacks:
        yield
        return
    import vllm.benchmarks.serve as bench_mod

    orig = bench_mod.wait_for_endpoint

    async def wait_for_endpoint(*args, **kwargs):
        out = await orig(*args, **kwargs)
        for fn in callbacks:
            fn()
        return out

    bench_mod.wait_for_endpoint = wait_for_endpoint
    try:
        yield
    finally:
        bench_mod.wait_for_endpoint = orig


def timeline(res: dict, stall_ms: float = 20.0) -> dict:
    """What the per-request arrays of a run (``--save-detailed``: ``start_times``, ``ttfts``,
    ``itls``, seconds) say about how its latency is spread: TTFT percentiles (ms), and on the
    run's merged token timeline (every streamed token's arrival at the client, while some
    request was in flight) the gaps of at least ``stall_ms`` in which no request received a
    token: how many, their total and the longest (ms). A cost per engine step spreads over
    every request; a stall of the engine (or of the server's event loop) shows as such gaps."""
    import numpy as np

    starts, ttfts, itls = res.get("start_times") or [], res.get("ttfts") or [], res.get("itls") or []
    if not (starts and ttfts and len(starts) == len(ttfts) == len(itls)):
        return {}
    tokens, spans = [], []
    for s0, f, gaps in zip(starts, ttfts, itls):
        if not f:
            continue
        t = s0 + f + np.concatenate([[0.0], np.cumsum(gaps)])
        tokens.append(t)
        spans.append((s0, t[-1]))
    if not tokens:
        return {}
    t = np.sort(np.concatenate(tokens))
    d = np.diff(t)
    # a gap counts only while a request was waiting for a token (started, not yet finished)
    lo, hi = np.array([a for a, _ in spans]), np.array([b for _, b in spans])
    mid = (t[:-1] + t[1:]) / 2
    waiting = (np.searchsorted(np.sort(lo), mid) - np.searchsorted(np.sort(hi), mid)) > 0
    big = d[(d * 1e3 >= stall_ms) & waiting] * 1e3
    q = np.percentile(np.array(ttfts) * 1e3, [10, 25, 50, 75, 90, 99])
    return {"ttft_pct_ms": dict(zip(["p10", "p25", "p50", "p75", "p90", "p99"], [round(float(x), 2) for x in q])),
            "stall_ms": stall_ms, "stalls": int(big.size), "stall_total_ms": round(float(big.sum()), 1),
            "stall_max_ms": round(float(big.max()), 1) if big.size else 0.0,
            "ttfts_ms": [round(float(x) * 1e3, 2) for x in ttfts]}


def selected_configs(configs: dict, selection: str) -> dict:
    """``configs`` (name -> (server, selection)) restricted to the comma-separated names of
    ``selection``, in that order, after ``vanilla`` (always first, once). Unknown names are the
    caller's to refuse."""
    names = ["vanilla"] + [n for n in dict.fromkeys(selection.split(",")) if n and n != "vanilla" and n in configs]
    return {n: configs[n] for n in names}


def round_order(names: list[str], k: int, order: str = "abba") -> list[str]:
    """The configurations of measured round ``k`` (0, 1, ...) in the order they run: ``names``
    as given, and with ``order`` ``abba`` reversed in every odd round (A B C, C B A, A B C, ...),
    so that a run's position in its round and a linear drift cancel over each pair of rounds.

    Raises:
        ValueError: an order other than abba / fixed."""
    if order not in ("abba", "fixed"):
        raise ValueError(f"round order {order!r}: abba or fixed")
    return list(reversed(names)) if order == "abba" and k % 2 else list(names)


def rounds(args) -> int:
    out = os.path.abspath(args.out)
    st = common.read_json(os.path.join(out, STATE))
    if not st:
        raise SystemExit(f"{out}/{STATE}: no servers started here (serve start --out {args.out} ...)")
    # (start --servers: the ones the last start launched; one whose start failed has no record)
    up = [n for n in (st.get("up") or list(st["servers"])) if n in st["servers"]]
    servers = {n: Server.from_record(st["servers"][n]) for n in up}
    for s in servers.values():
        s.wait(args.wait)
    if st.get("pin_cpus"):  # the client (this process, its meters and samplers) on the cores start left it
        try:
            cpu_pinning.pin(st["pin_cpus"]["client"])
        except cpu_pinning.PinningError as e:
            raise SystemExit(f"{out}/{STATE}: the servers were started with --pin-cpus, and the client's CPUs "
                             f"cannot be taken here: {e}") from None
    all_configs = configs_for(st["apps"], st.get("second", "xmix"), st.get("control", False),
                              (st.get("alt_variants") or {}).get("mode"))
    down = sorted(n for n, (srv, _) in all_configs.items() if srv not in servers)
    asked = {*args.configs.split(","), *args.profile.split(","), *args.api_profile.split(","),
             *args.api_sample.split(",")} - {""}
    if down and (asked & set(down) or ((args.profile or args.api_profile or args.api_sample) and "vanilla" in down)):
        args._parser.error(f"configuration(s) {sorted(asked & set(down)) or ['vanilla']} need a server that is not "
                           f"running (servers up: {', '.join(up)}; start --servers chose them)")
    configs = all_configs
    profiled = [c for c in args.profile.split(",") if c]
    if any(c.startswith(("aa_", "alt_")) for c in profiled):
        args._parser.error("--profile: the A/A and alternative servers run without vLLM's profiler; profile the "
                           "plugin's configurations")
    unknown = sorted({*args.configs.split(","), *profiled} - set(configs) - {""})
    if unknown:
        args._parser.error(f"--configs/--profile: unknown configuration(s) {unknown}; known: {', '.join(configs)}")
    if profiled and not st.get("profiler"):
        args._parser.error("--profile: the servers were started without --profiler")
    api_profiled = [c for c in args.api_profile.split(",") if c]
    unknown = sorted(set(api_profiled) - set(configs))
    if unknown:
        args._parser.error(f"--api-profile: unknown configuration(s) {unknown}; known: {', '.join(configs)}")
    if api_profiled and not st.get("profile_api"):
        args._parser.error("--api-profile: the servers were started without --profile-api")
    api_sampled = [c for c in args.api_sample.split(",") if c]
    unknown = sorted(set(api_sampled) - set(configs))
    if unknown:
        args._parser.error(f"--api-sample: unknown configuration(s) {unknown}; known: {', '.join(configs)}")
    if api_sampled:
        try:
            api_sample.py_spy_path()
        except RuntimeError as e:
            args._parser.error(f"--api-sample: {e}")
    if args.configs:
        configs = selected_configs(configs, args.configs)
    configs = {n: c for n, c in configs.items() if c[0] in servers}  # (vanilla too, where its server is down)
    dataset_args, title = _dataset(args, st)
    if st.get("pin_cpus"):
        title += ", each server and the client on physical CPU cores of their own"
    rates = args.rates.split(",")
    write_sweep_files(os.path.join(out, "sweep"), st, dataset_args, configs, rates, args.num_prompts)
    res_path = os.path.join(out, "results.json")
    runs: list[dict] = common.read_json(res_path, []) or []
    commit, date, command = common.git_commit(), common.today(), common.command_line()
    mark = 0

    def next_mark() -> int:
        nonlocal mark
        mark += 1
        return (mark * 7919 + os.getpid()) % (st["vocab_size"] - 20) + 10

    for rate in rates:
        # numbered on from this folder's rounds of these configurations (vanilla's among them whenever
        # its server is up); without vanilla (start --servers) on from vanilla's latest rounds, the
        # ones these pair with, and refused where vanilla has none left to pair with
        first = 1 + max((r["round"] for r in runs if r["rate"] == rate and r.get("title", title) == title
                         and r["config"] in configs), default=0)
        if "vanilla" not in configs and args.repeats:
            van = sorted(r["round"] for r in runs if r["rate"] == rate and r.get("title", title) == title
                         and r["config"] == "vanilla")
            if van:
                first = max(first, van[-1] - args.repeats + 1)
            if not van or first + args.repeats - 1 > van[-1]:
                raise SystemExit(f"rate {rate}: vanilla's server is not up and results.json has no vanilla rounds "
                                 f"{first}..{first + args.repeats - 1} for these runs to pair with (vanilla's: "
                                 f"{van or 'none'}); start --servers vanilla and run its rounds first")
        plan = [(0, False)] * args.warmup + [(first + i, True) for i in range(args.repeats)]
        for rnd, measured in plan:  # warm-up rounds use seed 0 and are discarded
            # abba by the round's number in the folder: rounds added by later commands keep alternating
            for name in round_order(list(configs), rnd - 1 if measured else 0, args.order):
                srv, sel = configs[name]
                f = os.path.join(out, "runs", f"{name}_r{rate}_{rnd if measured else 'warmup'}.json")
                os.makedirs(os.path.dirname(f), exist_ok=True)
                n = args.num_prompts if measured or not args.warmup_prompts else args.warmup_prompts
                res = bench(servers[srv], st, dataset_args, rate, n, sel, f, seed=rnd, run_mark=next_mark())
                tl = res.get("timeline") or {}
                print(f"rate {rate} round {rnd if measured else 'warm-up'} {name}: itl {res['mean_itl_ms']:.3f} ms  "
                      f"tput {res['total_token_throughput']:.0f} tok/s  ttft p50 "
                      f"{tl.get('ttft_pct_ms', {}).get('p50', float('nan')):.2f} ms  stalls >= {tl.get('stall_ms')} ms: "
                      f"{tl.get('stalls')} ({tl.get('stall_total_ms')} ms, longest {tl.get('stall_max_ms')})  "
                      f"cpu: {cpu_summary(res.get('cpu') or {})}  "
                      f"vLLM metrics: {server_metrics.summary(res.get('server_metrics') or {})}"
                      + (f"  engine steps: {engine_steps.summary(res['engine_steps'])}" if "engine_steps" in res
                         else ""), flush=True)
                if measured:
                    runs.append({"rate": rate, "round": rnd, "config": name, "title": title, "commit": commit,
                                 "date": date, "result": {k: res[k] for k, _, _ in common.SERVE_METRICS},
                                 "output_tokens": res.get("total_output_tokens"),
                                 "timeline": res.get("timeline", {}), "cpu": res.get("cpu", {}),
                                 "server_metrics": res.get("server_metrics", {}),
                                 **({"engine_steps": res["engine_steps"]} if "engine_steps" in res else {})})
                    common.write_json(res_path, runs)  # after every run: a cut command keeps its runs
    if api_profiled:  # where the API server's time goes, per output token: vanilla vs each configuration
        got = common.read_json(os.path.join(out, "api_profile.json"), {}) or {}  # (earlier configs kept)
        for name in ["vanilla"] + [c for c in api_profiled if c != "vanilla"]:
            srv, sel = all_configs[name]  # (also those left out of --configs)
            got[name] = api_profile_run(out, servers[srv], st, sel, name, dataset_args, rates[0], args.num_prompts,
                                        next_mark())
        common.write_json(os.path.join(out, "api_profile.json"), got)
        print(api_profile_report({"vanilla": got["vanilla"], **got}), flush=True)
    if api_sampled:  # the same question by sampling: no profiler inside the server
        got = common.read_json(os.path.join(out, "api_sample.json"), {}) or {}  # (earlier configs kept)
        for name in ["vanilla"] + [c for c in api_sampled if c != "vanilla"]:
            srv, sel = all_configs[name]
            got[name] = api_sample_run(out, servers[srv], st, sel, name, dataset_args, rates[0], args.num_prompts,
                                       next_mark())
        common.write_json(os.path.join(out, "api_sample.json"), got)
        print(api_sample.report({"vanilla": got["vanilla"], **got}), flush=True)
    if profiled:  # where the time goes: vanilla vs each profiled configuration, same rate and prompts
        rate = rates[0]
        for name in ["vanilla"] + profiled:
            profile_run(out, servers, st, configs_for(st["apps"])[name], name, dataset_args, rate,
                        min(args.num_prompts, 100), next_mark())
        from . import profile as trace_tools

        for name in profiled:
            a, b = (os.path.join(out, f"trace_{n}.json") for n in ("vanilla", name))
            if os.path.exists(a) and os.path.exists(b):
                md = trace_tools.compare(common.read_json(a), common.read_json(b), "vanilla", name)
                with open(os.path.join(out, f"trace_{name}_vs_vanilla.md"), "w") as fh:
                    fh.write(md + "\n")
                print(f"## {name} vs vanilla (engine steps of the profiled run)\n{md}", flush=True)
    if not runs:
        print("no measured rounds (--repeats 0: warm-up only); results.json is empty", flush=True)
        return 0
    print(summarize(runs, out))
    if not args.no_latest:
        print(to_latest(args.latest, runs, st["model_name"], rates=rates, configs=list(configs),
                        setup=st.get("command", ""), command=command, fused_writes=st.get("fused_writes"),
                        card=st.get("card") or common.gpu_card(), one_at_a_time=bool(st.get("one_at_a_time"))))
    return 0


def api_profile_run(out: str, server: Server, st: dict, sel, name: str, dataset_args, rate: str, n: int,
                    run_mark: int) -> dict:
    """One run of configuration ``name`` with its server's API server profiled (``bench(...,
    api_profile=True)``): the profile kept as ``<out>/api_profile_<name>.prof`` and summarized
    per output token (:func:`api_profile_summary`).

    Raises:
        RuntimeError: the server wrote no profile within 30 s of the run's end."""
    import glob

    if not server.api_profile:
        raise RuntimeError(f"{server.name}: started without --profile-api")
    before = set(glob.glob(server.api_profile + ".*[0-9]"))
    res = bench(server, st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"api_profile_{name}.json"),
                seed=98, run_mark=run_mark, api_profile=True)
    for _ in range(60):
        new = sorted(set(glob.glob(server.api_profile + ".*[0-9]")) - before, key=os.path.getmtime)
        if new:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"{server.name}: no API-server profile written for {name} ({server.api_profile}.<k>)")
    kept = os.path.join(out, f"api_profile_{name}.prof")
    shutil.copy(new[-1], kept)
    return api_profile_summary(kept, res.get("total_output_tokens") or 0, res.get("completed") or 0)


def api_sample_run(out: str, server: Server, st: dict, sel, name: str, dataset_args, rate: str, n: int,
                   run_mark: int) -> dict:
    """One run of configuration ``name`` with its server's API server sampled by py-spy
    (``bench(..., api_sample_to=...)``): the raw stacks kept as ``<out>/api_sample_<name>.txt``
    and summarized per output token (:func:`api_sample.summary`).

    Raises:
        RuntimeError: py-spy is missing, could not attach, or wrote nothing."""
    path = os.path.join(out, f"api_sample_{name}.txt")
    res = bench(server, st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"api_sample_{name}.json"),
                seed=97, run_mark=run_mark, api_sample_to=path)
    return api_sample.summary(path, api_sample.RATE_HZ, res.get("total_output_tokens") or 0, res.get("completed") or 0)


def api_profile_summary(path: str, output_tokens: int, requests: int, top: int = 40) -> dict:
    """A pstats file of the API server's main thread over one run: Python calls and profiled
    seconds (the functions' own time, summed) per output token, calls made in or directly from
    the plugin's functions per output token, and the ``top`` functions by own time (us per
    output token, calls per output token)."""
    import pstats

    from .api_calls import _is_plugin, _label

    calls = plugin = 0
    own = 0.0
    funcs = []
    for (f, ln, fn), (cc, nc, tt, ct, callers) in pstats.Stats(path).stats.items():
        calls += nc
        own += tt
        plugin += nc if _is_plugin(f) else sum(v[1] for (cf, _, _), v in callers.items() if _is_plugin(cf))
        funcs.append((tt, nc, _label(f, ln, fn)))
    per = 1.0 / max(output_tokens, 1)
    funcs.sort(reverse=True)
    return {"output_tokens": output_tokens, "requests": requests, "calls_per_token": round(calls * per, 2),
            "plugin_calls_per_token": round(plugin * per, 2), "profiled_us_per_token": round(own * 1e6 * per, 2),
            "top": [{"function": name, "us_per_token": round(tt * 1e6 * per, 3), "calls_per_token": round(nc * per, 3)}
                    for tt, nc, name in funcs[:top]]}


def api_profile_report(got: dict) -> str:
    """Lines of :func:`api_profile_run` results (``{config: summary}``, vanilla first): per
    configuration its per-token numbers, then the functions whose own time per token grew most
    against vanilla's."""
    lines = ["API server's main thread under cProfile, per output token (profiled: times are inflated, calls exact):"]
    base = got.get("vanilla") or {}
    for name, r in got.items():
        lines.append(f"  {name:16s} {r['calls_per_token']:8.1f} calls ({r['plugin_calls_per_token']:.1f} in the "
                     f"plugin), {r['profiled_us_per_token']:8.1f} us")
        if name == "vanilla" or not base:
            continue
        was = {t["function"]: t["us_per_token"] for t in base.get("top", [])}
        grown = sorted(((t["us_per_token"] - was.get(t["function"], 0.0), t["function"]) for t in r["top"]),
                       reverse=True)[:8]
        lines += [f"      {d:+8.2f} us  {fn}" for d, fn in grown if d > 0]
    return "\n".join(lines)


def profile_run(out: str, servers: dict, st: dict, config, name: str, dataset_args, rate: str, n: int,
                run_mark: int) -> None:
    """One ``vllm bench serve --profile`` run of configuration ``name``; keeps vLLM's per-kernel
    table as ``<out>/profile_<name>.txt`` and the trace's per-step summary as ``trace_<name>.json``."""
    import glob

    from . import profile as trace_tools

    srv, sel = config
    pdir = os.path.join(out, f"prof_{srv}")
    before = set(glob.glob(os.path.join(pdir, "*.pt.trace.json*")))
    bench(servers[srv], st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"profile_{name}.json"), seed=99,
          run_mark=run_mark, profile=True)
    table = os.path.join(pdir, "profiler_out_0.txt")
    for _ in range(90):  # the worker writes the trace, then the table, when the profiler stops
        if os.path.exists(table):
            break
        time.sleep(2)
    kept = os.path.join(out, f"profile_{name}.txt")
    if os.path.exists(table):
        shutil.copy(table, kept)
        os.remove(table)
    new = sorted(set(glob.glob(os.path.join(pdir, "*.pt.trace.json*"))) - before, key=os.path.getmtime)
    summary = os.path.join(out, f"trace_{name}.json")
    if new:
        try:
            common.write_json(summary, trace_tools.summarize(new[-1]))
        except ValueError as e:
            print(f"profile {name}: {e}", flush=True)
    print(f"profile {name}: table {'kept' if os.path.exists(kept) else 'missing'}, "
          f"trace {'summarized' if os.path.exists(summary) else 'missing'}", flush=True)


# ------------------------------------------------------------------------------ results


def to_latest(path, runs: list[dict], model: str, rates=None, configs=None, setup: str = "", command: str = "",
              fused_writes: str | None = None, commit: str | None = None, date: str | None = None,
              source: str = "", title: str | None = None, card: str | None = None,
              one_at_a_time: bool = False) -> str:
    """Per (rate, workload) and configuration: each metric's median ratio to vanilla and its
    range over rounds, into latest.json (``serve[config]["rate=R"]``; an A/A configuration,
    ``aa_plain`` / ``aa_empty``, under ``calibration[config]["rate=R"]``: how far plain vLLM
    lies from itself, and the plugin with nothing deployed from plain vLLM, beside these lines,
    whichever ``configs`` are named). ``card``: the GPU the runs were measured on (each entry's
    ``card``; none recorded when None). ``one_at_a_time``: the servers ran one after the other
    (``start --servers``), so the workload says the rounds were not interleaved across them.
    An entry's commit and date are those of its paired rounds' last."""
    done = []
    for (rate, group_title), by_config in common.serve_groups(runs).items():
        if rates is not None and rate not in rates:
            continue
        for cfg, stats in common.serve_ratios(by_config).items():
            if configs is not None and cfg not in configs and not cfg.startswith("aa_"):
                continue
            if cfg.startswith("alt_"):
                continue  # another variant policy than the default's (start --alt-variants): summary.md only
            # (the rounds the ratios come from: those vanilla ran too)
            rounds_ = [by_config[cfg][i] for i in sorted(set(by_config[cfg]) & set(by_config.get("vanilla", {})))]
            n = stats.pop("rounds")
            if one_at_a_time:
                workload = (f"{title or group_title}, rate {rate}, " + ("1 round" if n == 1 else f"{n} rounds")
                            + ", the servers one at a time (not interleaved across them)")
            else:
                workload = (f"{title or group_title}, rate {rate}, "
                            + ("1 round" if n == 1 else f"{n} interleaved rounds"))
            if fused_writes:
                workload += f", fused_writes={fused_writes}"
            entry = {**stats, "commit": commit or rounds_[-1].get("commit") or "unknown",
                     "date": date or rounds_[-1].get("date") or "unknown", "workload": workload,
                     "command": command}
            if setup:
                entry["setup"] = setup
            if source:
                entry["source"] = source
            if card:
                entry["card"] = card
            # an A/A line (plain vLLM against itself) calibrates the pair: no budget line, kept apart
            common.update_latest(path, model, ("calibration" if cfg.startswith("aa_") else "serve", cfg,
                                               f"rate={rate}"), entry)
            done.append(f"{cfg}@{rate}")
    return f"latest.json ({path}): {model} serving {', '.join(done) or 'nothing (no paired vanilla rounds)'}"


def _latest_startup(path, st: dict) -> None:
    v, x = st["servers"]["vanilla"], st["servers"]["xmix"]
    base = {"commit": st["commit"], "date": st["date"], "command": st["command"],
            "workload": f"server start-up, one server at a time, {len(st['apps'])} apps deployed "
                        f"({', '.join(st['apps'])}), fused_writes={st['fused_writes']}, "
                        f"{' '.join(st['server_args'])}"}
    if st.get("card"):
        base["card"] = st["card"]
    caches = {"plain": v.get("compile_cache", "shared"), "xmix": x.get("compile_cache", "shared")}
    common.update_latest(path, st["model_name"], ("startup",),
                         {"plain_s": v["startup_s"], "xmix_s": x["startup_s"],
                          "ratio": round(x["startup_s"] / v["startup_s"], 4), "caches": caches, **base})
    if "graph_gib" in v and "graph_gib" in x:
        common.update_latest(path, st["model_name"], ("graph_memory",),
                             {"plain_gib": v["graph_gib"], "xmix_gib": x["graph_gib"], "plain_s": v["graph_s"],
                              "xmix_s": x["graph_s"], **base})


def _cpu_cells(runs) -> str:
    """summary.md's CPU cells of one configuration: per role (API server, engine core) the
    median over rounds of its busy fraction and, in brackets, of its busiest thread's (1.00: one
    core the whole run)."""
    import numpy as np

    cells = ""
    for role in ("api_server", "engine_core"):
        rs = [r["cpu"][role] for r in runs if (r.get("cpu") or {}).get(role)]
        cells += (f" {np.median([x['busy'] for x in rs]):.2f} ({np.median([x['busiest_thread'] for x in rs]):.2f}) |"
                  if rs else " - |")
    return cells


def summarize(runs: list[dict], out_dir: str) -> str:
    """summary.md (per workload and rate: metric medians and ratios to vanilla with a bootstrap
    95% CI over rounds, paired by round) and overhead.png."""
    import numpy as np

    groups = common.serve_groups(runs)
    titles = list(dict.fromkeys(t for _, t in groups))
    lines, plot = [], {}
    for title in titles:
        lines += [f"# {title}", ""]
        rates = sorted({r for r, t in groups if t == title}, key=lambda x: float("inf") if x == "inf" else float(x))
        for rate in rates:
            by_config = groups[(rate, title)]
            base = by_config.get("vanilla", {})
            has_cpu = any(r.get("cpu") for cur in by_config.values() for r in cur.values())
            cpu_head = " API server CPU busy (busiest thread) | engine core CPU busy (busiest thread) |"
            lines += [f"## request rate {rate}", "",
                      "| config | " + " | ".join(f"{m[1]} (median)" for m in common.SERVE_METRICS) + " | "
                      + " | ".join(f"{m[1]} ratio [95% CI]" for m in common.SERVE_METRICS) + " |"
                      + (cpu_head if has_cpu else ""),
                      "|---" * (1 + 2 * len(common.SERVE_METRICS) + 2 * has_cpu) + "|"]
            for c, cur in by_config.items():
                meds = [f"{np.median([r['result'][k] for r in cur.values()]):.2f}" for k, _, _ in common.SERVE_METRICS]
                pairs = sorted(set(cur) & set(base))  # only rounds with both runs (a cut sweep keeps the rest)
                ratios = []
                for key, label, _ in common.SERVE_METRICS:
                    if c == "vanilla" or not pairs:
                        ratios.append("-")
                        continue
                    med, lo, hi = common.ratio_ci([cur[i]["result"][key] for i in pairs],
                                                  [base[i]["result"][key] for i in pairs])
                    ratios.append(f"{(med - 1) * 100:+.2f}% [{(lo - 1) * 100:+.2f}, {(hi - 1) * 100:+.2f}]")
                    plot.setdefault(f"{title}: rate {rate}", {}).setdefault(c, {})[label] = (med, lo, hi)
                lines.append(f"| {c} | " + " | ".join(meds) + " | " + " | ".join(ratios) + " |"
                             + (_cpu_cells(cur.values()) if has_cpu else ""))
            lines.append("")
            parts = server_metrics.table_rows({c: [r.get("server_metrics") or {} for r in cur.values()]
                                               for c, cur in by_config.items()})
            if parts:  # where the TTFT went, by vLLM's own per-request metrics
                lines += [f"TTFT parts at rate {rate} (vLLM's metrics; median over rounds of each run's mean):", ""]
                lines += parts + [""]
            e2e = server_metrics.e2e_rows({c: [r.get("server_metrics") or {} for r in cur.values()]
                                           for c, cur in by_config.items()},
                                          {c: [v for v in map(_api_us_per_token, cur.values()) if v is not None]
                                           for c, cur in by_config.items()})
            if e2e:  # a request's whole time: the engine core's part and the API server's, at both ends
                lines += [f"Request time at rate {rate} (vLLM's metrics; median over rounds of each run's mean; the "
                          "engine core's part by its own timestamps, the front end's the rest of e2e):", ""]
                lines += e2e + [""]
            steps = engine_steps.table_rows({c: [r["engine_steps"] for r in cur.values() if "engine_steps" in r]
                                             for c, cur in by_config.items()})
            if steps:  # the served engine steps of each run (start --record-steps)
                lines += [f"Engine steps at rate {rate} (recorded in the engine core; median over rounds of each "
                          "run's median step period, i.e. previous output processed or this step scheduled -> "
                          "this step's output, and host ms of the scheduler's schedule / update_from_output):", ""]
                lines += steps + [""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    try:
        if plot:  # (no ratio without a paired vanilla run)
            _plot(plot, os.path.join(out_dir, "overhead.png"), titles[0] if len(titles) == 1 else "")
    except Exception as e:  # the numbers matter more than the picture
        print("plot not written:", e, file=sys.stderr)
    return text


def _api_us_per_token(run: dict) -> float | None:
    """A run's API-server CPU time per output token (us), or None where the run lacks either."""
    cpu_s = ((run.get("cpu") or {}).get("api_server") or {}).get("cpu_s")
    tokens = run.get("output_tokens")
    return cpu_s * 1e6 / tokens if cpu_s is not None and tokens else None


def _plot(plot: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = list(plot)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    labels = [m[1] for m in common.SERVE_METRICS]
    width = 0.8 / len(labels)
    for ax, panel in zip(axes[0], panels):
        configs = list(plot[panel])
        for j, lab in enumerate(labels):
            vals = [(plot[panel][c][lab][0] - 1) * 100 for c in configs]
            err = [[(plot[panel][c][lab][0] - plot[panel][c][lab][1]) * 100 for c in configs],
                   [(plot[panel][c][lab][2] - plot[panel][c][lab][0]) * 100 for c in configs]]
            ax.bar(np.arange(len(configs)) + j * width, vals, width, yerr=err, label=lab, capsize=2)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-1, 1):
            ax.axhline(y, color="r", lw=0.6, ls="--")
        ax.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
        ax.set_xticklabels(configs, rotation=30, ha="right")
        ax.set_ylabel("change vs vanilla vLLM (%)")
        ax.set_title(panel.split(": ")[-1] if title else panel, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
