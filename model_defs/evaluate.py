"""Perplexity and greedy continuation on the Torch reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from kvforge.errors import KvforgeError
from kvforge import metrics
from kvforge.metrics import windows
from kvforge.tokenizer import Tokenizer

from .checkpoint import DEFAULT_MODEL, TINY_DIR, load
from .model import Transformer

HELDOUT_FILE = TINY_DIR / "heldout.txt"


def heldout_text() -> str:
    """The held-out corpus of the built-in `tiny` model (Python standard library files it never saw)."""
    return HELDOUT_FILE.read_text(encoding="utf-8")


@torch.no_grad()
def perplexity(model: Transformer, ids: Sequence[int], seq_len: int = 256, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping windows of `seq_len` tokens."""
    chunks = windows(ids, seq_len)
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        batch = torch.from_numpy(chunks[i : i + batch_size])
        logits, _ = model(batch[:, :-1])
        total += metrics.target_nll(metrics.log_softmax(logits.float().numpy()), batch[:, 1:].numpy())
        count += batch[:, 1:].numel()
    return metrics.perplexity(total, count)


def text_perplexity(model: Transformer, tokenizer: Tokenizer, text: str, seq_len: int = 256) -> float:
    return perplexity(model, tokenizer.encode(text, add_special_tokens=False), seq_len)


@torch.no_grad()
def greedy_continuation(model: Transformer, ids: Sequence[int], max_new_tokens: int, stop: Sequence[int] = ()) -> list[int]:
    """Greedy decoding with the KV cache: one prefill, then one token per step."""
    if not ids:
        raise KvforgeError("greedy_continuation needs at least one prompt token")
    x = torch.tensor([list(ids)], dtype=torch.int64)
    logits, past = model(x)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in stop or len(ids) + len(out) >= model.config.max_seq_len:
            break
        mask = torch.ones(1, len(ids) + len(out), dtype=torch.int64)  # tells the past length: capped caches do not
        logits, past = model(torch.tensor([[token]]), attention_mask=mask, past_key_values=past)
    return out


def read_text(path: str | Path) -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise KvforgeError(f"no such file: {path}") from e
    except UnicodeDecodeError as e:
        raise KvforgeError(f"{path} is not UTF-8 text: {e}") from e


def evaluate(
    source=None, data: str | Path | None = None, prompt: str = "def fibonacci(n):\n    if n",
    max_new_tokens: int = 48, seq_len: int = 256, dtype: str = "float32",
) -> dict:
    """Perplexity on a text corpus and a greedy continuation, on the Torch reference.

    Without `data` the corpus is `tiny`'s held-out text (Python source code).
    """
    source = DEFAULT_MODEL if source is None else source
    model, tokenizer = load(source, dtype=dtype)
    if tokenizer is None:
        raise KvforgeError(f"{source} has no tokenizer.json, so text cannot be evaluated on it")
    text = read_text(data) if data is not None else heldout_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode(prompt)
    limit = model.config.max_seq_len
    if len(prompt_ids) > limit:
        raise KvforgeError(f"the prompt is {len(prompt_ids)} tokens; {source} takes at most {limit}")
    if seq_len < 1:
        raise KvforgeError(f"seq_len must be at least 1, got {seq_len}")
    seq_len = min(seq_len, limit)  # windows of the model's context at most
    new = greedy_continuation(model, prompt_ids, max_new_tokens, stop=model.config.eos_token_ids)
    return {
        "source": str(source),
        "parameters": model.num_parameters(),
        "corpus": str(data) if data is not None else "tiny held-out (built in)",
        "corpus_tokens": len(ids),
        "perplexity": perplexity(model, ids, seq_len),
        "uniform_perplexity": model.config.vocab_size,
        "prompt": prompt,
        "continuation": tokenizer.decode(new),
    }
