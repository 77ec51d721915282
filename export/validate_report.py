"""Per-output comparison of the candidate with the reference, the bounds, and the validation report.

Every output is judged on its own: the logits and each layer's present key/value (latent). The candidate
is measured against the truth and its error divided by a reference's own rounding noise in the graph's dtype
on the same inputs, which gives the ratio the bound is stated in: in FP32, against the FP64 reference, the
noise being the FP32 reference's (|ref32 - ref64|); in FP16/BF16, against the FP32 reference, the noise
being the reference computed in the dtype's (|ref_half - ref32|, HalfReference); at least one ulp of the
dtype at the output's magnitude. Presents are per layer, so the report can name the first
layer whose cache departs from the reference: everything before it computed what the reference computed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvforge import metrics

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: one ulp at 1.0


def _np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):  # (bfloat16 has no numpy dtype: widened, exactly)
        return (t.float() if t.dtype == torch.bfloat16 else t).detach().numpy()
    return np.asarray(t)


def _abs_rel(candidate: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    return metrics.max_abs(candidate, reference), metrics.rel_l2(candidate, reference)


def _ratio(value: float, floor: float) -> float:
    """value / floor; a non-finite value (NaN from a broken graph) is infinitely far off."""
    return value / floor if math.isfinite(value) else math.inf


def layer_of(name: str) -> int | None:
    """present.3.key -> 3; logits -> None."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "present" else None


def judge_noise(name: str, cand: np.ndarray, truth: np.ndarray, noisy: np.ndarray, tol: dict[str, float],
                eps: float) -> dict[str, Any]:
    """Candidate vs the truth, in multiples of a reference's own rounding error on the same inputs (|noisy - truth|;
    at least floor_ulps of `eps`, the dtype's ulp at 1.0, times the output's magnitude for max abs). Judged on
    the worse of max abs and rel L2, or on rel L2 alone where tol["judge_max_abs"] is 0."""
    err_abs, err_rel = _abs_rel(cand, truth)
    noise_abs, noise_rel = _abs_rel(noisy, truth)
    magnitude = float(np.abs(truth).max()) if truth.size else 0.0
    floor_abs = max(noise_abs, tol["floor_ulps"] * eps * magnitude, 1e-30)
    floor_rel = max(noise_rel, tol["floor_ulps"] * eps)
    ratio_abs, ratio_rel = _ratio(err_abs, floor_abs), _ratio(err_rel, floor_rel)
    worse = "max_abs" if tol["judge_max_abs"] and ratio_abs >= ratio_rel else "rel_l2"
    value, floor, ratio = (err_abs, floor_abs, ratio_abs) if worse == "max_abs" else (err_rel, floor_rel, ratio_rel)
    limit = tol["noise_multiple"]
    return {"output": name, "metric": worse, "value": value, "noise": floor, "ratio": ratio, "allowed": limit * floor,
            "excess": ratio / limit, "ratio_max_abs": ratio_abs, "ratio_rel_l2": ratio_rel,
            "noise_max_abs": noise_abs, "noise_rel_l2": noise_rel, "magnitude": magnitude,
            "allowed_max_abs": limit * floor_abs}


def compare_case(names: list[str], cand, truth, noisy, valid: np.ndarray | None, tol: dict[str, float],
                 eps: float) -> dict[str, Any]:
    """Metrics (candidate vs the truth) and per-output verdicts for one run (judge_noise). FP32 graphs: the truth
    is the FP64 reference and `noisy` the FP32 one; half graphs: the FP32 reference and the reference computed in
    the graph's dtype (HalfReference). valid: the real (unpadded) query positions, for logits."""
    judged, per_output = [], []
    for i, name in enumerate(names):
        c = np.asarray(cand[i]).astype(np.float32)
        t = _np(truth[i]).astype(np.float64)
        n = _np(noisy[i]).astype(np.float64)
        if i == 0 and valid is not None:
            c, t, n = c[valid], t[valid], n[valid]
        magnitude = float(np.abs(t).max()) if t.size else 0.0
        m = {**metrics.tensor_metrics(c, t), "reference_magnitude": magnitude}
        if i == 0:
            m.update(top1_agreement=metrics.top1_agreement(c, t),
                     kl_divergence_mean=float(metrics.kl_divergence(c, t).mean()))
        per_output.append(m)
        judged.append(judge_noise(name, c, t, n, tol, eps))
    finite = all(np.isfinite(np.asarray(o, dtype=np.float32)).all() for o in cand)
    return _case_record(judged, per_output, finite)


def _case_record(judged: list[dict], per_output: list[dict], finite: bool) -> dict[str, Any]:
    failing = [j for j in judged if j["excess"] > 1.0]
    worst = max(judged, key=lambda j: j["excess"])
    first_layer = next((layer_of(j["output"]) for j in failing if layer_of(j["output"]) is not None), None)
    record = {
        "logits": per_output[0],
        "present": metrics.worst(per_output[1:]) if len(per_output) > 1 else {},
        "finite": finite,
        "worst_output": worst["output"],
        "ratio": worst["ratio"],
        "excess": worst["excess"],
        "first_layer": first_layer,
        "failing_outputs": [j["output"] for j in failing],
        "_judged": judged,  # dropped before the summary
    }
    record["noise"] = {
        "logits": {"max_abs": judged[0]["noise_max_abs"], "rel_l2": judged[0]["noise_rel_l2"]},
        "present": {"max_abs": max((j["noise_max_abs"] for j in judged[1:]), default=0.0),
                    "rel_l2": max((j["noise_rel_l2"] for j in judged[1:]), default=0.0)},
    }
    return record


def describe(j: dict[str, Any], noise: str) -> str:
    """One verdict in words, e.g. `logits_max_abs 0.0073 > 6.7e-05 (3.5e+03x the FP32 reference's rounding noise
    2.1e-06, allowed 32x)`; noise: whose rounding the floor is."""
    return (f"{j['output']}_{j['metric']} {j['value']:.3g} > {j['allowed']:.3g} "
            f"({j['ratio']:.3g}x {noise} {j['noise']:.3g}, allowed {j['allowed'] / j['noise']:.3g}x)")


def case_failures(label: str, record: dict[str, Any], noise: str) -> list[str]:
    """The failure lines of one run: non-finite outputs; else its worst output, how many others, the first layer."""
    lines = [] if record["finite"] else [f"{label}: non-finite values in the outputs"]
    failing = [j for j in record["_judged"] if j["excess"] > 1.0]
    if not failing:
        return lines
    worst = max(failing, key=lambda j: j["excess"])
    text = f"{label}: {describe(worst, noise)}"
    others = len(failing) - 1
    if others:
        text += f"; {others} more output{'s' if others > 1 else ''} off"
    if record["first_layer"] is not None:
        first = next(j for j in failing if layer_of(j["output"]) == record["first_layer"])
        text += f"; first departing cache: layer {record['first_layer']} ({first['output']}, {first['ratio']:.3g}x)"
    elif worst["output"] == "logits":
        text += "; every layer's cache within bounds"
    return lines + [text]


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its private verdict list (the summary is JSON for the manifest)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


def first_failure(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where validation first failed (in case order): the case, its worst output, ratio and first departing layer."""
    for r in records:
        if r["excess"] > 1.0 or not r["finite"]:
            return {"case": r["case"], "output": r["worst_output"], "ratio": r["ratio"], "excess": r["excess"],
                    "first_layer": r["first_layer"], "failing_outputs": len(r["failing_outputs"])}
    return None


def worst_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run that came closest to (or went furthest past) its bound."""
    if not records:
        return None
    r = max(records, key=lambda r: r["excess"])
    return {"case": r["case"], "output": r["worst_output"], "ratio": r["ratio"], "excess": r["excess"],
            "first_layer": r["first_layer"]}
