"""kvforge.model_defs: Torch reference models, checkpoint import, tokenizers.

    from kvforge.model_defs import load
    model, tokenizer = load("tiny")          # preset, kvforge checkpoint or HF directory
    logits, present = model(input_ids)       # docs/design.md's KV-cache IO contract

Other shapes (model_defs/architectures.py): EncoderConfig (BERT, RoBERTa), PerceiverConfig (latent
blocks), Seq2SeqConfig (T5, BART); `load` builds whichever a preset or checkpoint describes.
"""

from kvforge.tokenizer import Tokenizer

from .checkpoint import DEFAULT_MODEL, LoadedModel, load, resolve_dtype, save_checkpoint, source_kind
from .config import PRESETS, ModelConfig
from .encoder import EncoderConfig
from .perceiver import PerceiverConfig
from .seq2seq import Seq2SeqConfig
from .hf import SUPPORTED_FAMILIES, config_from_hf
from .model import Block, Transformer, build_model, init_random_weights

__all__ = [
    "DEFAULT_MODEL",
    "EncoderConfig",
    "PRESETS",
    "SUPPORTED_FAMILIES",
    "Block",
    "LoadedModel",
    "ModelConfig",
    "PerceiverConfig",
    "Seq2SeqConfig",
    "Tokenizer",
    "Transformer",
    "build_model",
    "config_from_hf",
    "init_random_weights",
    "load",
    "resolve_dtype",
    "save_checkpoint",
    "source_kind",
]
