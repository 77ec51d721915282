"""Train a built-in model: python -m kvforge.model_defs.train_tiny [--preset tiny|tiny-moe] [--steps N] [--out DIR]

`tiny` (a Llama-style decoder) trains its BPE tokenizer too; `tiny-moe` (latent attention + a mixture of
experts) reuses tiny's tokenizer and corpus split, and adds the Switch Transformer's load-balancing loss
(AUX_LOSS * N * sum_e tokens_share_e * mean_prob_e per MoE layer) so that its experts share the tokens.

Corpus: the Python standard library's own source (PSF license), which every
machine with Python has. Files are split deterministically: every 20th file
(by sorted path) is held out; the model and its tokenizer never see them. The
script writes a kvforge checkpoint (FP16-stored weights, ~8 MB), the trained
BPE tokenizer, `heldout.txt` (the first 200 kB of held-out text: the
perplexity corpus), `calibration.txt` (text from the training split: the
built-in calibration corpus) and `training.json` (settings, loss curve,
held-out perplexity, greedy sample, versions and time).

The committed weights were produced by this script with its defaults; the
standard library differs between Python versions, so a rerun elsewhere gives
a similar, not identical, model.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.tokenizer import Tokenizer

from .checkpoint import TINY_DIR, TRAINED, load, save_checkpoint
from .config import ModelConfig
from .evaluate import greedy_continuation, perplexity
from .model import build_model
from .moe import Router

HELDOUT_EVERY = 20
HELDOUT_BYTES = 200_000
CALIBRATION_BYTES = 160_000
SAMPLE_PROMPT = "def fibonacci(n):\n    if n"  # ends on a token boundary BPE saw in training
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2, as the `tiny` preset says
AUX_LOSS = 0.01  # weight of the MoE load-balancing loss


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def split_corpus(files: list[Path]) -> tuple[list[str], list[str]]:
    train, held = [], []
    for i, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        (held if i % HELDOUT_EVERY == HELDOUT_EVERY // 2 else train).append(text)
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )

    return Tokenizer(tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def init_for_training(model, n_layers: int, seed: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                continue  # norm weights stay 1 (biases: none in this model)
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class BalanceLoss:
    """Collects each router's token shares and mean probabilities in a forward pass (forward hooks): the
    Switch Transformer's auxiliary loss, N * sum_e f_e * P_e per MoE layer (1 when perfectly balanced)."""

    def __init__(self, model):
        self.terms: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._hook)

    def _hook(self, router, inputs, outputs):
        (x,), (_, index) = inputs, outputs
        probs = torch.softmax(F.linear(x.float(), router.weight.float()), dim=-1)  # (M, N)
        n = probs.shape[-1]
        share = F.one_hot(index, n).float().sum(1).mean(0) / index.shape[-1]  # fraction of assignments per expert
        self.terms.append(n * (share * probs.mean(0)).sum())

    def pop(self) -> torch.Tensor | None:
        terms, self.terms = self.terms, []
        return torch.stack(terms).mean() if terms else None


def calibration_text(train_texts: list[str], seed: int) -> str:
    """About CALIBRATION_BYTES of training text (files in a seeded order, 8000 characters of each at most)."""
    calib_gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_texts), generator=calib_gen).tolist()
    calib, size = [], 0
    for i in order:
        if size >= CALIBRATION_BYTES:
            break
        piece = train_texts[i][:8000]
        calib.append(piece)
        size += len(piece)
    return "\n".join(calib)


def train(model, data: torch.Tensor, cfg: ModelConfig, args, start: float) -> list[float]:
    """AdamW with warmup and cosine decay on random windows of the token stream (plus the experts' balance loss
    for a mixture); returns each step's loss."""
    init_for_training(model, cfg.n_layers, args.seed)
    balance = BalanceLoss(model)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)
    )
    warmup = max(1, args.steps // 15)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        aux = balance.pop()
        opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + AUX_LOSS * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
        if step % 25 == 0 or step == args.steps - 1:
            balance_note = f"  balance {aux.item():.3f}" if aux is not None else ""
            print(f"step {step:5d}  loss {loss.item():.4f}{balance_note}  lr {lr_at(step):.2e}  {time.time() - start:7.1f}s",
                  flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(TRAINED), default="tiny")
    ap.add_argument("--out", type=Path, default=None, help="default: the preset's shipped directory")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    args.out = args.out or TRAINED[args.preset]
    torch.manual_seed(args.seed)
    start = time.time()

    cfg = ModelConfig.from_name(args.preset)
    train_texts, held_texts = split_corpus(stdlib_files())
    if args.preset == "tiny":
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    else:  # the same tokenizer as tiny's, so that perplexities compare

        tokenizer = Tokenizer.from_file(TINY_DIR / "tokenizer.json")
    assert [tokenizer.backend.token_to_id(t) for t in SPECIALS] == [cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id]
    stream: list[int] = []
    for text in train_texts:
        stream += tokenizer.encode(text) + [cfg.eos_token_id]
    data = torch.tensor(stream, dtype=torch.int64)
    print(f"corpus: {len(train_texts)} training files, {len(data)} tokens; {len(held_texts)} held out", flush=True)

    model = build_model(cfg).train()
    losses = train(model, data, cfg, args, start)
    train_seconds = time.time() - start

    # Write the checkpoint, then measure what was written (FP16-stored weights).
    tmp_out = args.out.with_name(args.out.name + ".new")
    shutil.rmtree(tmp_out, ignore_errors=True)
    save_checkpoint(model.eval(), tmp_out, tokenizer, weight_dtype="float16")
    held = "".join(held_texts)
    if args.preset == "tiny":  # the held-out and calibration corpora: tiny's, which tiny-moe shares
        (tmp_out / "heldout.txt").write_text(held[:HELDOUT_BYTES], encoding="utf-8")
        (tmp_out / "calibration.txt").write_text(calibration_text(train_texts, args.seed + 1), encoding="utf-8")

    shipped, tok = load(tmp_out)
    held_ids = tok.encode(held[:HELDOUT_BYTES], add_special_tokens=False)
    ppl = perplexity(shipped, held_ids, args.seq_len)
    prompt_ids = tok.encode(SAMPLE_PROMPT)
    sample = tok.decode(greedy_continuation(shipped, prompt_ids, 48, stop=[cfg.eos_token_id]))
    record = {
        "preset": args.preset,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_tokens": len(data),
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "parameters": shipped.num_parameters(),
        "final_loss_mean_last_25": round(sum(losses[-25:]) / len(losses[-25:]), 4),
        "heldout_tokens": len(held_ids),
        "heldout_perplexity": round(ppl, 3),
        "uniform_perplexity": cfg.vocab_size,
        "sample_prompt": SAMPLE_PROMPT,
        "sample_greedy": sample,
        "train_seconds": round(train_seconds, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "losses": losses,
    }
    (tmp_out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp_out.rename(args.out)
    print(f"held-out perplexity {ppl:.2f} (uniform: {cfg.vocab_size}); sample: {SAMPLE_PROMPT + sample!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
