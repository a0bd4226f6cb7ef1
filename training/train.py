"""Train the shipped two-style demo model (Python code / King James prose) on the CPU, reproducibly.

    python training/train.py [--out vllm_xmix/models/two_style] [--steps 800] [--threads 1]

A byte-level BPE of 4096 tokens (``tokenizers``; the post-processor adds ``<|bos|>``, so vLLM's
prompts start the way training documents did), then an HF ``LlamaForCausalLM`` (d_model 128,
4 layers, 2 heads of 64, FFN 512, tied embeddings, 1.6M parameters) trained with fixed seeds on
half-code, half-prose batches of 16 x 128 tokens (AdamW, lr 3e-3, linear warm-up, cosine decay
to 10%). One thread: on a shared 2-core machine two were slower. Writes ``config.json``,
``model.safetensors`` (float32), the tokenizer files, ``train_log.json`` (data sizes, losses,
times, the interpreter whose standard library was the code corpus) and ``texts.json`` (excerpts
of both styles' training and held-out documents, for extraction without the corpus).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCH = dict(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.02)
BOS, EOS, PAD = 0, 1, 2
#: a plain chat template (the model was not trained on chats; it makes chat requests work)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ``<|bos|>`` (0), ``<|eos|>`` (1), ``<|pad|>`` (2); every encoding starts with BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                      special_tokens=[("<|bos|>", BOS)]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(tokenizer, docs) -> np.ndarray:
    """All documents as one int32 stream, each ``BOS text EOS``."""
    ids = tokenizer([t for _, t in docs], add_special_tokens=False)["input_ids"]
    out: list[int] = []
    for x in ids:
        out += [BOS, *x, EOS]
    return np.asarray(out, dtype=np.int32)


def windows(stream: np.ndarray, n: int, T: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - T - 1, size=n)
    return torch.from_numpy(np.stack([stream[s:s + T] for s in starts]).astype(np.int64))


@torch.no_grad()
def held_loss(model, stream: np.ndarray, T: int, max_windows: int) -> float:
    """Mean next-token loss (nats) over non-overlapping windows from the start of ``stream``."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // T)
    x = torch.from_numpy(stream[: n * T].reshape(n, T).astype(np.int64))
    losses = [model(input_ids=x[i:i + 16], labels=x[i:i + 16]).loss.item() for i in range(0, n, 16)]
    model.train()
    return float(np.mean(losses))


def excerpts(docs, n: int, chars: int, rng: np.random.Generator) -> list[str]:
    """``n`` excerpts of about ``chars`` characters, each from a different random document (in
    turn when there are fewer), starting and ending at line boundaries."""
    out = []
    order = rng.permutation(len(docs))
    for i in range(n):
        text = docs[int(order[i % len(order)])][1]
        lines = text.split("\n")
        start = int(rng.integers(0, max(1, len(lines) - 1)))
        ex = []
        while start < len(lines) and sum(len(x) + 1 for x in ex) < chars:
            ex.append(lines[start])
            start += 1
        out.append("\n".join(ex).strip("\n") or text[:chars])
    return out


def write_texts(data, out: Path, seed: int, n: int = 48, chars: int = 320) -> None:
    """``texts.json``: excerpts of each style's training and held-out documents, shipped with the
    model so that vectors and probes are extracted (and tested) without the corpus."""
    rng = np.random.default_rng(seed + 1)
    texts = {s: {k: excerpts(data[s][k], n, chars, rng) for k in ("train", "held")} for s in ("code", "prose")}
    (out / "texts.json").write_text(json.dumps(texts, indent=0) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "vllm_xmix" / "models" / "two_style"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, half code, half prose")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--texts-only", action="store_true", help="write texts.json only (no training)")
    args = ap.parse_args(argv)

    t0 = time.time()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    random.seed(args.seed)
    np.random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    data = corpus.build()
    write_texts(data, out, args.seed)
    if args.texts_only:
        return 0
    tokenizer = train_tokenizer([t for s in ("code", "prose") for _, t in data[s]["train"]], ARCH["vocab_size"])
    streams = {s: {k: token_stream(tokenizer, data[s][k]) for k in ("train", "held")} for s in data}
    stats = {s: {"train_documents": len(data[s]["train"]), "held_documents": len(data[s]["held"]),
                 "train_chars": sum(len(t) for _, t in data[s]["train"]),
                 "train_tokens": int(len(streams[s]["train"])), "held_tokens": int(len(streams[s]["held"]))}
             for s in data}
    print(f"[train] corpus and tokenizer in {time.time() - t0:.0f} s: {json.dumps(stats)}", flush=True)

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**ARCH, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)).float()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warm = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        p = (step - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    rng = np.random.default_rng(args.seed)
    half = args.batch // 2
    log = []
    t_train = time.time()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = torch.cat([windows(streams["code"]["train"], half, args.seq, rng),
                       windows(streams["prose"]["train"], args.batch - half, args.seq, rng)])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "lr": round(lr_at(step), 6)})
            print(f"[train] step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    train_s = time.time() - t_train
    final = {s: held_loss(model, streams[s]["held"], args.seq, 256) for s in streams}
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {"parameters": sum(p.numel() for p in model.parameters()), "architecture": ARCH,
               "args": {k: v for k, v in vars(args).items() if k != "out"}, "data": stats,
               "held_out_loss_nats": {s: round(v, 4) for s, v in final.items()},
               "held_out_perplexity": {s: round(math.exp(v), 2) for s, v in final.items()},
               "train_seconds": round(train_s, 1), "python": platform.python_version(),
               "torch": torch.__version__, "log": log}
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[train] held-out loss {summary['held_out_loss_nats']} in {time.time() - t0:.0f} s; wrote {out}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
