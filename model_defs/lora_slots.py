"""A LoRA slot's computation (model_defs/lora.py has the design): the layer class a targeted nn.Linear becomes, the
feed of one forward's adapters, and the rows' mask of a mixture's expert run on tokens gathered across rows. Apart
from lora.py, which reads checkpoints and adapters, so that the layers (model_defs/moe.py) can import it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn


@dataclass
class LoraFeed:
    """One forward's adapters: mask (batch, W) and, per slot name, (A (in, W), B (W, out)). mask None: every row
    takes all W columns (export validation's feed, whatever the case's batch). `tokens`, while a mixture's expert
    runs on tokens gathered across rows (model_defs/moe.py), is their rows' mask (1, M, W)."""

    mask: torch.Tensor | None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    tokens: torch.Tensor | None = None


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA slot (its class swapped in place by add_slots: same parameters, same names)."""

    lora_slot: str
    lora_owner: list  # [the model]: a list, so that the model is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        feed = self.lora_owner[0].lora_feed
        if feed is None:
            return y
        a, b = feed.weights[self.lora_slot]
        h = torch.matmul(x, a.to(x.dtype))  # (B, T, W): every adapter's down-projection
        if feed.tokens is not None:
            h = h * feed.tokens.to(x.dtype)  # an expert's gathered tokens keep their rows' adapters' columns
        elif feed.mask is not None:
            h = h * feed.mask.to(x.dtype)[:, None, :]  # each row keeps its own adapter's columns
        return y + torch.matmul(h, b.to(x.dtype))


@contextlib.contextmanager
def expert_tokens(module: nn.Module, token: torch.Tensor, seq: int) -> Iterator[None]:
    """While `module` (an expert) runs on the flat tokens `token` (indices into batch x seq), give its slots those
    tokens' rows' mask. Nothing to do for a module without slots, or a feed without a mask."""
    slot = next((m for m in module.modules() if isinstance(m, LoraLinear)), None)
    feed = slot.lora_owner[0].lora_feed if slot is not None else None
    if feed is None or feed.mask is None:
        yield
        return
    feed.tokens = feed.mask[torch.div(token, seq, rounding_mode="floor")][None]
    try:
        yield
    finally:
        feed.tokens = None
