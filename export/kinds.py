"""What export asks of each model kind: its graphs, their IO spec and their validation (kvforge/kinds.py).

`EXPORTS[kind.name]` is the kind's `KindExport`; export/api.py reads the same for every kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

from kvforge.bundle import IOSpec
from kvforge.kinds import check_registry

from .encoder_export import export_encoder_onnx, validate_encoder
from .encoder_export import io_spec as encoder_io_spec
from .onnx_export import export_onnx
from .onnx_export import io_spec as decoder_io_spec
from .onnx_export import with_lora_inputs
from .seq2seq_export import DECODER_GRAPH, ENCODER_GRAPH, export_seq2seq_onnx, validate_seq2seq
from .seq2seq_export import io_spec as seq2seq_io_spec
from .validate import validate as validate_decoder
from .vision_export import DECODER_GRAPH as VL_DECODER, VISION_GRAPH, export_vision_language_onnx, validate_vision_language
from .vision_export import io_spec as vision_language_io_spec
from .validate_inputs import text_tokens

GRAPH_FILE = "model.onnx"


class Graphs(NamedTuple):
    files: dict[str, str]  # role -> file name
    main: str  # the graph the manifest's `graph` entry names (the one that generates, for two graphs)
    weight_sharing: dict[str, Any] | None  # two graphs' shared-weights record (export/seq2seq_export.share_weights)


class KindExport(NamedTuple):
    # (model, bundle directory, opset, external_data) -> the graphs written
    write: Callable[[Any, Path, int, bool | None], Graphs]
    # (bundle directory, FP32 reference, dtype, max context, progress, tokenizer) -> the validation record
    # (a decoder's inputs are real text where the checkpoint has its own tokenizer; other kinds draw theirs)
    validate: Callable[..., dict[str, Any]]
    # (config, torch dtype, max context) -> the IO contract
    io_spec: Callable[[Any, Any, int], IOSpec]
    # (io, model with slots, max rank, targets) -> io with the LoRA inputs; None: the kind takes no LoRA slots
    lora_io: Callable[[IOSpec, Any, int, list[str]], IOSpec] | None = None
    # whether write and validate take a model whose weights are read where they are used (model_defs/weights.py:
    # a traced copy with lazy weights, a streamed reference) instead of one held whole
    streams: bool = False


def _one_graph(export_fn) -> Callable[[Any, Path, int, bool | None], Graphs]:
    def write(model, directory: Path, opset: int, external_data: bool | None) -> Graphs:
        export_fn(model, directory / GRAPH_FILE, opset, external_data)
        return Graphs({"model": GRAPH_FILE}, GRAPH_FILE, None)

    return write


def _one_graph_validation(validate_fn) -> Callable[..., dict[str, Any]]:
    def run(directory: Path, reference, dtype: str, max_context: int, progress=None, tokenizer=None) -> dict[str, Any]:
        return validate_fn(directory / GRAPH_FILE, reference, dtype, max_context, progress=progress)

    return run


def _validate_decoder(directory: Path, reference, dtype: str, max_context: int, progress=None,
                      tokenizer=None) -> dict[str, Any]:
    """A decoder's inputs and past caches come from real text where the checkpoint has its own tokenizer."""
    tokens, text = text_tokens(tokenizer)
    return validate_decoder(directory / GRAPH_FILE, reference, dtype, max_context, progress=progress, tokens=tokens,
                            text=text)


def _write_seq2seq(model, directory: Path, opset: int, external_data: bool | None) -> Graphs:
    sharing = export_seq2seq_onnx(model, directory, opset)  # the two graphs always share one weights file
    return Graphs({"encoder": ENCODER_GRAPH, "decoder": DECODER_GRAPH}, DECODER_GRAPH, sharing)


def _validate_seq2seq(directory: Path, reference, dtype: str, max_context: int, progress=None,
                      tokenizer=None) -> dict[str, Any]:
    return validate_seq2seq(directory, reference, dtype, max_context, progress=progress)


def _write_vision_language(model, directory: Path, opset: int, external_data: bool | None) -> Graphs:
    export_vision_language_onnx(model, directory, opset, external_data)
    return Graphs({"vision": VISION_GRAPH, "decoder": VL_DECODER}, VL_DECODER, None)


def _validate_vision_language(directory: Path, reference, dtype: str, max_context: int, progress=None,
                              tokenizer=None) -> dict[str, Any]:
    return validate_vision_language(directory, reference, dtype, max_context, progress=progress)


_ENCODER = KindExport(_one_graph(export_encoder_onnx), _one_graph_validation(validate_encoder),
                      lambda cfg, dtype, max_context: encoder_io_spec(cfg, max_context))  # token ids in, floats out

EXPORTS: dict[str, KindExport] = {
    "decoder": KindExport(_one_graph(export_onnx), _validate_decoder, decoder_io_spec, with_lora_inputs, streams=True),
    "encoder": _ENCODER,
    "perceiver": _ENCODER,
    "encoder-decoder": KindExport(_write_seq2seq, _validate_seq2seq, seq2seq_io_spec),
    "vision-language": KindExport(_write_vision_language, _validate_vision_language, vision_language_io_spec),
}
check_registry("export", EXPORTS)
