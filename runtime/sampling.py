"""Next-token selection in numpy: repetition penalty, a grammar's mask, temperature, top-k, top-p, seeded sampling.

The order is Hugging Face's: repetition penalty, then temperature, top-k and
top-p, then a draw. Temperature 0 is greedy (argmax), whatever the rest says.
A response format's mask (runtime/constrain.py) sets the logits of the tokens
it forbids to -inf after the repetition penalty, so top-k and top-p choose
among the allowed tokens and greedy is the argmax over them.

Log-probabilities (`token_logprobs`) are those of the model's raw logits: the
log-softmax before the penalty, the temperature, top-k/p and the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.checks import is_int, is_number
from kvforge.errors import KvforgeError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # 1 = no nucleus cut
    repetition_penalty: float = 1.0  # 1 = none; > 1 discourages tokens already in the sequence

    def __post_init__(self):
        for name in ("temperature", "top_p", "repetition_penalty"):
            if not is_number(getattr(self, name)):
                raise KvforgeError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not is_int(self.top_k):
            raise KvforgeError(f"top_k must be an int (0: no limit), got {self.top_k!r}")
        problems = []
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if problems:
            raise KvforgeError("; ".join(problems))


def apply_repetition_penalty(logits: np.ndarray, seen: list, penalty: float) -> np.ndarray:
    """CTRL-style: a seen token's logit is divided by `penalty` if positive, multiplied if negative."""
    if penalty == 1.0:
        return logits
    logits = logits.copy()
    for row, tokens in enumerate(seen):
        idx = np.unique(tokens)
        values = logits[row, idx]
        logits[row, idx] = np.where(values > 0, values / penalty, values * penalty)
    return logits


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[:, -k][:, None]
    return np.where(logits < kth, -np.inf, logits)


def _top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of tokens whose probability sums to >= p (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1)
    sorted_logits = np.take_along_axis(logits, order, axis=-1)
    probs = _softmax(sorted_logits)
    cum = np.cumsum(probs, axis=-1)
    remove_sorted = (cum - probs) >= p  # tokens whose predecessors already reach p
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, logits)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _processed(logits: np.ndarray, seen: list[np.ndarray], cfg: SamplingConfig, allowed: np.ndarray | None) -> np.ndarray:
    logits = apply_repetition_penalty(np.asarray(logits, dtype=np.float32), seen, cfg.repetition_penalty)
    if allowed is not None:
        logits = np.where(allowed, logits, np.float32(-np.inf))
    return logits


def _distribution(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)  # <= 0: a tiny temperature gives -inf, not NaN
    with np.errstate(over="ignore"):
        scaled = _top_p(_top_k(shifted / cfg.temperature, cfg.top_k), cfg.top_p)
    return _softmax(scaled)


def probabilities(logits: np.ndarray, seen: list[np.ndarray], cfg: SamplingConfig,
                  allowed: np.ndarray | None = None) -> np.ndarray:
    """The distribution (B, V) float64 select() draws from at temperature > 0 (after the repetition penalty, the
    mask, temperature, top-k and top-p); at temperature 0, all mass on select()'s argmax."""
    logits = _processed(logits, seen, cfg, allowed)
    if cfg.temperature == 0.0:  # (one-hot rows: an identity matrix of the vocabulary would be V x V)
        probs = np.zeros(logits.shape, np.float64)
        np.put_along_axis(probs, logits.argmax(axis=-1)[:, None], 1.0, axis=-1)
        return probs
    return _distribution(logits, cfg)


def draw(probs: np.ndarray, rngs: list[np.random.Generator]) -> np.ndarray:
    """One token per row from distributions (B, V), one uniform of each row's generator."""
    u = np.array([[g.random()] for g in rngs])
    # the first token whose cumulative probability reaches u; rounding may leave the sum short of u, then the last
    # token that has any probability (never one the mask, top-k or top-p removed)
    last = probs.shape[-1] - 1 - (probs[:, ::-1] > 0).argmax(axis=-1)
    return np.minimum((np.cumsum(probs, axis=-1) < u).sum(axis=-1), last)


def select(logits: np.ndarray, seen: list[np.ndarray], cfg: SamplingConfig, rngs: list[np.random.Generator],
           allowed: np.ndarray | None = None) -> np.ndarray:
    """One token per row from logits (B, V); `seen` holds each row's prompt + generated ids; one generator per row;
    `allowed` (B, V) bool: the tokens each row may take (None: all; every row allows at least one)."""
    logits = _processed(logits, seen, cfg, allowed)
    if cfg.temperature == 0.0:
        return logits.argmax(axis=-1)
    return draw(_distribution(logits, cfg), rngs)


def token_logprobs(logits: np.ndarray, chosen: np.ndarray, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: the chosen token's log-probability and the k most likely tokens' (id, log-probability), most likely
    first, from the raw logits (B, V): log-softmax before penalty, temperature, top-k/p and a grammar's mask."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    out = []
    for row, token in enumerate(np.asarray(chosen).tolist()):
        top: list[tuple[int, float]] = []
        if k > 0:
            kk = min(k, logp.shape[-1])
            idx = np.argpartition(-logp[row], kk - 1)[:kk]
            idx = idx[np.lexsort((idx, -logp[row, idx]))]  # most likely first, ties by id
            top = [(int(i), float(logp[row, i])) for i in idx]
        out.append((float(logp[row, int(token)]), top))
    return out
