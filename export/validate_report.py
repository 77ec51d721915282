"""Per-output comparison of the candidate with the reference, the bounds, and the validation report.

Every output is judged on its own: the logits and each layer's present key/value (latent). In FP32 the
candidate is measured against the FP64 reference and its error is divided by the reference's own FP32
rounding noise on the same inputs (|ref32 - ref64|; at least one FP32 ulp of the output's magnitude), which
gives the ratio the bound is stated in. In FP16/BF16 it is measured against the FP32 reference (rel L2),
and the ratio is the error over the dtype's bound. Presents are per layer, so the report can name the first
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
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _abs_rel(candidate: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    return metrics.max_abs(candidate, reference), metrics.rel_l2(candidate, reference)


def _ratio(value: float, floor: float) -> float:
    """value / floor; a non-finite value (NaN from a broken graph) is infinitely far off."""
    return value / floor if math.isfinite(value) else math.inf


def layer_of(name: str) -> int | None:
    """present.3.key -> 3; logits -> None."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "present" else None


def judge_fp32(name: str, cand: np.ndarray, ref64: np.ndarray, ref32: np.ndarray,
               tol: dict[str, float]) -> dict[str, Any]:
    """Candidate vs FP64 reference, in multiples of the FP32 reference's own error on the same inputs."""
    err_abs, err_rel = _abs_rel(cand, ref64)
    noise_abs, noise_rel = _abs_rel(ref32, ref64)
    magnitude = float(np.abs(ref64).max()) if ref64.size else 0.0
    floor_abs = max(noise_abs, tol["floor_ulps"] * EPS32 * magnitude, 1e-30)
    floor_rel = max(noise_rel, tol["floor_ulps"] * EPS32)
    ratio_abs, ratio_rel = _ratio(err_abs, floor_abs), _ratio(err_rel, floor_rel)
    worse = "max_abs" if ratio_abs >= ratio_rel else "rel_l2"
    value, floor, ratio = (err_abs, floor_abs, ratio_abs) if worse == "max_abs" else (err_rel, floor_rel, ratio_rel)
    limit = tol["noise_multiple"]
    return {"output": name, "metric": worse, "value": value, "noise": floor, "ratio": ratio, "allowed": limit * floor,
            "excess": ratio / limit, "ratio_max_abs": ratio_abs, "ratio_rel_l2": ratio_rel,
            "noise_max_abs": noise_abs, "noise_rel_l2": noise_rel, "magnitude": magnitude,
            "allowed_max_abs": limit * floor_abs}


def judge_half(name: str, cand: np.ndarray, ref32: np.ndarray, tol: dict[str, float]) -> dict[str, Any]:
    """Candidate vs FP32 reference: rel L2 against the dtype's fixed bound."""
    err_abs, err_rel = _abs_rel(cand, ref32)
    limit = tol["logits_rel_l2" if name == "logits" else "present_rel_l2"]
    return {"output": name, "metric": "rel_l2", "value": err_rel, "ratio": _ratio(err_rel, limit), "allowed": limit,
            "excess": _ratio(err_rel, limit), "magnitude": float(np.abs(ref32).max()) if ref32.size else 0.0}


def compare_case(names: list[str], cand, ref32, ref64, valid: np.ndarray | None,
                 tol: dict[str, float]) -> dict[str, Any]:
    """Metrics (candidate vs the reference it is judged against) and per-output verdicts for one run.

    ref64 None: half precision, judged against ref32. valid: the real (unpadded) query positions, for logits."""
    judged, per_output = [], []
    for i, name in enumerate(names):
        c = np.asarray(cand[i]).astype(np.float32)
        r32 = _np(ref32[i]).astype(np.float32)
        r64 = _np(ref64[i]).astype(np.float64) if ref64 is not None else None
        if i == 0 and valid is not None:
            c, r32, r64 = c[valid], r32[valid], (r64[valid] if r64 is not None else None)
        target = r64 if r64 is not None else r32
        magnitude = float(np.abs(target).max()) if target.size else 0.0
        m = {**metrics.tensor_metrics(c, target), "reference_magnitude": magnitude}
        if i == 0:
            m.update(top1_agreement=metrics.top1_agreement(c, target),
                     kl_divergence_mean=float(metrics.kl_divergence(c, target).mean()))
        per_output.append(m)
        judged.append(judge_fp32(name, c, r64, r32, tol) if r64 is not None else judge_half(name, c, r32, tol))
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
    if "noise" in worst:
        record["noise"] = {
            "logits": {"max_abs": judged[0]["noise_max_abs"], "rel_l2": judged[0]["noise_rel_l2"]},
            "present": {"max_abs": max((j["noise_max_abs"] for j in judged[1:]), default=0.0),
                        "rel_l2": max((j["noise_rel_l2"] for j in judged[1:]), default=0.0)},
        }
    return record


def describe(j: dict[str, Any], fp32: bool) -> str:
    """One verdict in words, e.g.
    `logits_max_abs 0.0073 > 6.7e-05 (3.5e+03x the reference's FP32 noise floor 2.1e-06, allowed 32x)`."""
    text = f"{j['output']}_{j['metric']} {j['value']:.3g} > {j['allowed']:.3g}"
    if fp32:
        return text + (f" ({j['ratio']:.3g}x the reference's FP32 noise floor {j['noise']:.3g}, "
                       f"allowed {j['allowed'] / j['noise']:.3g}x)")
    return text + f" ({j['ratio']:.3g}x the bound)"


def case_failures(label: str, record: dict[str, Any], fp32: bool) -> list[str]:
    """The failure lines of one run: non-finite outputs; else its worst output, how many others, the first layer."""
    lines = [] if record["finite"] else [f"{label}: non-finite values in the outputs"]
    failing = [j for j in record["_judged"] if j["excess"] > 1.0]
    if not failing:
        return lines
    worst = max(failing, key=lambda j: j["excess"])
    text = f"{label}: {describe(worst, fp32)}"
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
