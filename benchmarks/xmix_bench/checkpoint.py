"""checkpoint: a random-weight checkpoint of a model config, written as HF safetensors.

vLLM's ``load_format="dummy"`` fills each rank's shard with its own random numbers, so a
tensor-parallel engine on dummy weights is another model than the one-rank engine: comparing
TP=2 with TP=1 needs the same weights on disk. This writes them once (``transformers``
``AutoModelForCausalLM.from_config``, initialised with the config's ``initializer_range`` under
``--seed``; on a GPU when there is one, ~1 min for Llama-3.1-8B in bf16) together with the
config, for ``hooks-check --model DIR --load-format auto``. No tokenizer: token-id prompts.
"""

from __future__ import annotations

import os
import shutil

from . import common

HELP = "a random-weight checkpoint of a model config (the same weights for TP=1 and TP=2 engines)"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="model config folder (benchmarks/models/...)")
    p.add_argument("--out", required=True, help="the folder to write (config.json, *.safetensors)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (num_hidden_layers)")


def main(args) -> int:
    write_checkpoint(args.model, args.out, dtype=args.dtype, seed=args.seed, layers=args.layers)
    print("DONE", args.out, flush=True)
    return 0


def write_checkpoint(model_dir: str, out: str, *, dtype: str = "bfloat16", seed: int = 0,
                     layers: int | None = None) -> str:
    """Write ``out/config.json`` and ``out/model*.safetensors``: the architecture of
    ``model_dir/config.json`` (``layers``: its first N decoder layers) with random weights drawn
    under ``seed`` (normal with std ``initializer_range``, as transformers initialises), in
    ``dtype``. Returns ``out``.

    Raises:
        SystemExit: ``model_dir`` has no config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common.load_config(model_dir)  # a clear error without a config.json
    cfg = AutoConfig.from_pretrained(model_dir)
    if layers is not None:
        cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size="5GB")
    gen = os.path.join(model_dir, "generation_config.json")  # the config folder's, where it has one
    if os.path.exists(gen):
        shutil.copy(gen, out)
    return out
