"""The Hugging Face families kvforge imports: per `model_type`, two explicit tables.

- a config mapper: config.json -> ModelConfig fields (EncoderConfig's for BERT
  and RoBERTa, Seq2SeqConfig's for T5 and BART), with transformers' own
  defaults for absent keys (they differ by family: Qwen3's head_dim is 128,
  Cohere's RoPE base 500000, GPT-NeoX rotates a quarter of each head ...) and a
  clear error for the options transformers itself cannot run or that kvforge
  does not compute;
- a weight table: kvforge parameter name -> (checkpoint tensor name, transform).

The families live by kind: hf_decoders.py (Llama-style and mixture-of-experts decoders), hf_gpt.py (GPT-2
and the LayerNorm + plain-MLP families), hf_encoders.py (BERT, RoBERTa) and hf_seq2seq.py (T5, BART), over
hf_common.py's transforms, config readers and weight-table pieces; this module holds the registry, FAMILIES.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .hf_common import Table
from .hf_vision import (LLAVA_RENAMES, QWEN2_VL_RENAMES, idefics2_config, idefics2_weights, idefics3_config,
                        idefics3_weights, llava_config, llava_leftovers, llava_weights, qwen2_vl_config, qwen2_vl_weights)
from .hf_decoders import (
    cohere,
    cohere_weights,
    deepseek_v2,
    deepseek_v3,
    deepseek_weights,
    gemma,
    gemma2,
    gemma2_weights,
    gemma3_text,
    gemma3_weights,
    gemma_weights,
    granite,
    llama,
    llama_weights,
    mistral,
    mixtral,
    mixtral_weights,
    olmo2,
    olmo2_weights,
    olmoe,
    olmoe_weights,
    phi3,
    phi3_weights,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    qwen3_weights,
    qwen_moe_weights,
)
from .hf_encoders import bert, bert_weights, roberta, roberta_weights
from .hf_gpt import (
    bloom,
    bloom_weights,
    falcon,
    falcon_weights,
    gpt2,
    gpt2_weights,
    gpt_neox,
    gpt_neox_weights,
    gptj,
    gptj_weights,
)
from .hf_seq2seq import bart, bart_weights, t5, t5_weights


# --- the families -----------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> the fields of `architecture`'s config
    weights: Callable[[dict[str, Any], Any], Table]  # (config.json, kvforge config) -> weight table
    # checkpoint names some files use instead of the table's: an optional prefix to add (files saved from the
    # base model, without the wrapper's), except to the names of the heads, which sit outside the base model
    # (`head_prefixes`); and whole-name aliases (older releases)
    add_prefix: str | None = None
    head_prefixes: tuple[str, ...] = ("lm_head.",)
    aliases: dict[str, str] = field(default_factory=dict)
    architecture: str = "decoder"  # which model the config builds (model_defs.architectures)
    embedding: str = "embed.weight"  # the kvforge parameter a tied head shares
    # pairs of checkpoint names for one tied tensor: either may stand for the other, and a file holding both is
    # accepted only when they are equal
    duplicates: tuple[tuple[str, str], ...] = ()
    # checkpoint name prefixes of parts the config's model does not have, which released files carry and
    # transformers skips when it loads them (bert-base-uncased, a BertForMaskedLM, still holds the pooler and
    # the next-sentence head of its pretraining): (kvforge config) -> prefixes left unread
    leftovers: Callable[[Any], tuple[str, ...]] = lambda cfg: ()
    # (old prefix, new prefix) pairs applied to checkpoint names first: the names transformers' module tree gives
    # a part, as the released files name it (a vision-language model's `model.language_model.`)
    renames: tuple[tuple[str, str], ...] = ()
    # heads the config's class has but released files may lack (sentence-transformers saves BERT without its
    # pooler): config head -> the checkpoint prefix of its tensors. Where no tensor has it, the model is built
    # without the head (transformers would give it random weights; nothing the checkpoint computes uses it)
    absent_heads: dict[str, str] = field(default_factory=dict)


def _static(table: Table) -> Callable[[dict[str, Any], Any], Table]:
    return lambda hf, cfg: table


FAMILIES: dict[str, Family] = {
    "llama": Family(llama, _static(llama_weights())),
    "mistral": Family(mistral, _static(llama_weights())),
    "qwen2": Family(qwen2, _static(llama_weights())),
    "qwen3": Family(qwen3, qwen3_weights),
    "olmo2": Family(olmo2, olmo2_weights),
    "granite": Family(granite, _static(llama_weights())),
    "cohere": Family(cohere, cohere_weights),
    "phi3": Family(phi3, phi3_weights),
    "gemma": Family(gemma, gemma_weights),
    "gemma2": Family(gemma2, gemma2_weights),
    "gemma3_text": Family(gemma3_text, gemma3_weights),
    "gpt2": Family(gpt2, gpt2_weights, add_prefix="transformer."),
    "gpt_neox": Family(gpt_neox, gpt_neox_weights, aliases={"embed_out.weight": "lm_head.weight"}),
    "gptj": Family(gptj, gptj_weights),
    "falcon": Family(falcon, falcon_weights),
    "bloom": Family(bloom, bloom_weights, add_prefix="transformer."),
    "mixtral": Family(mixtral, mixtral_weights),
    "qwen2_moe": Family(qwen2_moe, qwen_moe_weights(shared=True)),
    "qwen3_moe": Family(qwen3_moe, qwen_moe_weights(shared=False)),
    "olmoe": Family(olmoe, olmoe_weights),
    "deepseek_v2": Family(deepseek_v2, deepseek_weights),
    # released V3 files also hold the multi-token-prediction layer(s) after the last one, which transformers skips
    "deepseek_v3": Family(deepseek_v3, deepseek_weights, leftovers=lambda cfg: (f"model.layers.{cfg.n_layers}.",)),
    "bert": Family(bert, bert_weights, add_prefix="bert.", head_prefixes=("cls.", "classifier."),
                   architecture="encoder", embedding="embed.tokens.weight",
                   duplicates=(("cls.predictions.decoder.bias", "cls.predictions.bias"),),
                   leftovers=lambda cfg: ("bert.pooler.", "cls.seq_relationship.") if cfg.head == "mlm" else (),
                   absent_heads={"pooler": "bert.pooler."}),
    "roberta": Family(roberta, roberta_weights, add_prefix="roberta.", head_prefixes=("lm_head.", "classifier."),
                      architecture="encoder", embedding="embed.tokens.weight",
                      duplicates=(("lm_head.decoder.bias", "lm_head.bias"),),
                      leftovers=lambda cfg: ("roberta.pooler.",) if cfg.head == "mlm" else (),
                      absent_heads={"pooler": "roberta.pooler."}),
    # Both stacks read the shared embeddings, which files may also hold under each stack's name.
    "t5": Family(t5, t5_weights, architecture="encoder-decoder", embedding="shared.weight",
                 duplicates=(("encoder.embed_tokens.weight", "shared.weight"), ("decoder.embed_tokens.weight", "shared.weight")),
                 # older T5 files hold a position table for block 0's cross-attention, which transformers skips
                 leftovers=lambda cfg: ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.",)),
    "bart": Family(bart, bart_weights, architecture="encoder-decoder", embedding="shared.weight",
                   duplicates=(("model.encoder.embed_tokens.weight", "model.shared.weight"),
                               ("model.decoder.embed_tokens.weight", "model.shared.weight"))),
}
# vision-language models: their decoder read through the decoder families above (model_defs/hf_vision.py)
FAMILIES["llava"] = Family(llava_config(FAMILIES), llava_weights(FAMILIES), architecture="vision-language",
                           embedding="decoder.embed.weight", head_prefixes=(), leftovers=llava_leftovers,
                           renames=LLAVA_RENAMES)
FAMILIES["idefics2"] = Family(idefics2_config(FAMILIES), idefics2_weights(FAMILIES), architecture="vision-language",
                              embedding="decoder.embed.weight", head_prefixes=())
FAMILIES["idefics3"] = Family(idefics3_config(FAMILIES), idefics3_weights(FAMILIES), architecture="vision-language",
                              embedding="decoder.embed.weight", head_prefixes=())
FAMILIES["qwen2_vl"] = Family(qwen2_vl_config(FAMILIES), qwen2_vl_weights(FAMILIES), architecture="vision-language",
                              embedding="decoder.embed.weight", head_prefixes=(), renames=QWEN2_VL_RENAMES)
# families kvforge knows and does not build yet, each with what it would need (the importer says it by name)
NOT_BUILT = {
    "qwen2_5_vl": "Qwen2.5-VL's vision tower attends within windows of patches (full attention only in "
                  "fullatt_block_indexes), with RMSNorm and gated MLP blocks, and its multimodal RoPE spaces video "
                  "frames by time; kvforge builds Qwen2-VL's tower (full attention per image), not these",
}
