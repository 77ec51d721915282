"""The encoder families, BERT and RoBERTa (EncoderConfig fields): their config mappers and weight tables."""

from __future__ import annotations

from typing import Any

from kvforge.errors import KvforgeError

from .hf_common import Table, activation, linear_weights, mlp_weights, norm_weights, refuse, special_ids


# --- encoders: BERT, RoBERTa (EncoderConfig fields) -------------------------------
# The head comes from config.json's architectures[0]: the class that saved the checkpoint, and so the tensors it
# holds. A config without `architectures` gets the pooler: AutoModel builds the base model, pooler included, from it.
_ENCODER_HEADS = {"Model": "pooler", "ForMaskedLM": "mlm", "ForSequenceClassification": "classification"}


def _encoder_head(hf: dict[str, Any], stem: str) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        return "pooler"
    for suffix, head in _ENCODER_HEADS.items():
        if archs[0] == stem + suffix:
            return head
    raise KvforgeError(f"{hf.get('model_type')} architecture {archs[0]!r} is not supported; kvforge imports "
                       f"{[stem + suffix for suffix in _ENCODER_HEADS]} (the base model with its pooler, a masked-LM "
                       "head, a sequence classifier)")


def _encoder_labels(hf: dict[str, Any]) -> dict[str, Any]:
    """num_labels and the class names, ordered by id; without id2label, transformers' two LABEL_0, LABEL_1."""
    id2label = hf.get("id2label")
    if not id2label:
        n = int(hf.get("num_labels") or 2)
        return {"num_labels": n, "labels": [f"LABEL_{i}" for i in range(n)]}
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError) as e:
        raise KvforgeError(f"{hf.get('model_type')} config.json id2label has a key that is not a class id: {e}") from e
    if sorted(names) != list(range(len(names))):
        raise KvforgeError(f"{hf.get('model_type')} config.json id2label ids {sorted(names)} are not 0..{len(names) - 1}")
    return {"num_labels": len(names), "labels": [names[i] for i in range(len(names))]}


def _bert_like(hf: dict[str, Any], family: str, stem: str, position: str, head_activation: str) -> dict[str, Any]:
    """The fields BERT and RoBERTa share: post-norm layers, learned positions and segment types, an embedding norm."""
    kind = hf.get("position_embedding_type") or "absolute"
    if kind != "absolute":  # transformers 5 dropped the relative kinds (it would silently compute absolute ones)
        raise KvforgeError(f"{family} position_embedding_type={kind!r} is not supported (only 'absolute'): the "
                           "relative kinds add learned distance terms to the attention scores")
    refuse(hf, "kvforge imports bidirectional encoders (a decoder BERT/RoBERTa is a causal LM with cross-attention)",
            "is_decoder", "add_cross_attention")
    head = _encoder_head(hf, stem)
    fields = dict(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], ffn_dim=hf.get("intermediate_size") or 3072,
        max_seq_len=hf.get("max_position_embeddings") or 512, position=position,
        type_vocab_size=int(hf.get("type_vocab_size", 2)), embed_norm=True,
        norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
        activation=activation(hf, "hidden_act", "gelu"), head=head, head_activation=head_activation,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), family=family, **special_ids(hf),
    )
    if head == "classification":
        fields.update(_encoder_labels(hf))
    return fields


def bert(hf):
    hf = {"pad_token_id": 0, **hf}  # the config class's default when the file lacks it
    # the masked-LM head's transform uses hidden_act too
    return _bert_like(hf, "bert", "Bert", "absolute", activation(hf, "hidden_act", "gelu"))


def roberta(hf):
    # RoBERTa counts positions after the pad token (transformers' create_position_ids_from_input_ids); its
    # masked-LM head always uses the exact GELU, whatever hidden_act says
    hf = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **hf}
    return _bert_like(hf, "roberta", "Roberta", "padded", "gelu")


# --- weight tables --------------------------------------------------------------
def _bert_body(model: str) -> Table:
    """{model}.embeddings and {model}.encoder.layer.{i}: BERT's names, which RoBERTa keeps."""
    layer = f"{model}.encoder.layer.{{i}}"
    table: Table = {
        "embed.tokens.weight": (f"{model}.embeddings.word_embeddings.weight", None),
        "embed.positions.weight": (f"{model}.embeddings.position_embeddings.weight", None),
        "embed.token_types.weight": (f"{model}.embeddings.token_type_embeddings.weight", None),
        **norm_weights("embed.norm", f"{model}.embeddings.LayerNorm"),
        **linear_weights("layers.{i}.attn.o_proj", f"{layer}.attention.output.dense"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.attention.output.LayerNorm"),  # post-norm: after the residual add
        **mlp_weights(layer, "intermediate.dense", "output.dense"),
        **norm_weights("layers.{i}.ffn_norm", f"{layer}.output.LayerNorm"),
    }
    for p, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
        table.update(linear_weights(f"layers.{{i}}.attn.{p}_proj", f"{layer}.attention.self.{theirs}"))
    return table


def _mlm_head(prefix: str, dense: str, norm: str) -> Table:
    """The masked-LM head; its decoder's bias is saved as `{prefix}.bias` (tied to `{prefix}.decoder.bias`, which
    untied checkpoints write too: Family.duplicates)."""
    return {
        **linear_weights("head.dense", f"{prefix}.{dense}"),
        **norm_weights("head.norm", f"{prefix}.{norm}"),
        "head.decoder.weight": (f"{prefix}.decoder.weight", None),  # only when tie_word_embeddings is false
        "head.decoder.bias": (f"{prefix}.bias", None),
    }


def bert_weights(hf, cfg) -> Table:
    table = _bert_body("bert")
    if cfg.head == "mlm":
        table.update(_mlm_head("cls.predictions", "transform.dense", "transform.LayerNorm"))
    else:  # the pooler, and the classifier over it
        table.update({**linear_weights("head.dense", "bert.pooler.dense"), **linear_weights("head.out", "classifier")})
    return table


def roberta_weights(hf, cfg) -> Table:
    table = _bert_body("roberta")
    if cfg.head == "mlm":
        table.update(_mlm_head("lm_head", "dense", "layer_norm"))
    elif cfg.head == "classification":  # RobertaClassificationHead: out_proj(tanh(dense(first token)))
        table.update({**linear_weights("head.dense", "classifier.dense"), **linear_weights("head.out", "classifier.out_proj")})
    else:
        table.update(linear_weights("head.dense", "roberta.pooler.dense"))
    return table
