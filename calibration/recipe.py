"""A calibration recipe: every option of `calibrate()` in one value, checked once against the bundle.

Each kind's quantizer (calibration/kinds.py) reads the recipe it is given; the checks that depend on the kind ask
the Kind (a KV cache to quantize) or the quantizer (an accuracy budget to fit), never the kind's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvforge.bundle import Bundle
from kvforge.checks import is_number, positive_int_or_none
from kvforge.errors import KvforgeError
from kvforge.manifest import session_format

from .budget import parse_budget
from .experts import STARVED
from .gptq import DAMP
from .observers import METHODS
from .qdq import FORMATS

ACTIVATIONS = ("static", "per-token")
MIN_OPSET = {"int8": 13, "fp8": 19, "int4": 21}
# TensorRT documents INT4 block sizes 64 and 128 (ModelOpt defaults to 128); others are linted as warnings.
# Weight-only INT8 takes llama.cpp Q8_0's block of 32: its accuracy is the point of asking for it.
DEFAULT_BLOCK_SIZE = {"int4": 128, "int8": 32}


class Quantized(NamedTuple):
    """What a kind's quantizer returns: the graphs to write and the manifest's records."""
    models: dict[str, Any]  # file name -> quantized ModelProto
    quantization: dict[str, Any]  # precision.quantization
    calibration: dict[str, Any]  # the calibration entry: data, scales, budget, experts


@dataclass(frozen=True)
class Recipe:
    precision: str = "int8"
    method: str | None = None  # None: "max" in a fixed recipe, chosen per activation in an automatic one
    percentile: float | None = None  # None: 99.99
    data: str | Path | None = None
    samples: int = 128
    seq_len: int = 256
    smoothquant: float | None = None  # SmoothQuant's alpha (int8 and fp8)
    exclude: tuple[str, ...] = ()  # regular expressions over layer names kept in float
    block_size: int | None = None  # a weight-only format's block; DEFAULT_BLOCK_SIZE once checked
    random_data: bool = False
    batch_size: int = 8
    # the vocabulary projection quantized too (True) or kept float (False); None: chosen by measurement under the
    # automatic recipe (calibration/auto.py: quantized where the target still holds), float in a fixed one
    quantize_lm_head: bool | None = None
    kv_cache: str | None = None  # "fp8": the KV cache quantized too
    accuracy_budget: dict[str, float] | None = None
    budget_data: str | Path | None = None
    budget_tokens: int = 4096
    gptq: bool | None = None  # None: False in a fixed recipe, chosen in an automatic one
    min_expert_tokens: int = 16
    starved_experts: str = "all-tokens"
    # "auto" | "fixed"; None: the kind's default, auto where its quantizer measures a decoder's perplexity
    # (calibration/auto.py), fixed elsewhere; a tuning option never changes it (it is refused under auto)
    recipe: str | None = None
    # W8A8 activations: "static" (a calibrated per-tensor scale: TensorRT and ONNX Runtime) or "per-token" (each
    # row's scale computed at run time: ONNX Runtime only); None: chosen by measurement under the automatic recipe,
    # else the kind's quantizer's default (calibration/kinds.py)
    activations: str | None = None
    # INT8 weights in blocks with the activations left in float (as llama.cpp's Q8_0), instead of W8A8
    weights_only: bool = False
    # INT4 blocks asymmetric, a float minimum each (llama.cpp's Q4_1 / Q4_K form: qdq.minimum_blocks; ONNX Runtime)
    # or symmetric (TensorRT's form); None: asymmetric under the automatic recipe, symmetric in a fixed one
    zero_points: bool | None = None

    @property
    def auto(self) -> bool:
        return self.recipe == "auto"

    def tuning_options(self) -> list[str]:
        """The options that fix what an automatic recipe would choose."""
        given = dict(method=self.method, percentile=self.percentile, smoothquant=self.smoothquant,
                     block_size=self.block_size, gptq=self.gptq, accuracy_budget=self.accuracy_budget)
        return [name for name, value in given.items() if value is not None]

    @property
    def weight_only(self) -> bool:
        return self.precision == "int4" or bool(self.weights_only)

    @property
    def session_format(self) -> str:
        """How ONNX Runtime runs the result (kvforge.ort_session.QUANT_SESSION_CONFIG; Bundle.session_format)."""
        return session_format(self.precision, self.weight_only)

    @property
    def per_token(self) -> bool:
        return self.activations == "per-token"

    @property
    def needs_data(self) -> bool:
        """Weight-only INT4 rounded to nearest and per-token INT8 read no calibration data (unless GPTQ, SmoothQuant
        or an FP8 KV cache does); everything else observes activations (an automatic INT4 recipe measures its
        candidates on the calibration text)."""
        return not (self.weight_only or self.per_token) or bool(self.gptq) or self.auto or bool(self.kv_cache) \
            or (self.per_token and self.smoothquant is not None)

    @property
    def static_ranges(self) -> bool:
        """Whether activations are observed for ranges or smoothing factors: W8A8 with static scales, or per-token
        activations smoothed (SmoothQuant's factors are calibrated; the ranges are the run's)."""
        return not self.weight_only and (not self.per_token or self.smoothquant is not None)

    def _mode(self, bundle: Bundle, searchable: bool) -> str:
        """The recipe's mode as stated, or the kind's default when none is: auto where the quantizer can measure a
        decoder's perplexity (searchable) and there is text to measure on, fixed elsewhere. The tuning options never
        choose it: under auto they are refused, naming --recipe fixed."""
        tuning = self.tuning_options()
        if self.recipe not in (None, "auto", "fixed"):
            raise KvforgeError(f"--recipe {self.recipe!r} is not one of ('auto', 'fixed')")
        if not searchable:
            if self.recipe == "auto":
                raise KvforgeError(f"--recipe auto measures a decoder's perplexity; {bundle.path} is "
                                   f"{bundle.kind.article}: calibrate it with the fixed recipe's options")
            return "fixed"
        # INT4 rounded to nearest needs no data: without text to measure on, the default is the fixed recipe; so is
        # weight-only INT8's (blocks of 32 rounded to nearest: Q8_0's form, which nothing it would search beats)
        no_text = self.data is None and not self.random_data and bundle.tokenizer_file is None
        mode = self.recipe or ("fixed" if self.weight_only and (no_text or self.precision == "int8") else "auto")
        if mode == "auto" and tuning:
            options = ", ".join("--" + name.replace("_", "-") for name in tuning)
            stated = "--recipe auto chooses" if self.recipe else "the automatic recipe (the default) chooses"
            raise KvforgeError(f"{stated} what {options} would fix; add --recipe fixed to calibrate with "
                               f"{'it' if len(tuning) == 1 else 'them'}, or drop {'it' if len(tuning) == 1 else 'them'}")
        return mode

    def _activations(self, default: str, auto: bool) -> str | None:
        """The activations' quantization as stated; under the automatic recipe None when not stated (both forms
        measured, calibration/auto.py spaces_for); else the kind's default (INT8; FP8 static; weight-only formats
        none). A KvforgeError names what per-token activations cannot go with."""
        if self.activations not in (None, *ACTIVATIONS):
            raise KvforgeError(f"--activations {self.activations!r} is not one of {ACTIVATIONS}")
        if self.weight_only:
            if self.activations is not None:
                raise KvforgeError(f"--activations applies to W8A8; {self.precision}"
                                   f"{' with --weights-only' if self.weights_only else ''} is weight-only")
            return None
        if self.activations is None and auto:
            return None
        activations = self.activations or (default if self.precision == "int8" else "static")
        if activations == "per-token":
            fixed = [f"--{name}" for name, v in (("method", self.method), ("percentile", self.percentile)) if v is not None]
            if fixed:  # SmoothQuant's factors are static and apply (calibrated on the data, folded into the weights)
                raise KvforgeError(f"per-token activations are scaled at run time, so {', '.join(fixed)} (which "
                                   "choose a calibrated static range) cannot apply; drop them or add --activations static")
        return activations

    def checked(self, bundle: Bundle, fits_budget: bool, default_activations: str = "static") -> "Recipe":
        """The recipe with its defaults resolved, or a KvforgeError naming the first option that cannot apply to
        this bundle. fits_budget: the bundle's quantizer can fit an accuracy budget; default_activations: its
        INT8 activations when none are asked for (calibration/kinds.py)."""
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)  # one pattern, not its characters
        budget = parse_budget(self.accuracy_budget) if self.accuracy_budget else None
        if self.precision not in FORMATS:
            raise KvforgeError(f"precision {self.precision!r} is not one of {FORMATS}")
        if self.weights_only and self.precision != "int8":
            raise KvforgeError(f"--weights-only applies to int8 (int4 is always weight-only; fp8 quantizes "
                               f"activations too), not {self.precision}")
        mode = self._mode(bundle, fits_budget)
        activations = self._activations(default_activations, mode == "auto")
        method = self.method if self.method is not None else "max"
        percentile = 99.99 if self.percentile is None else self.percentile
        head = self.quantize_lm_head if mode == "auto" and self.quantize_lm_head is None else bool(self.quantize_lm_head)
        self = dataclasses.replace(self, recipe=mode, method=method, percentile=percentile, gptq=bool(self.gptq),
                                   activations=activations, quantize_lm_head=head)
        if self.method not in METHODS:
            raise KvforgeError(f"method {self.method!r} is not one of {METHODS}")
        if bundle.quantization:
            hint = (" (its checkpoint's own codes): export the checkpoint with --dequantize for a float bundle to "
                    "calibrate") if bundle.quantization_format == "checkpoint" else "; calibrate a float bundle"
            raise KvforgeError(f"{bundle.path} is already quantized ({bundle.quantization_format}){hint}")
        if bundle.dtype == "bfloat16":
            raise KvforgeError("calibration runs the graph on ONNX Runtime's CPU provider, which has no bfloat16 kernels; "
                               "calibrate a float32 or float16 bundle")
        if self.smoothquant is not None and (self.weight_only or not 0.0 <= self.smoothquant <= 1.0):
            raise KvforgeError(f"--smoothquant takes an alpha in [0, 1] and applies to W8A8 int8 and fp8, not to "
                               f"weight-only formats (got {self.smoothquant} for {self.precision}"
                               f"{' --weights-only' if self.weights_only else ''})")
        if self.kv_cache not in (None, "fp8"):
            raise KvforgeError(f"--kv-cache {self.kv_cache!r} is not supported; the choice is fp8")
        if self.kv_cache and not bundle.kind.kv_cache:
            raise KvforgeError(f"--kv-cache: {bundle.path} is {bundle.kind.article}, which has no KV cache")
        if budget and not fits_budget:
            raise KvforgeError("--accuracy-budget measures a decoder's perplexity; for an encoder, calibrate and then "
                               "measure with `kvforge compare` (embedding cosine, top-1 agreement)")
        if self.kv_cache and self.weight_only:
            raise KvforgeError("--kv-cache fp8 is calibrated with the activations: use it with W8A8 int8 or fp8, not "
                               "a weight-only format")
        if self.kv_cache and bundle.manifest.get("opset", 0) < 19:
            raise KvforgeError("an FP8 KV cache needs opset >= 19; re-export with --opset 21")
        if self.zero_points is not None and self.precision != "int4":
            raise KvforgeError(f"--{'' if self.zero_points else 'no-'}zero-points applies to int4's blocks, not to "
                               f"{self.precision}{' --weights-only' if self.weights_only else ''}")
        if self.block_size is not None and not self.weight_only:
            raise KvforgeError(f"--block-size applies to the weight-only formats' block-wise weights (int4, int8 "
                               f"--weights-only); {self.precision} W8A8 weights are per channel")
        block_size = (DEFAULT_BLOCK_SIZE[self.precision] if self.block_size is None else self.block_size) \
            if self.weight_only else None
        for name, value in dict(samples=self.samples, seq_len=self.seq_len, batch_size=self.batch_size,
                                block_size=block_size, budget_tokens=self.budget_tokens).items():
            if not positive_int_or_none(value):
                raise KvforgeError(f"{name} must be a positive integer, got {value!r}")
        if self.method == "percentile" and not self.weight_only and not (
                is_number(self.percentile) and 0.0 < self.percentile <= 100.0):
            raise KvforgeError(f"--percentile must be a number in (0, 100], got {self.percentile!r}")
        if self.starved_experts not in STARVED:
            raise KvforgeError(f"--starved-experts {self.starved_experts!r} is not one of {STARVED}")
        if not isinstance(self.min_expert_tokens, int) or isinstance(self.min_expert_tokens, bool) or self.min_expert_tokens < 0:
            raise KvforgeError(f"--min-expert-tokens must be an integer >= 0, got {self.min_expert_tokens!r}")
        if self.data is not None and self.random_data:
            raise KvforgeError("--data and --random-data name two different calibration sets; pass one of them")
        if bundle.manifest.get("opset", 0) < MIN_OPSET[self.precision]:
            raise KvforgeError(f"{self.precision} Q/DQ needs opset >= {MIN_OPSET[self.precision]}; "
                               f"re-export with --opset {max(21, MIN_OPSET[self.precision])}")
        # INT4 blocks: with minimums under the automatic recipe (the form kvforge runs on ONNX Runtime, as
        # per-token W8A8 is its form of activations), symmetric in a fixed one; --no-zero-points / --zero-points
        # say which
        zero_points = (self.auto if self.zero_points is None else bool(self.zero_points)) \
            if self.precision == "int4" else False
        return dataclasses.replace(self, exclude=exclude, accuracy_budget=budget, block_size=block_size,
                                   zero_points=zero_points)

    def quantization_record(self, layers: list[str], excluded: list[str]) -> dict[str, Any]:
        """The manifest's precision.quantization entry for the layers quantized and those kept in float."""
        return {
            "format": self.precision,
            "recipe": self.recipe,
            "weights": ("block-wise with minimums" if self.zero_points else "block-wise") if self.weight_only
            else "per-channel",
            "weight_only": self.weight_only,
            "zero_points": bool(self.zero_points),
            "weight_rounding": "gptq" if self.gptq else "nearest",
            "gptq_damp": DAMP if self.gptq else None,
            "activations": None if self.weight_only else {"static": "per-tensor static",
                                                          "per-token": "per-token dynamic"}[self.activations],
            # an automatic recipe clips and smooths each activation on its own (calibration.recipe.chosen)
            "method": None if self.weight_only or self.per_token else (
                "per-activation search" if self.auto else self.method),
            "percentile": self.percentile if self.method == "percentile" and not (self.weight_only or self.per_token) else None,
            "smoothquant_alpha": self.smoothquant,
            "block_size": self.block_size,
            "kv_cache": self.kv_cache,
            "quantized_layers": layers,
            "excluded_layers": excluded,
        }

    def lineage_options(self, data_read: bool) -> dict[str, Any]:
        """The options as the lineage records them (random data only where data was read at all)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name not in ("data", "batch_size", "budget_data", "budget_tokens")}
        options.update(exclude=list(self.exclude), random_data=bool(self.random_data and data_read))
        return options
