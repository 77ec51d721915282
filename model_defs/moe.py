"""Mixture of experts: a router picks k of N expert FFNs per token, and only those run.

    scores  = softmax(router(x))  or  sigmoid(router(x))          (B*T, N), float32
    chosen  = top-k of scores (+ a correction bias, for the choice only: DeepSeek-V3), optionally
              group-limited: only within the token's best topk_groups groups of experts (DeepSeek)
    weights = the chosen scores, renormalized to sum 1 when asked, * routed_scaling_factor
    y       = sum over the chosen experts e of weights_e * expert_e(x)
            + shared(x) (* sigmoid(shared_gate(x)): Qwen2-MoE)

Dispatch is by expert, not by token: for each expert, the tokens routed to it
are gathered (their indices from `nonzero`), run through that expert's FFN,
weighted and scattered back. So a step computes k experts' FFNs per token
and reads only the experts some token chose: decode cost follows the active
parameters, not the total. Each expert is the dense layers' gated FFN, so its
matmuls look like any other linear layer's to calibration and fusions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lora_slots import expert_tokens


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, scoring: str = "softmax", norm_topk: bool = True,
                 scaling: float = 1.0, correction_bias: bool = False, groups: int = 1, topk_groups: int = 1,
                 group_score: str = "max"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        self.bias = nn.Parameter(torch.zeros(n_experts)) if correction_bias else None
        self.top_k, self.scoring, self.norm_topk, self.scaling = top_k, scoring, norm_topk, scaling
        self.groups, self.topk_groups, self.group_score = groups, topk_groups, group_score

    def _group_scores(self, choice: torch.Tensor) -> torch.Tensor:
        """(M, groups): what each group of experts scores for each token."""
        M, N = choice.shape
        grouped = choice.reshape(M, self.groups, N // self.groups)
        if self.group_score == "max":  # DeepSeek-V2: a group scores its best expert
            return grouped.max(dim=-1).values
        return torch.topk(grouped, 2, dim=-1).values.sum(dim=-1)  # DeepSeek-V3: its best two, summed

    def _grouped(self) -> bool:
        return self.groups > 1 and self.topk_groups < self.groups

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """choice (M, N) with every expert outside the token's best topk_groups groups set to -inf."""
        M, N = choice.shape
        score = self._group_scores(choice)
        _, best = torch.topk(score, self.topk_groups, dim=-1)
        keep = torch.zeros_like(score).scatter(1, best, 1.0)  # (M, groups)
        keep = keep.unsqueeze(-1).expand(M, self.groups, N // self.groups).reshape(M, N)
        return choice.masked_fill(keep == 0, float("-inf"))

    def _scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, choice): what weights the chosen experts, and what chooses them (scores + correction bias)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        return scores, (scores + self.bias if self.bias is not None else scores)

    @torch.no_grad()
    def decision_margin(self, x: torch.Tensor) -> torch.Tensor:
        """(M,): per token, the smallest gap at one of its routing decisions (between the last group kept and the
        first dropped, between the k-th expert and the next): where it is within rounding, the choice may differ
        between two correct implementations. inf where no decision is made."""
        _, choice = self._scores(x)
        gaps = [torch.full(choice.shape[:1], float("inf"), dtype=choice.dtype)]
        if self._grouped():
            top = torch.topk(self._group_scores(choice), self.topk_groups + 1, dim=-1).values
            gaps.append(top[:, -2] - top[:, -1])
            choice = self._group_limited(choice)
        if self.top_k < choice.shape[-1]:
            top = torch.topk(choice, self.top_k + 1, dim=-1).values
            gaps.append(top[:, -2] - top[:, -1])  # inf where the next expert is in a dropped group
        return torch.stack(gaps).min(0).values

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, C) -> (weights (M, k) float32, expert indices (M, k) int64)."""
        scores, choice = self._scores(x)
        if self._grouped():
            choice = self._group_limited(choice)
        _, index = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, index)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scaling if self.scaling != 1.0 else weights, index


class Experts(nn.Module):
    """N gated FFNs (the dense layers' GatedMLP each), run on the tokens routed to them only."""

    def __init__(self, experts: list[nn.Module]):
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, seq: int = 1) -> torch.Tensor:
        """x (M, C), weights and index (M, k) -> (M, C): each token's weighted sum over its chosen experts. M is
        batch x seq tokens (row-major): an expert's LoRA slots take each token's row's adapter."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # the tokens routed to expert e (a float mask: TensorRT's NonZero takes no bool) and which of their k
            # slots chose it; a token picks an expert at most once, so its row is added to, never twice
            token, slot = torch.nonzero((index == e).to(torch.float32), as_tuple=True)
            with expert_tokens(expert, token, seq):
                y = expert(x[token][None])[0] * weights[token, slot, None].to(x.dtype)
            out = out.index_put((token,), out[token] + y)
        return out


class MoE(nn.Module):
    """The routed experts, plus optional always-on shared experts (one FFN of n_shared x their width)."""

    def __init__(self, router: Router, experts: Experts, shared: nn.Module | None = None, shared_gate: bool = False):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.shared_gate = nn.Linear(router.weight.shape[1], 1, bias=False) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        weights, index = self.router(flat)
        y = self.experts(flat, weights, index, T).reshape(B, T, C)
        if self.shared is not None:
            # on the (B, T, C) input, as the dense FFN: its linear layers export as MatMuls, which calibration
            # quantizes (the router and the shared expert's one-output gate, Gemms on the flat rows, stay float)
            s = self.shared(x)
            y = y + (torch.sigmoid(self.shared_gate(flat)).reshape(B, T, 1) * s if self.shared_gate is not None else s)
        return y
