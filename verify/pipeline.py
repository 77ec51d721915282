"""`kvforge pipeline [SOURCE] -o WORKDIR`: the main job, end to end.

Export, calibrate, build TensorRT engines where TensorRT and a GPU exist
(saying plainly that the build was skipped where they do not), compare
every artifact with the Torch reference, and write one report:

    WORKDIR/<precision>/          one bundle per precision (engines beside them)
    WORKDIR/report.json           every comparison (docs/verification.md)
    WORKDIR/drift.png             per-step decode drift of every artifact
    WORKDIR/<precision>-layers.png  per-layer error of the quantized artifacts
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import kvforge
from kvforge import runtime
from kvforge.bundle import MANIFEST, Bundle, now_utc
from kvforge.errors import KvforgeError
from kvforge.outputs import owned_entries
from kvforge.schema import ListOf, RelPath, check
from kvforge.tensorrt_env import INSTALL, tensorrt_gpu_missing

from .plots import drift_png, layers_png
from .stages import Artifact, Outcome, compare_all, drift_curves, produce

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4", "checkpoint")
DEFAULT_PRECISIONS = ("fp32", "fp16", "int8", "fp8", "int4")


def _ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def recipe(precision: str) -> Artifact:
    """The pipeline's artifact per precision: quantized ones take `kvforge calibrate`'s defaults, the recipe it
    chooses by measurement (calibration/auto.py), so the table shows what a user gets without options."""
    return {
        "fp32": lambda: Artifact("fp32", dtype="float32"),
        "fp16": lambda: Artifact("fp16", dtype="float16"),
        # ONNX Runtime runs a BF16 graph only on its CUDA provider; on a CPU the BF16 reference model stands in
        "bf16": lambda: Artifact("bf16", dtype="bfloat16", backends=["onnxruntime" if _ort_cuda() else "torch"]),
        "int8": lambda: Artifact("int8", precision="int8", per_layer=True),
        "fp8": lambda: Artifact("fp8", precision="fp8", per_layer=True),
        "int4": lambda: Artifact("int4", precision="int4", per_layer=True),
        # a pre-quantized source's own codes (GGUF, GPTQ, AWQ, compressed-tensors, FP8): added for such a source
        "checkpoint": lambda: Artifact("checkpoint", precision="checkpoint", per_layer=True),
    }[precision]()


def recipes(precisions, source: str, calibration_data=None, random_data: bool = False) -> list[Artifact]:
    """The artifacts for these precisions, adapted to the data there is (random tokens only where asked)."""
    if "checkpoint" not in precisions and _prequantized(source):
        precisions = (*precisions, "checkpoint")
    artifacts = [recipe(p) for p in dict.fromkeys(precisions)]
    for a in artifacts:
        if random_data and a.precision in ("int8", "fp8"):
            a.calibrate["random_data"] = True
    return artifacts


def _prequantized(source) -> bool:
    """Whether a source holds quantized weights (a GGUF file with quantized tensors, a Hugging Face checkpoint
    with a quantization_config): read from its metadata, no weight is loaded."""
    from kvforge.model_defs.checkpoint import prequantized

    return prequantized(source)


def tensorrt_unavailable() -> str | None:
    """Why no engine can be built here, and how to fix it (None when TensorRT and a CUDA GPU are present)."""

    missing = tensorrt_gpu_missing()
    return f"{missing}. {INSTALL}" if missing else None


@dataclass
class PipelineResult:
    workdir: Path
    outcomes: list[Outcome]
    engine_skipped: str | None
    sample: str | None
    seconds: float

    @property
    def passed(self) -> bool:
        return all(o.report.passed for o in self.outcomes if o.report is not None)


def pipeline(source=None, workdir: str | Path = "runs/tiny", *, precisions=DEFAULT_PRECISIONS, calibration_data=None,
             force: bool = False, random_data: bool = False, progress=None, log: Callable[[str], None] = print,
             sample_prompt: str | None = "def fibonacci(n):") -> PipelineResult:
    started = time.time()
    source = "tiny" if source is None else source
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise KvforgeError(f"precisions {list(bad or precisions)} must be a non-empty choice from {PRECISIONS}")
    # int8/fp8 read the source's tokenizer's text by default (tiny's corpus, or the built-in English prose);
    # a source without a tokenizer is refused by calibration with what to pass instead
    workdir = Path(workdir)
    artifacts = recipes(precisions, source, calibration_data, random_data)
    claim_workdir(workdir, force, [a.name for a in artifacts])
    engine_skipped = tensorrt_unavailable()
    if not engine_skipped:
        for a in artifacts:
            if a.dtype != "bfloat16" or a.precision:
                a.backends.append("tensorrt")
    paths = produce(source, artifacts, workdir, calibration_data, progress, log)
    compare_options = {"random_data": True} if random_data else {}
    outcomes = compare_all(artifacts, paths, workdir, None, compare_options, progress, log)

    sample = None
    runs = [o for o in outcomes if o.report is not None and o.backend == "onnxruntime"]
    if sample_prompt and runs:  # a taste of the most compressed artifact (int8 when there is one)

        quantized = [o for o in runs if o.report["precision"] in ("int8", "fp8", "int4", "checkpoint")]
        chosen = next((o for o in quantized if o.report["precision"] == "int8"), None) or (quantized or runs)[-1]
        with runtime.load(chosen.bundle) as session:
            if isinstance(session, runtime.EncoderSession):  # an encoder does not generate: its view of the prompt
                if session.config.get("head") == "classification":
                    c = session.classify(sample_prompt)[0]
                    sample = f"{chosen.artifact}: {sample_prompt!r} -> class {c['label']} ({c['score']:.3f})"
                elif session.tokenizer is not None:
                    v = session.embed(sample_prompt)[0]
                    sample = f"{chosen.artifact}: {sample_prompt!r} -> a {v.shape[0]}-dim embedding, [{', '.join(f'{x:.3f}' for x in v[:4])}, ...]"
            elif session.tokenizer is not None:
                sample = f"{chosen.artifact}: " + repr(sample_prompt + session.generate(sample_prompt, max_new_tokens=32).text)
    result = PipelineResult(workdir, outcomes, engine_skipped, sample, round(time.time() - started, 1))
    write_pipeline_report(result, source)
    return result


PIPELINE_RECORD = "kvforge-pipeline.json"


def claim_workdir(workdir: Path, force: bool, artifacts: list[str]) -> None:
    """Make `workdir` the pipeline's: new or empty, or (with force) one that holds only what a pipeline wrote.

    The record (PIPELINE_RECORD) lists the top-level entries a pipeline writes there, and is written before
    the first of them, so a run that is stopped midway is still replaceable; a listed directory is replaced
    only if it is a bundle kvforge can prove it wrote (kvforge.bundle.owned_entries). Anything else in the
    directory is named and nothing is touched.
    """
    if workdir.exists() and not workdir.is_dir():
        raise KvforgeError(f"{workdir} exists and is not a directory")
    entries = sorted(p.name for p in workdir.iterdir()) if workdir.is_dir() else []
    listed: list[str] = []
    if entries:
        if not force:
            raise KvforgeError(f"{workdir} exists and is not empty; pass --force to replace the artifacts in it")
        try:
            listed = json.loads((workdir / PIPELINE_RECORD).read_text(encoding="utf-8"))["entries"]
            check(listed, ListOf(RelPath()), "entries")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KvforgeError(f"{workdir} is not a directory `kvforge pipeline` wrote (its {PIPELINE_RECORD} is missing "
                               f"or unreadable: {type(e).__name__}); --force replaces only a pipeline's own artifacts: "
                               "remove it yourself or choose another directory") from e
        leftovers = tuple(f".{name}." for name in listed)  # a killed writer's staging directories
        stray = [n for n in entries if n not in listed and n != PIPELINE_RECORD and not n.startswith(leftovers)]
        if stray:
            raise KvforgeError(f"{workdir} holds entries no pipeline wrote ({', '.join(stray[:5])}); --force replaces "
                               "only a pipeline's own artifacts: remove them yourself or choose another directory")
        for name in listed:
            if (workdir / name).is_dir() and any((workdir / name).iterdir()):
                owned_entries(workdir / name, MANIFEST)
    planned = [*artifacts, *(f"{a}-engine" for a in artifacts), *(f"{a}-layers.png" for a in artifacts),
               "report.json", "drift.png"]
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / PIPELINE_RECORD).write_text(json.dumps({"entries": sorted(set(listed) | set(planned)),
                                                           "written": now_utc()}, indent=2) + "\n")
    except OSError as e:
        raise KvforgeError(f"cannot write to {workdir}: {e.strerror or e}") from e


def write_pipeline_report(result: PipelineResult, source) -> list[Path]:
    w = result.workdir
    report: dict[str, Any] = {
        "source": str(source), "tool": f"kvforge {kvforge.__version__}", "written": now_utc(),
        "passed": result.passed, "seconds": result.seconds, "tensorrt_skipped": result.engine_skipped,
        "sample": result.sample,
        "results": {o.key: {"bundle": o.bundle, **(o.report.result if o.report else {"skipped": o.skipped})} for o in result.outcomes},
    }
    written = [w / "report.json"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    curves = drift_curves(result.outcomes)
    if curves:
        written.append(drift_png(curves, w / "drift.png"))
    for o in result.outcomes:
        if o.report is not None and o.report.result.get("per_layer"):
            written.append(layers_png(o.report["per_layer"], w / f"{o.artifact}-layers.png", o.key))
    return written


def bundle_megabytes(path: str | None) -> float | None:
    if path is None:
        return None

    files = Bundle(path).manifest.get("files", {})
    return sum(f["bytes"] for f in files.values()) / 1e6
