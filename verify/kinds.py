"""What verification asks of each model kind: how a bundle of that kind is compared with its reference
(kvforge/kinds.py). `COMPARERS[kind.name]` runs the comparison; `options` are the compare() options it takes.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from kvforge.kinds import DEFAULT_KIND, check_registry

from . import compare_decoder, compare_encoder, compare_seq2seq, compare_vision
from .report import Report


class Comparer(NamedTuple):
    run: Callable[..., Report]  # (candidate, reference, data, backend, *, progress, **options, **backend_options)
    options: tuple[str, ...]
    data_line: Callable[[dict[str, Any]], str]  # what a report measured on, for people (verify/render.py)


_ENCODER = Comparer(compare_encoder.compare_encoder, ("max_tokens", "seq_len", "batch_size", "tolerances", "random_data",
                                                     "seed"), compare_encoder.data_line)

COMPARERS: dict[str, Comparer] = {
    "decoder": Comparer(compare_decoder.compare_decoder, ("steps", "prompts", "prompt_len", "max_tokens", "seq_len",
                                                          "batch_size", "tolerances", "per_layer", "random_data", "seed",
                                                          "reference_runs", "adapter"),
                        compare_decoder.data_line),
    "encoder": _ENCODER,
    "perceiver": _ENCODER,
    "encoder-decoder": Comparer(compare_seq2seq.compare_seq2seq, ("steps", "prompts", "max_tokens", "seq_len",
                                                                  "batch_size", "tolerances", "random_data", "seed"),
                                compare_seq2seq.data_line),
    "vision-language": Comparer(compare_vision.compare_vision_language, ("steps", "prompts", "max_tokens", "seq_len",
                                                                         "tolerances", "random_data", "seed"),
                                compare_vision.data_line),
}
check_registry("verify", COMPARERS)


def comparer_of(report: dict[str, Any]) -> Comparer:
    """The comparer that made a report (its `kind`; decoder reports, the first kind, do not say)."""
    return COMPARERS[report.get("kind", DEFAULT_KIND)]
