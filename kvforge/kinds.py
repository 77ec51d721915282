"""The model kinds kvforge handles, and what each one can do: the one place a kind is described.

A kind is what a bundle's `model.architecture` names (absent in decoder manifests, which predate the field).
Stages never compare that name: they ask the Kind for a capability (`kind.kv_cache`, `kind.generates`, ...)
and look up their own per-kind component in their registry, keyed by `kind.name`:

    model_defs/architectures.py   ARCHITECTURES   config class, Torch builder, presets, design line
    export/kinds.py               EXPORTS         graphs, IO spec, validation
    calibration/kinds.py          QUANTIZERS      which graphs are quantized and how their feeds are made
    runtime/kinds.py              SESSIONS        the session class
    verify/kinds.py               COMPARERS       comparison against the reference, and its metrics
    serving/kinds.py              SERVED          what the server offers (generation or embeddings)

A new kind is a Kind here plus one component in each registry (tests/test_kinds.py checks that every
registry covers every kind). docs/design.md, "Model kinds".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import KvforgeError

DEFAULT_KIND = "decoder"


@dataclass(frozen=True)
class Kind:
    name: str  # the manifest's model.architecture
    article: str  # how messages name it, article included
    graph_roles: tuple[str, ...]  # the bundle's graphs by role; ("model",) is one graph named model.onnx
    kv_cache: bool  # decoder IO: past/present caches, generation through runtime.Session, KV-cache quantization
    generates: bool  # produces tokens (generate/stream)
    length_field: str  # the config field bounding an input's length
    ecosystem: bool  # describable to ONNX Runtime GenAI and Optimum (genai_config.json, a Llama config)
    cls_pooling: bool = False  # its first position is a [CLS] token that pooling may take
    tied_head: str | None = None  # its LM head, tied to the embeddings when tie_embeddings is set (else the mlm head)
    order: int = 0  # where `kvforge models` lists it
    text_config: str | None = None  # the config entry of its text model (vocabulary, context), where it is nested

    @property
    def multi_graph(self) -> bool:
        return len(self.graph_roles) > 1

    def __str__(self) -> str:
        return self.name


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("decoder", "a decoder LM", ("model",), kv_cache=True, generates=True, length_field="max_seq_len",
         ecosystem=True, tied_head="lm_head.weight", order=0),
    Kind("encoder", "an encoder", ("model",), kv_cache=False, generates=False, length_field="max_input_len",
         ecosystem=False, cls_pooling=True, order=1),
    Kind("perceiver", "a Perceiver encoder", ("model",), kv_cache=False, generates=False,
         length_field="max_input_len", ecosystem=False, order=2),
    Kind("encoder-decoder", "an encoder-decoder", ("encoder", "decoder"), kv_cache=False, generates=True,
         length_field="max_input_len", ecosystem=False, tied_head="lm_head.weight", order=3),
    # an image encoder and projector (vision.onnx) beside a decoder that reads the images' features (decoder.onnx)
    Kind("vision-language", "a vision-language model", ("vision", "decoder"), kv_cache=False, generates=True,
         length_field="max_seq_len", ecosystem=False, tied_head="decoder.lm_head.weight", order=4,
         text_config="decoder"),
)}


def kind_of(config: Any) -> Kind:
    """The Kind of a config object, a config dict or a manifest's model entry (a decoder when it does not say)."""
    name = config.get("architecture") if isinstance(config, dict) else getattr(config, "architecture", None)
    return get_kind(DEFAULT_KIND if name is None else name)


def get_kind(name: str) -> Kind:
    kind = KINDS.get(name)
    if kind is None:
        raise KvforgeError(f"unknown model architecture {name!r}; kvforge handles {list(KINDS)}")
    return kind


def kind_name(name: str) -> str:
    """How messages name an architecture, article included ("an encoder-decoder", "a Perceiver encoder")."""
    kind = KINDS.get(name)
    return kind.article if kind else f"a {name!r} model"


def check_registry(stage: str, registry: dict[str, Any]) -> None:
    """A stage's registry must cover every kind: a kind added here without its component is named at import."""
    missing = [name for name in KINDS if name not in registry]
    unknown = [name for name in registry if name not in KINDS]
    if missing or unknown:
        raise RuntimeError(f"{stage}'s kind registry is out of step with kvforge.kinds: missing {missing}, unknown {unknown}")
