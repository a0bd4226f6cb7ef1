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

* ``start``: builds the serving folder under ``--out``, starts the servers (they outlive this
  command) and records their start-up and CUDA-graph capture (serve_servers.py); ``--second``,
  ``--control`` and ``--alt-variants`` add or swap servers (serve_configs.py).
* ``rounds``: against the running servers, for each ``--rates`` rate rounds of every
  configuration (serve_rounds.py; the configurations: serve_configs.py), into
  ``<out>/results.json``, then summary.md, overhead.png and latest.json (serve_results.py).
* ``stop``: stops the servers (SIGTERM to their process groups, then SIGKILL).
* ``all``: start, rounds, stop in one process (the servers are stopped on exit and on SIGTERM).
* ``summarize``: rebuilds summary.md / overhead.png from results.json.

This module is the command line; one module a step of the data path does the work:
``serve_configs`` (the servers and configurations of an A/B), ``serve_servers`` (start, stop),
``serve_rounds`` (the runs), ``serve_results`` (summary.md, overhead.png, latest.json). Each
one's docstring says the rest.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import common
from .serve_configs import ALT_VARIANTS, control_kinds
from .serve_results import summarize
from .serve_rounds import rounds
from .serve_servers import start, stop

HELP = "serving A/B with `vllm bench serve`: plain vLLM vs the plugin, each app on every request"


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
