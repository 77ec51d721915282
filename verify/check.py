"""`kvforge check SPEC.toml`: the accuracy regression check for CI.

The spec names a source model, the artifacts to produce (float exports,
calibrations, or existing bundles), the backends to run each on, the data,
and a committed baseline of metrics (JSON, beside the spec). `check` makes
every artifact, compares it with the Torch reference, and then with the
baseline: a metric may move in the bad direction by no more than its
regression tolerance, max(abs, rel x |baseline|). It fails on a regression,
on a comparison outside its absolute bounds, and on an artifact the
baseline lacks. `update_baseline=True` rewrites the baseline on purpose.

    source = "tiny"
    baseline = "tiny.baseline.json"
    [data]
    max_tokens = 4096
    [tolerances]                 # optional: regression allowances
    top1_agreement = 0.01        # a number: absolute
    kl_divergence_mean = { abs = 1e-4, rel = 0.25 }
    [[artifacts]]
    name = "fp32"
    [[artifacts]]
    name = "int8"
    precision = "int8"
    method = "mse"
    smoothquant = 0.5

Spec format: docs/verification.md.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import kvforge
from kvforge.bundle import Bundle, now_utc
from kvforge.calibration.observers import METHODS
from kvforge.checks import positive_int_or_none
from kvforge.errors import KvforgeError
from kvforge.metrics import HIGHER_IS_BETTER, REPORT_METRICS
from kvforge.schema import read_json

from .plots import drift_png
from .stages import Artifact, Outcome, compare_all, drift_curves, produce

# How far a metric may move in its bad direction before it counts as a regression: (absolute, relative).
# perplexity_delta_pct is judged by its magnitude. Relative terms absorb run-to-run kernel differences
# between machines (different CPUs pick different ONNX Runtime kernels); absolute terms, values near zero.
REGRESSION_TOLERANCES: dict[str, tuple[float, float]] = {
    "perplexity_delta_pct": (0.1, 0.1),
    "top1_agreement": (0.01, 0.0),
    "greedy_agreement": (0.05, 0.0),
    "kl_divergence_mean": (1e-4, 0.25),
    "logits_rel_l2": (1e-4, 0.25),
    "present_rel_l2": (1e-4, 0.25),
    # encoders (verify/compare_encoder.py)
    "embedding_cosine_min": (1e-4, 0.0),
    "hidden_rel_l2": (1e-4, 0.25),
}
DATA_KEYS = {"eval": "data", "max_tokens": "max_tokens", "seq_len": "seq_len", "steps": "steps", "prompts": "prompts",
             "random": "random_data"}


@dataclass
class Spec:
    path: Path
    source: str
    baseline: Path
    artifacts: list[Artifact]
    calibration_data: str | None = None
    compare_options: dict[str, Any] = field(default_factory=dict)
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    reference: str | None = None


def _tolerance(key: str, value) -> tuple[float, float]:
    if key not in REPORT_METRICS:
        raise KvforgeError(f"[tolerances]: unknown metric {key!r}; choose from {list(REPORT_METRICS)}")
    if isinstance(value, bool):
        raise KvforgeError(f"tolerance {key}: a number (absolute) or {{ abs = ..., rel = ... }}, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value), 0.0
    if isinstance(value, dict) and set(value) <= {"abs", "rel"}:
        return float(value.get("abs", 0.0)), float(value.get("rel", 0.0))
    raise KvforgeError(f"tolerance {key}: a number (absolute) or {{ abs = ..., rel = ... }}, got {value!r}")


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise KvforgeError(f"no such spec: {path}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise KvforgeError(f"{path} is not a valid TOML spec: {e}") from e
    root = path.resolve().parent
    unknown = set(raw) - {"source", "baseline", "reference", "data", "tolerances", "artifacts"}
    if unknown:
        raise KvforgeError(f"{path}: unknown keys {sorted(unknown)}")
    if not raw.get("artifacts"):
        raise KvforgeError(f"{path} lists no [[artifacts]]")
    if not isinstance(raw["artifacts"], list) or not all(isinstance(a, dict) for a in raw["artifacts"]):
        raise KvforgeError(f"{path}: artifacts must be an array of tables, one [[artifacts]] block each")
    data = dict(raw.get("data", {}))
    calibration = data.pop("calibration", None)
    bad = set(data) - set(DATA_KEYS)
    if bad:
        raise KvforgeError(f"{path} [data]: unknown keys {sorted(bad)}; known: {sorted(DATA_KEYS) + ['calibration']}")
    options = {DATA_KEYS[k]: v for k, v in data.items()}
    for key in ("max_tokens", "seq_len", "steps", "prompts"):
        if not positive_int_or_none(options.get(key)):
            raise KvforgeError(f"{path} [data]: {key} must be a positive integer, got {options[key]!r}")
    if "data" in options:
        options["data"] = str(root / options["data"])
    tolerances = dict(REGRESSION_TOLERANCES)
    for key, value in raw.get("tolerances", {}).items():
        tolerances[key] = _tolerance(key, value)
    reference = raw.get("reference")
    source = str(raw.get("source", "tiny"))
    if (root / source).exists():  # a checkpoint directory beside the spec
        source = str(root / source)
    artifacts = [Artifact.from_dict(a, root) for a in raw["artifacts"]]
    _check_artifacts(path, artifacts)
    return Spec(
        path=path, source=source, baseline=root / raw.get("baseline", f"{path.stem}.baseline.json"),
        artifacts=artifacts,
        calibration_data=str(root / calibration) if calibration else None,
        compare_options=options, tolerances=tolerances,
        reference=str(root / reference) if reference and (root / reference).exists() else reference,
    )


def _check_artifacts(path: Path, artifacts: list[Artifact]) -> None:
    """What can be checked before any work: names, bases, bundle paths, calibration options' values."""

    names = [a.name for a in artifacts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise KvforgeError(f"{path}: artifact names {dup} appear more than once")
    for a in artifacts:
        where = f"{path}: artifact {a.name!r}"
        if a.base is not None and a.base not in names:
            raise KvforgeError(f"{where}: base {a.base!r} is not an artifact of this spec ({names})")
        if a.bundle is not None:
            if not Path(a.bundle).is_dir():
                raise KvforgeError(f"{where}: bundle {a.bundle} does not exist")
            if a.dtype != "float32" or a.precision is not None:
                raise KvforgeError(f"{where}: an existing bundle is used as it is; drop dtype/precision")
        method = a.calibrate.get("method")
        if method is not None and method not in METHODS:
            raise KvforgeError(f"{where}: method {method!r} is not one of {METHODS}")
        for key in ("samples", "seq_len", "block_size"):
            if not positive_int_or_none(a.calibrate.get(key)):
                raise KvforgeError(f"{where}: {key} must be a positive integer, got {a.calibrate[key]!r}")
        if "block_size" in a.calibrate and not (a.precision == "int4" or a.calibrate.get("weights_only")):
            raise KvforgeError(f"{where}: block_size applies to the weight-only artifacts (int4, int8 with "
                               "weights_only = true)")


@dataclass
class Finding:
    key: str  # artifact/backend
    metric: str
    baseline: float | None
    current: float | None
    limit: float | None
    ok: bool
    note: str = ""


@dataclass
class CheckResult:
    spec: Spec
    outcomes: list[Outcome]
    findings: list[Finding]
    baseline_written: bool = False
    estimates: dict[str, dict] = field(default_factory=dict)  # recipe_estimates()

    @property
    def passed(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def regressions(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": str(self.spec.path), "passed": self.passed, "baseline": str(self.spec.baseline),
            "baseline_written": self.baseline_written,
            "results": {o.key: (o.report.result if o.report else {"skipped": o.skipped}) for o in self.outcomes},
            "findings": [f.__dict__ for f in self.findings],
            "recipe_estimates": self.estimates,
        }


ESTIMATED = ("kl_divergence_mean", "perplexity_delta_pct", "top1_agreement")


def recipe_estimates(outcomes: list[Outcome]) -> dict[str, dict]:
    """Each artifact the automatic recipe calibrated: what the recipe measured on its held-out text while it chose
    (the estimate `kvforge calibrate` prints) beside what the check measured on its own text, so a user sees
    whether the printed estimate can be trusted."""
    out = {}
    for o in outcomes:
        if o.report is None or o.bundle is None:
            continue
        recipe = (Bundle(o.bundle).manifest.get("calibration") or {}).get("recipe") or {}
        if not recipe.get("measured_on"):
            continue
        r = o.report.result
        out[o.key] = {
            "estimated": {**{k: recipe["result"][k] for k in ESTIMATED}, "data": recipe["measured_on"]["data"],
                          "tokens": recipe["measured_on"]["tokens"]},
            "measured": {**{k: r.get(k) for k in ESTIMATED}, "data": r.get("data"), "tokens": r.get("tokens")},
        }
    return out


def limit_for(metric: str, baseline: float, tolerance: tuple[float, float]) -> float:
    """The worst value still accepted: baseline moved in the bad direction by max(abs, rel x |baseline|)."""
    allowed = max(tolerance[0], tolerance[1] * abs(baseline))
    if metric in HIGHER_IS_BETTER:
        return baseline - allowed
    if metric == "perplexity_delta_pct":
        return abs(baseline) + allowed
    return baseline + allowed


def against_baseline(outcomes: list[Outcome], baseline: dict[str, Any], tolerances: dict[str, tuple[float, float]]) -> list[Finding]:
    findings = []
    recorded = baseline.get("results", {})
    for o in outcomes:
        if o.report is None:
            continue
        r = o.report.result
        for failure in r["failures"]:
            findings.append(Finding(o.key, failure.split()[0].strip("|"), None, None, None, False, f"outside the absolute bound: {failure}"))
        base = recorded.get(o.key)
        if base is None:
            findings.append(Finding(o.key, "-", None, None, None, False, "not in the baseline; run with --update-baseline"))
            continue
        for metric, tol in tolerances.items():
            if base.get(metric) is None or r.get(metric) is None:  # not measured for this shape of model
                continue
            current = r[metric]
            limit = limit_for(metric, base[metric], tol)
            if metric in HIGHER_IS_BETTER:
                ok = current >= limit
            elif metric == "perplexity_delta_pct":
                ok = abs(current) <= limit
            else:
                ok = current <= limit
            findings.append(Finding(o.key, metric, base[metric], current, limit, ok, "" if ok else "regressed"))
    return findings


def baseline_record(outcomes: list[Outcome], spec: Spec) -> dict[str, Any]:
    keep = set(REGRESSION_TOLERANCES) | set(spec.tolerances) | {"perplexity_reference", "perplexity_candidate", "logits_max_abs"}
    return {
        "spec": spec.path.name,
        "written": now_utc(),
        "tool": f"kvforge {kvforge.__version__}",
        "results": {o.key: {k: v for k, v in o.report.result.items() if k in keep and v is not None}
                    for o in outcomes if o.report is not None},
    }


def check(spec_path: str | Path, update_baseline: bool = False, *, workdir: str | Path | None = None,
          progress=None, log: Callable[[str], None] = print) -> CheckResult:
    """Run a spec: produce, compare with the reference, then with the baseline (or rewrite it)."""
    spec = load_spec(spec_path)
    baseline: dict[str, Any] | None = None
    if not update_baseline:
        if not spec.baseline.is_file():
            raise KvforgeError(f"no baseline at {spec.baseline}; create it on purpose with `kvforge check {spec.path} --update-baseline`")
        baseline = read_json(spec.baseline, "baseline")
    tmp = None
    if workdir is None:
        tmp = Path(tempfile.mkdtemp(prefix="kvforge-check-"))
    work = Path(workdir) if workdir is not None else tmp
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvforgeError(f"cannot create the work directory {work}: {e.strerror or e}") from e
    try:
        paths = produce(spec.source, spec.artifacts, work, spec.calibration_data, progress, log)
        outcomes = compare_all(spec.artifacts, paths, work, spec.reference, spec.compare_options, progress, log)
        estimates = recipe_estimates(outcomes)  # read from the bundles, before a temporary workdir goes
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if update_baseline:
        record = baseline_record(outcomes, spec)
        findings = against_baseline(outcomes, record, spec.tolerances)
        spec.baseline.write_text(json.dumps(record, indent=2) + "\n")
        return CheckResult(spec, outcomes, findings, baseline_written=True, estimates=estimates)
    return CheckResult(spec, outcomes, against_baseline(outcomes, baseline, spec.tolerances), estimates=estimates)


def write_check_report(result: CheckResult, json_path: str | Path) -> list[Path]:
    """The check's JSON report and a drift picture of every artifact beside it."""

    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    written = [json_path]
    curves = drift_curves(result.outcomes)
    if curves:
        written.append(drift_png(curves, json_path.with_name(f"{json_path.stem}-drift.png")))
    return written
