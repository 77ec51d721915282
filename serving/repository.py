"""`kvforge triton BUNDLE -o REPO`: a Triton Inference Server model repository that serves a bundle.

    REPO/
      kvforge-triton.json          what wrote it (and what `--force` may replace)
      NAME/config.pbtxt            Python backend, decoupled, the generate extension's inputs/outputs (an
                                   encoder's: text_input -> embedding)
      NAME/1/model.py              imports kvforge.serving.triton_model (kvforge installed where Triton runs)
      NAME/1/bundle/               the bundle, verified, unchanged (hard links where the filesystem allows)

Triton runs it unchanged: `tritonserver --model-repository REPO`, in NVIDIA's
container (with kvforge pip-installed into it) or from the nvidia-pytriton
wheel (`kvforge serve`). The batcher's size and cache-token budget and the
runtime backend are the model's parameters in config.pbtxt (every
kvforge.runtime.BatchOptions field: the batch's rows and cache-token budget,
the prefix cache's budget and block, the prefill's per-step token budget).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

from kvforge.bundle import Bundle, now_utc
from kvforge.errors import KvforgeError
from kvforge.outputs import staged_bundle
from kvforge.runtime import BatchOptions

from .kinds import SERVED
from .requests import INPUTS, OUTPUTS

RECORD = "kvforge-triton.json"
MODEL_PY = '''"""Triton Python-backend entry point written by `kvforge triton`; the model is kvforge's."""

from kvforge.serving.triton_model import TritonPythonModel  # noqa: F401
'''
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def default_model_name(bundle: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(bundle).resolve().name).strip("-.") or "model"
    return name[:128]


def config_pbtxt(name: str, instances: int, batching: BatchOptions, backend: str,
                 io: tuple[dict, dict] = (INPUTS, OUTPUTS), openai: tuple[str, int] | None = None) -> str:
    def tensors(specs: dict, optional: bool) -> str:
        rows = [f'  {{ name: "{n}" data_type: {t} dims: [ {", ".join(map(str, d))} ]'
                f'{" optional: true" if optional and n != "text_input" else ""} }}' for n, (t, d) in specs.items()]
        return ",\n".join(rows)

    params = {**batching.params(), "backend": backend}
    if openai is not None:  # the OpenAI front (serving/openai_app.py) in the model's process; the key: KVFORGE_API_KEY
        params["openai_host"], params["openai_port"] = openai[0], str(openai[1])
    parameters = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    inputs, outputs = io
    # max_batch_size 0: Triton does not batch requests itself; kvforge's continuous batcher does, inside one instance
    return f'''name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
{tensors(inputs, True)}
]
output [
{tensors(outputs, False)}
]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
{parameters}
'''


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KvforgeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def write_repository(bundle: str | os.PathLike, out: str | os.PathLike, *, model_name: str | None = None,
                     instances: int = 1, batching: BatchOptions | None = None,
                     backend: str = "auto", force: bool = False, openai_port: int | None = None,
                     openai_host: str = "127.0.0.1") -> Path:
    """Write the repository (all or nothing: a failure leaves `out` as it was); returns its path.
    batching: the continuous batcher's settings (default BatchOptions()); openai_port: the model's process also
    serves the OpenAI API there (several instances share the port)."""
    if not Bundle.is_bundle(bundle):
        raise KvforgeError(f"{bundle} is not a kvforge bundle (no kvforge.json); export one first (`kvforge export`)")
    source = Bundle(bundle)
    source.verify(full=True)  # a damaged bundle is refused here, not when the server loads it
    name = model_name or default_model_name(source.path)
    if not _NAME.match(name):
        raise KvforgeError(f"model name {name!r}: use letters, digits, '_', '.' or '-' (Triton's model directory name)")
    _check_count("instances", instances)
    batching = BatchOptions() if batching is None else batching
    if not isinstance(batching, BatchOptions):
        raise KvforgeError(f"batching must be a kvforge.runtime.BatchOptions, got {type(batching).__name__}")
    if backend not in ("auto", "onnxruntime", "tensorrt", "torch"):
        raise KvforgeError(f"backend {backend!r} is not one of auto, onnxruntime, tensorrt, torch")
    if openai_port is not None and (isinstance(openai_port, bool) or not isinstance(openai_port, int)
                                    or not 1 <= openai_port <= 65535):
        raise KvforgeError(f"openai_port must be a port number in 1..65535, got {openai_port!r}")
    openai = None if openai_port is None else (openai_host, openai_port)
    with staged_bundle(out, force, inputs=[bundle], marker=RECORD) as tmp:
        model = tmp / name
        (model / "1").mkdir(parents=True)
        _link_tree(source.path, model / "1" / "bundle")
        (model / "1" / "model.py").write_text(MODEL_PY)
        (model / "config.pbtxt").write_text(config_pbtxt(name, instances, batching, backend,
                                                             SERVED[source.kind.name].triton_io, openai))
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        (tmp / RECORD).write_text(json.dumps({
            "files": files,  # what --force may replace: every file written here (kvforge.bundle.owned_entries)
            "model_name": name, "bundle": str(source.path.resolve()), "graph_sha256": source.graph_sha256, "instances": instances,
            "batching": dataclasses.asdict(batching), "backend": backend, "openai_port": openai_port,
            "kind": source.kind.name, "written": now_utc()}, indent=2) + "\n")
    return Path(out)


def repository_model(repo: str | os.PathLike) -> str:
    """The name of the model in a repository kvforge wrote."""
    try:
        return json.loads((Path(repo) / RECORD).read_text())["model_name"]
    except (OSError, ValueError, KeyError) as e:
        raise KvforgeError(f"{repo} is not a model repository written by `kvforge triton` ({RECORD}: {e})") from e


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a directory, hard-linking files where the filesystem allows (a bundle's files are never modified in place)."""
    def link_or_copy(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy)
