"""The servers of a serving A/B (``serve start``, ``serve stop``): the serving folder, each
server's launch, health, start-up time, CUDA-graph capture and compile caches, and its end.

* ``start``: builds the serving folder under ``--out`` (:func:`build_serving_dir`: the model's
  config for dummy weights, and a word-level tokenizer with exactly its vocabulary), starts the
  two servers one after the other with ``setsid`` (so that they outlive this command), waits until
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
  (``cpu_pinning.py``; the split in servers.json). With ``--record-steps`` every server (through
  ``recorded_server.py``) records each engine step its engine core runs (``engine_steps``), for
  the rounds to summarize per run; the servers beside the pair (``--second``, ``--control``,
  ``--alt-variants``): ``serve_configs``.
* ``stop``: stops the servers (SIGTERM to their process groups, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from . import common, cpu_pinning, engine_steps, profiled_server
from .serve_configs import ALT_SERVER, ALT_VARIANTS, CONTROLS, control_kinds
from .serve_results import startup_to_latest

STATE = "servers.json"


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


def _xmix_settings() -> tuple[str, ...]:
    """The plugin's settings among its environment variables (those that enter the compile cache
    key; not the admin key): servers.json records the xmix server's, the alternative server drops
    them."""
    from vllm_xmix._vllm_compat.envs import PLUGIN_ENV

    return tuple(k for k, setting in PLUGIN_ENV.items() if setting)


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
    from vllm_xmix.cli import write_vllm_config

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
    # the deployment goes in through vLLM's --config YAML: a token set of 25k ids would make an
    # --additional-config argument longer than the OS allows (128 KiB)
    xmix_cfg = os.path.join(out, "xmix_config.yaml")
    write_vllm_config(xmix_cfg, deploy(*apps, fused_writes=args.fused_writes))
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
        startup_to_latest(args.latest, st)
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
