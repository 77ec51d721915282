"""What every comparison shares, whatever the model kind: default bounds, the report, the reference's source.

compare.py (decoders) and compare_encoder.py / compare_seq2seq.py (the other kinds) import these; none of
them imports another's module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

# Default bounds per precision (measured on tiny, with margin; see docs/verification.md).
# Quantized logits move by whole units, so there the bounds are on what users feel:
# perplexity, agreement and KL. greedy_agreement counts prompts x steps decisions
# (128 by default), so its floor sits below top1_agreement's.
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"perplexity_delta_pct": 0.01, "top1_agreement": 0.999, "kl_divergence_mean": 1e-6,
                "logits_rel_l2": 1e-4, "greedy_agreement": 0.99, "present_rel_l2": 1e-4},
    "float16": {"perplexity_delta_pct": 0.5, "top1_agreement": 0.98, "kl_divergence_mean": 1e-3,
                "logits_rel_l2": 2e-2, "greedy_agreement": 0.95, "present_rel_l2": 2e-2},
    "bfloat16": {"perplexity_delta_pct": 2.0, "top1_agreement": 0.95, "kl_divergence_mean": 1e-2,
                 "logits_rel_l2": 8e-2, "greedy_agreement": 0.9, "present_rel_l2": 8e-2},
    "int8": {"perplexity_delta_pct": 2.0, "top1_agreement": 0.9, "kl_divergence_mean": 0.05, "greedy_agreement": 0.8},
    "fp8": {"perplexity_delta_pct": 1.0, "top1_agreement": 0.93, "kl_divergence_mean": 0.03, "greedy_agreement": 0.8},
    "int4": {"perplexity_delta_pct": 3.0, "top1_agreement": 0.88, "kl_divergence_mean": 0.05, "greedy_agreement": 0.75},
    # a pre-quantized checkpoint's own codes, against its dequantization: the same weights (issue 32: perplexity
    # within 0.1%); a tensor of a type no Q/DQ expresses is converted and costs a little more
    "checkpoint": {"perplexity_delta_pct": 0.1, "top1_agreement": 0.99, "kl_divergence_mean": 1e-4,
                   "logits_rel_l2": 1e-3, "greedy_agreement": 0.95, "present_rel_l2": 1e-3},
}


def precision_of(bundle: Bundle) -> str:
    """The key of DEFAULT_TOLERANCES for a bundle: its Q/DQ format, else its float dtype."""
    return bundle.precision_key


@dataclass
class Report:
    """One comparison: `result` holds the JSON-ready report (keys in docs/verification.md)."""

    result: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.result["passed"])

    @property
    def failures(self) -> list[str]:
        return list(self.result["failures"])

    def __getitem__(self, key: str):
        return self.result[key]


def reference_source(candidate: Bundle, reference, float_model: str | None = None) -> str:
    """REF as given, or the source the candidate was made from (refused when its files changed since).
    float_model: the candidate's shape, whose reference must be a model source, not a bundle."""
    if reference is None:
        recorded = (candidate.manifest.get("lineage") or [{}])[0].get("input", {})
        reference = candidate.recorded_source
        if reference is None:
            raise KvforgeError(f"{candidate.path} records no source model; pass --reference")
        from kvforge.export.api import source_digest  # torch: only when the reference must be rebuilt

        now = source_digest(reference)["sha256"]
        if recorded.get("sha256") and now != recorded["sha256"]:
            raise KvforgeError(
                f"the source {reference} has changed since {candidate.path} was made from it (sha256 recorded "
                f"{recorded['sha256'][:16]}, now {now[:16]}); re-export, or pass --reference to compare against it as it is"
            )
    if float_model and Bundle.is_bundle(reference):
        raise KvforgeError(f"the reference {reference} is a bundle; an {float_model} is compared with its Torch source model")
    return str(reference)
