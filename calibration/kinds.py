"""What calibration asks of each model kind: its quantizer (kvforge/kinds.py lists the kinds).

`QUANTIZERS[kind.name]` quantizes a bundle of that kind by a checked Recipe and returns its graphs and records;
calibration/api.py does the same for every kind (check, quantize, write).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from kvforge.kinds import check_registry

from .one_graph import quantize_one_graph
from .recipe import Quantized
from .seq2seq import quantize_seq2seq
from .vision import quantize_vision_language


class KindQuantizer(NamedTuple):
    # (bundle, checked recipe, the budget's held-out ids or None, progress) -> the quantized graphs and records
    quantize: Callable[..., Quantized]
    # --accuracy-budget applies: it fits a decoder LM's held-out perplexity (calibration/budget.py)
    fits_budget: bool
    # INT8 activations when none are asked for (Recipe.activations): "static" (TensorRT and ONNX Runtime) or
    # "per-token" (ONNX Runtime). An encoder's embeddings take per-token: on all-MiniLM-L6-v2 a static per-tensor
    # range costs 0.021 of mean cosine and 0.052 at worst over per-token (benchmarks/peers/minilm_embeddings.py)
    activations: str = "static"


_ONE_GRAPH_ENCODER = KindQuantizer(quantize_one_graph, fits_budget=False, activations="per-token")


QUANTIZERS: dict[str, KindQuantizer] = {
    "decoder": KindQuantizer(quantize_one_graph, fits_budget=True),
    "encoder": _ONE_GRAPH_ENCODER,
    "perceiver": _ONE_GRAPH_ENCODER,
    "encoder-decoder": KindQuantizer(quantize_seq2seq, fits_budget=False),
    "vision-language": KindQuantizer(quantize_vision_language, fits_budget=False),
}
check_registry("calibration", QUANTIZERS)


def quantizer_of(kind: Any) -> KindQuantizer:
    return QUANTIZERS[kind.name]
