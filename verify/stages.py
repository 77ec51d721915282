"""Produce a set of artifacts from one source and compare each on its backends: what `check` and `pipeline` share.

An artifact is a float export (dtype; a pre-quantized source's dequantized weights), a calibration of a float
artifact (precision + recipe), a pre-quantized source's own codes (precision "checkpoint": `kvforge export`'s
default for such a source), or an existing bundle (path). Each is compared against
the Torch reference on each of its backends; "tensorrt" first builds an
engine from the artifact, and is skipped, with the reason, where TensorRT or
a GPU is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvforge.calibration import calibrate
from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.metrics import parse_tolerances
from kvforge.runtime.session import BACKENDS

from .compare import compare
from .compare_decoder import ReferenceRuns
from .report import Report

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
QUANT_PRECISIONS = ("int8", "fp8", "int4", "checkpoint")  # checkpoint: the source's own codes, not calibrated
CALIBRATE_OPTIONS = ("method", "percentile", "smoothquant", "exclude", "block_size", "kv_cache", "samples", "seq_len",
                     "random_data", "quantize_lm_head", "gptq", "recipe", "activations", "weights_only")


@dataclass
class Artifact:
    name: str
    dtype: str = "float32"  # the export dtype (float artifacts)
    precision: str | None = None  # int8 / fp8 / int4: calibrated from `base`
    base: str | None = None  # the float artifact to calibrate (default: the float32 one)
    bundle: str | None = None  # an existing bundle, used as it is
    calibrate: dict[str, Any] = field(default_factory=dict)
    backends: list[str] = field(default_factory=lambda: ["onnxruntime"])
    tolerances: dict[str, float] = field(default_factory=dict)  # absolute bounds for compare
    per_layer: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], root: Path | None = None) -> Artifact:
        d = dict(d)
        name = d.pop("name", None)
        if not name or not isinstance(name, str) or "/" in name:
            raise KvforgeError(f"every artifact needs a plain name (no '/'), got {name!r}")
        calib = {k: d.pop(k) for k in CALIBRATE_OPTIONS if k in d}
        known = {"dtype", "precision", "base", "bundle", "backends", "tolerances", "per_layer"}
        unknown = set(d) - known
        if unknown:
            raise KvforgeError(f"artifact {name!r}: unknown keys {sorted(unknown)}; known: {sorted(known | set(CALIBRATE_OPTIONS))}")
        art = cls(name=name, calibrate=calib, **d)
        if art.dtype not in FLOAT_DTYPES:
            raise KvforgeError(f"artifact {name!r}: dtype {art.dtype!r} is not one of {FLOAT_DTYPES}")
        if art.precision is not None and art.precision not in QUANT_PRECISIONS:
            raise KvforgeError(f"artifact {name!r}: precision {art.precision!r} is not one of {QUANT_PRECISIONS}")
        if calib and art.precision in (None, "checkpoint"):
            raise KvforgeError(f"artifact {name!r}: {sorted(calib)} apply to calibrated artifacts (set precision)")
        if art.bundle is not None and root is not None:
            art.bundle = str((root / art.bundle).resolve())

        art.tolerances = parse_tolerances(art.tolerances)
        if isinstance(art.backends, str):
            art.backends = [art.backends]

        bad = [b for b in art.backends if b not in BACKENDS]
        if bad or not art.backends:
            raise KvforgeError(f"artifact {name!r}: backends {art.backends} must be a non-empty list from {list(BACKENDS)}")
        if art.precision is not None and "torch" in art.backends:
            raise KvforgeError(f"artifact {name!r}: a {art.precision} artifact cannot run on the torch backend, "
                               "which runs the float reference; use onnxruntime or tensorrt")
        return art

    @property
    def label(self) -> str:
        return self.precision or self.dtype


@dataclass
class Outcome:
    artifact: str
    backend: str
    bundle: str | None
    report: Report | None = None
    skipped: str | None = None  # why it was not run

    @property
    def key(self) -> str:
        return f"{self.artifact}/{self.backend}"


Progress = Callable[[str, int, int], None]


def produce(source, artifacts: list[Artifact], workdir: Path, calibration_data=None, progress: Progress | None = None,
            log: Callable[[str], None] = print) -> dict[str, Path]:
    """Make every artifact's bundle under workdir (name -> path), float exports first."""
    from kvforge.export import export  # torch: only when an artifact is made, not when a check reads a baseline

    names = [a.name for a in artifacts]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise KvforgeError(f"artifact names must be unique; repeated: {sorted(dupes)}")
    paths: dict[str, Path] = {}
    floats = [a for a in artifacts if a.precision is None and a.bundle is None]
    for a in artifacts:
        if a.bundle is not None:
            paths[a.name] = Path(a.bundle)
    for a in floats:
        log(f"export {a.name}: {source} as {a.dtype}")
        paths[a.name] = export(source, workdir / a.name, dtype=a.dtype, force=True, dequantize=True,
                               progress=progress).path
    for a in artifacts:
        if a.precision == "checkpoint" and a.bundle is None:
            log(f"export {a.name}: {source} with its checkpoint's codes kept")
            bundle = export(source, workdir / a.name, force=True, progress=progress)
            if bundle.quantization is None:
                raise KvforgeError(f"artifact {a.name!r}: {source} holds no quantized weights to keep; its float "
                                   "export is a dtype artifact")
            paths[a.name] = bundle.path
    for a in artifacts:
        if a.precision in (None, "checkpoint") or a.bundle is not None:
            continue
        base = a.base or next((f.name for f in floats if f.dtype == "float32"), None)
        if base is None:  # nothing to calibrate from was asked for: export one, not compared
            base = "_float32"
            if base not in paths:
                log(f"export {base}: {source} as float32 (the base for calibration)")
                paths[base] = export(source, workdir / base, dtype="float32", force=True, dequantize=True,
                                     progress=progress).path
        if base not in paths:
            raise KvforgeError(f"artifact {a.name!r}: base {base!r} is not a float artifact of this run")
        log(f"calibrate {a.name}: {a.precision} from {base}")
        options = {"data": calibration_data, **a.calibrate}
        options["exclude"] = list(options.get("exclude") or [])
        if "tensorrt" in a.backends and a.precision in ("int8", "fp8") and not options.get("weights_only"):
            options.setdefault("activations", "static")  # TensorRT takes constant scales only
        if "tensorrt" in a.backends and a.precision == "int4":
            options.setdefault("zero_points", False)  # TensorRT's INT4 blocks are symmetric
        paths[a.name] = calibrate(paths[base], workdir / a.name, precision=a.precision, force=True, progress=progress, **options).path
    return paths


def compare_all(artifacts: list[Artifact], paths: dict[str, Path], workdir: Path, reference=None,
                compare_options: dict[str, Any] | None = None, progress: Progress | None = None,
                log: Callable[[str], None] = print) -> list[Outcome]:
    """Compare every artifact on every backend it names; a backend whose library or device is missing is skipped.
    The artifacts share one reference: its outputs are computed once (compare_decoder.ReferenceRuns)."""
    outcomes = []
    runs = ReferenceRuns()
    for a in artifacts:
        for backend in a.backends:
            bundle = paths[a.name]
            if backend == "tensorrt":
                from kvforge.export.engine import build  # torch and TensorRT: only for engine artifacts

                try:  # an engine bundle beside the ONNX one (MissingDependencyError without TensorRT or a GPU)
                    bundle = build(bundle, workdir / f"{bundle.name}-engine", force=True).path
                except MissingDependencyError as e:
                    log(f"skipped the TensorRT engine build for {a.name}: {e}")
                    outcomes.append(Outcome(a.name, backend, None, skipped=str(e)))
                    continue
            log(f"compare {a.name} on {backend}")
            report = compare(bundle, reference, backend=backend, tolerances=a.tolerances, per_layer=a.per_layer,
                             progress=progress, reference_runs=runs, **(compare_options or {}))
            outcomes.append(Outcome(a.name, backend, str(bundle), report))
    return outcomes


def drift_curves(outcomes: list[Outcome]) -> dict[str, list[dict[str, Any]]]:
    return {o.key: o.report.result["drift"] for o in outcomes if o.report is not None and o.report.result.get("drift")}
