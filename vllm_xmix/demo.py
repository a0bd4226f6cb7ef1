"""Main job on the embedded default: ``python -m vllm_xmix.demo`` (``make demo``).

On the shipped two-style model (:mod:`vllm_xmix.models`: a small Llama trained on Python source
and the King James Bible), with real vLLM and nothing else:

1. **capture -> extract**: a capture app collects the residual stream of the shipped text
   excerpts; a difference-of-means vector (CAA) and a logistic probe are extracted from it
   (:mod:`vllm_xmix.extract`);
2. **deploy**: a second engine serves three apps (:mod:`vllm_xmix.apps`): ``to_code`` (the CAA
   vector added at layer 2), ``style_probe`` (the probe, read at layer 2) and ``code_to_prose``
   (CAST: if the prompt reads as code, steer away from code);
3. it prints, side by side, continuations with steering off and on and their style measure
   (:func:`vllm_xmix.models.code_share`), per-token probe scores along a text that changes style, the
   CAST decision per prompt, and checks that requests with the apps off equal plain vLLM (the
   plugin not loaded, in a child process).

Exit status 0 only if steering moved the style measure by at least 0.5, the probe classified at
least 95% of held-out tokens, CAST decided every prompt by its style, and apps off equalled plain
vLLM. ``--plot PATH`` writes the probe scores as a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROSE = ["And he said unto them,", "Blessed are the", "In the beginning"]
CODE = ["def get(self, key):\n", "import os\n", "class Foo:\n"]
LAYER, COND_LAYER = 2, 1


def _engine_kwargs(model: str, eager: bool) -> dict:
    return dict(model=model, dtype="float32", max_model_len=512, max_num_seqs=32, seed=0,
                enforce_eager=eager, kv_cache_memory_bytes=256 << 20)


def _plain_greedy(model: str, max_tokens: int, eager: bool) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(model, eager))
    outs = llm.generate(PROSE + CODE, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _short(text: str, n: int = 60) -> str:
    if not text.strip():
        return "(blank lines)"
    t = text.replace("\n", "\u21b5")
    return t if len(t) <= n else t[: n - 1] + "\u2026"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the shipped two_style model)")
    ap.add_argument("--scale", type=float, default=1.0, help="steering scale of the CAA vector")
    ap.add_argument("--samples", type=int, default=8, help="sampled continuations per prompt for the style measure")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: torch.compile)")
    ap.add_argument("--plot", metavar="PATH", help="write the probe scores along a generation as a PNG")
    ap.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one screen: the demo's lines, vLLM's warnings
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install 'vllm-xmix[plot]')")

    from .models import code_share, two_style_path, two_style_texts

    model = args.model or two_style_path()
    if args.plain_worker:  # child: plain vLLM, the plugin filtered out by VLLM_PLUGINS
        print("PLAIN_TOKENS " + json.dumps(_plain_greedy(model, args.max_tokens, args.eager)), flush=True)
        return 0

    import numpy as np
    from vllm import LLM

    from . import SamplingParams, deploy
    from .apps import cast, single_layer_steering
    from .extract import capture_app, collect_activations, diff_of_means, fit_probe

    texts = two_style_texts()
    print(f"[demo] model {model}")
    # ---- 1. capture -> extract, on vLLM
    llm = LLM(**_engine_kwargs(model, True), additional_config=deploy(capture_app([COND_LAYER, LAYER])))
    acts = {(s, k): collect_activations(llm, texts[s][k]) for s in ("code", "prose") for k in ("train", "held")}
    del llm
    caa = diff_of_means(acts[("code", "train")][LAYER], acts[("prose", "train")][LAYER])
    probe = fit_probe(acts[("code", "train")][LAYER], acts[("prose", "train")][LAYER],
                      acts[("code", "held")][LAYER], acts[("prose", "held")][LAYER])
    cond = diff_of_means(acts[("code", "train")][COND_LAYER], acts[("prose", "train")][COND_LAYER])
    cond = cond / np.linalg.norm(cond)

    def prompt_cos(arrs):
        return float(np.mean([np.mean(a @ cond / np.linalg.norm(a, axis=1)) for a in arrs]))

    thr = (prompt_cos(acts[("code", "train")][COND_LAYER]) + prompt_cos(acts[("prose", "train")][COND_LAYER])) / 2
    print(f"[demo] extracted from {sum(len(v[LAYER]) for v in acts.values())} captured excerpts: CAA vector at "
          f"blocks.{LAYER}.hook_resid_post (norm {np.linalg.norm(caa):.1f}); probe held-out accuracy "
          f"{probe.held_out_accuracy:.1%} ({probe.n_held_out} tokens); CAST threshold {thr:+.3f}")

    # ---- 2. deploy the apps
    apps = [single_layer_steering(caa, LAYER, scale=args.scale, name="to_code"),
            probe.app("style_probe", LAYER),
            cast(cond, COND_LAYER, thr, -caa, [LAYER], report=True, name="code_to_prose")]
    llm = LLM(**_engine_kwargs(model, args.eager), additional_config=deploy(*apps))
    from . import __version__
    from ._vllm_compat import vllm_version
    from ._vllm_compat.core import _PATCHED

    print(f"   plugin: vllm_xmix {__version__} registered on vLLM {vllm_version()} "
          f"({len(_PATCHED)} patches; the engine checked the deployment of {len(apps)} apps)")

    def sample(prompts, sel, n):
        sps = [SamplingParams(temperature=0.8, max_tokens=args.max_tokens, seed=i, mi_apps=sel or None)
               for _ in prompts for i in range(n)]
        outs = llm.generate([p for p in prompts for _ in range(n)], sps, use_tqdm=False)
        return [outs[i * n:(i + 1) * n] for i in range(len(prompts))]

    # ---- 3a. steering off vs on, side by side
    print(f"\n1. Steering (CAA, scale {args.scale:+g} at layer {LAYER}): sampled continuations, style = share of "
          f"code-like characters over {args.samples} samples")
    shifts = []
    for prompts, sel_on, label in ((PROSE, ["to_code"], "towards code"),
                                   (CODE, [{"name": "to_code", "scale": -args.scale}], "away from code")):
        off, on = sample(prompts, [], args.samples), sample(prompts, sel_on, args.samples)
        print(f"   {label}:")
        for p, a, b in zip(prompts, off, on):
            sa = np.mean([code_share(o.outputs[0].text) for o in a])
            sb = np.mean([code_share(o.outputs[0].text) for o in b])
            shifts.append(abs(sb - sa))
            ta = next((o.outputs[0].text for o in a if o.outputs[0].text.strip()), "")  # a non-blank sample
            tb = next((o.outputs[0].text for o in b if o.outputs[0].text.strip()), "")
            print(f"   {_short(p, 22):<22} off {sa:4.0%} {_short(ta.strip(), 44):<44} | on {sb:4.0%} "
                  f"{_short(tb.strip(), 44)}")
    shift = float(np.mean(shifts))

    # ---- 3b. per-token probe scores along a text that changes style
    mixed = texts["prose"]["held"][1][:90].rsplit(" ", 1)[0] + "\n" + texts["code"]["held"][1][:90]
    g = llm.generate([mixed], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             mi_apps=["style_probe"]), use_tqdm=False)[0]
    scores = g.mi_results["style_probe"]["probe"]
    ids = list(g.prompt_token_ids) + list(g.outputs[0].token_ids)
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in ids[: len(scores)]]  # the score read while that token was processed
    print(f"\n2. Probe (logistic, layer {LAYER}): P(code) per token of held-out prose followed by held-out code, "
          f"then 8 generated tokens")
    line = "   "
    for piece, s in zip(pieces[1:], scores[1:]):  # (position 0 is the BOS token)
        cell = f"{_short(piece, 12)}:{s:.2f} "
        if len(line) + len(cell) > 110:
            print(line)
            line = "   "
        line += cell
    print(line)
    held_ok = probe.held_out_accuracy >= 0.95

    # ---- 3c. CAST deciding by the prompt
    print(f"\n3. CAST: steer away from code when the prompt's mean cosine with the code direction at layer "
          f"{COND_LAYER} > {thr:+.3f}")
    decided_ok = True
    prompts = [t[:100] for t in texts["code"]["held"][:3]] + [t[:100] for t in texts["prose"]["held"][:3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                mi_apps=["code_to_prose"]), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        sim = float(o.mi_results["code_to_prose"]["similarity"][: len(o.prompt_token_ids)].mean())
        style = "code" if i < 3 else "prose"
        decided_ok &= (sim > thr) == (style == "code")
        said = _short(o.outputs[0].text.strip(), 36)  # (steered ones away from code, towards prose)
        print(f"   {style:5s} prompt {_short(p, 34):<34} cos {sim:+.3f} -> {'steered' if sim > thr else 'left alone':<10} "
              f"| {said}")

    # ---- 3d. apps off == plain vLLM
    off = llm.generate(PROSE + CODE, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                                    mi_apps=["style_probe"]), use_tqdm=False)
    del llm
    env = dict(os.environ, VLLM_PLUGINS="")
    cmd = [sys.executable, "-m", "vllm_xmix.demo", "--plain-worker", "--model", model,
           "--max-tokens", str(args.max_tokens)] + (["--eager"] if args.eager else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PLAIN_TOKENS ")), None)
    if line is None:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        print("[demo] plain vLLM run failed", file=sys.stderr)
        return 2
    equal = [list(o.outputs[0].token_ids) for o in off] == json.loads(line.removeprefix("PLAIN_TOKENS "))
    print(f"\n4. Steering off (probe on) == plain vLLM (plugin not loaded), greedy, {len(off)} prompts: {equal}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 3))
        ax.plot(range(len(scores)), scores, marker=".")
        ax.axvline(len(g.prompt_token_ids) - 1, color="grey", ls="--", label="last prompt token")
        ax.set_xlabel("position")
        ax.set_ylabel("P(code)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("style probe along held-out prose, then code, then a greedy continuation")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"[demo] wrote {args.plot}")

    ok = shift >= 0.5 and held_ok and decided_ok and equal
    print(f"\n[demo] style shift {shift:.2f}: how far steering moved the share of code-like characters, "
          f"steered against unsteered, averaged over both directions and the prompts (>= 0.5: {shift >= 0.5}); "
          f"probe held-out accuracy "
          f"{probe.held_out_accuracy:.1%} (>= 95%: {held_ok}); CAST decided by style: {decided_ok}; "
          f"apps off == plain vLLM: {equal}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
