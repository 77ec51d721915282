"""`compare(candidate, reference)`: docs/design.md's verification metrics for one artifact against the Torch reference.

The candidate's kind picks its comparer (verify/kinds.py): a decoder's windows, lockstep decode and free
running (verify/compare_decoder.py), an encoder's embeddings and heads (compare_encoder.py), an
encoder-decoder's teacher-forced and greedy targets (compare_seq2seq.py). The report's keys are stable
(docs/verification.md). A tolerance names a metric and a bound: a floor for agreements and cosines, a
ceiling for errors; `perplexity_delta_pct` is bounded in absolute value.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

from .kinds import COMPARERS
from .plots import drift_png, layers_png
from .report import Report


def compare(
    candidate: str | Path,
    reference: str | Path | None = None,
    *, data: str | Path | None = None,
    backend: str = "auto",
    steps: int = 32,
    prompts: int = 4,
    prompt_len: int = 32,
    max_tokens: int = 4096,
    seq_len: int = 256,
    batch_size: int = 4,
    tolerances: dict[str, float] | None = None,
    per_layer: bool = False,
    random_data: bool = False,
    seed: int = 0,
    progress=None,
    reference_runs=None,
    adapter: str | None = None,
    **backend_options,
) -> Report:
    """Compare a bundle run on `backend` with the Torch reference (REF: a bundle or a model source;
    default: the source the candidate was exported from). Returns a Report; report.passed applies
    the precision's default tolerances, updated with `tolerances`. reference_runs: a
    compare_decoder.ReferenceRuns that keeps a decoder reference's outputs for the next comparison of an
    artifact of the same model on the same data (what a pipeline or check does). adapter: a LoRA adapter of the
    candidate (a bundle with slots) that it runs with, against the reference with that adapter merged into its
    weights (decoders)."""
    if steps < 1 or prompts < 1 or prompt_len < 1:
        raise KvforgeError(f"steps, prompts and prompt_len must be >= 1, got {steps}, {prompts}, {prompt_len}")
    if not Bundle.is_bundle(candidate):
        raise KvforgeError(f"{candidate} is not a bundle (no kvforge.json); compare runs a bundle against the reference")
    cand_bundle = Bundle(candidate)
    comparer = COMPARERS[cand_bundle.kind.name]
    options = {"steps": steps, "prompts": prompts, "prompt_len": prompt_len, "max_tokens": max_tokens, "seq_len": seq_len,
               "batch_size": batch_size, "tolerances": tolerances, "per_layer": per_layer, "random_data": random_data,
               "seed": seed, "reference_runs": reference_runs, "adapter": adapter}
    if adapter is not None and "adapter" not in comparer.options:
        raise KvforgeError(f"LoRA adapters are served by decoders; {candidate} is {cand_bundle.kind.article}")
    if per_layer and "per_layer" not in comparer.options:
        raise KvforgeError(f"--per-layer attributes a decoder's error to its blocks; {candidate} is {cand_bundle.kind.article}")
    return comparer.run(candidate, reference, data, backend, progress=progress, **{k: options[k] for k in comparer.options},
                        **backend_options)


def write_report(report: Report, json_path: str | Path) -> list[Path]:
    """The report as JSON, with its pictures beside it: <stem>-drift.png and, with per-layer data, <stem>-layers.png."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report.result, indent=2) + "\n")
    label = f"{report['precision']} on {report['candidate_backend']}"
    written = [json_path]
    if report.result.get("drift"):  # decoders: the lockstep drift curve
        written.append(drift_png({label: report["drift"]}, json_path.with_name(f"{json_path.stem}-drift.png")))
    if report.result.get("per_layer"):
        written.append(layers_png(report["per_layer"], json_path.with_name(f"{json_path.stem}-layers.png"), label))
    return written
