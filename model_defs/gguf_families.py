"""GGUF architectures kvforge reads: each one's metadata -> config.json keys and tensor names -> transformers'.

llama.cpp's converter (convert_hf_to_gguf.py) writes a model's hyperparameters as `<arch>.*` metadata and its
tensors under its own names, some rearranged. An `Arch` maps those back to what a Hugging Face checkpoint
directory holds, so the family's importer (model_defs/hf.py) does the rest; transformers' own GGUF loading
(modeling_gguf_pytorch_utils.py) is the oracle the tests compare against. The rearrangements undone here:

- Llama: each head's query and key rows interleaved into llama.cpp's rotary pairs (a row permutation);
- BLOOM and Falcon: the fused query_key_value rows regrouped as [all q | all k | all v] (a row permutation);
- GPT-2: its Conv1D weights stored transposed to [out, in] (`transposed`: the transform is a plain transpose);
- Gemma 1-3: norm weights stored as 1 + w, since ggml multiplies by the weight itself (norm vectors only);
- Qwen-MoE: the experts' weights stacked into one [experts, out, in] tensor per projection, and the shared
  expert's gate squeezed to a vector.

How a reader uses an Arch (model_defs/gguf.py):

1. hf_config = dict(arch.defaults, model_type=arch.model_type, architectures=list(arch.architectures)); each
   `arch.config` key read from the field `<arch name>.<key>`; tie_word_embeddings = `arch.tied_head` is not among
   the file's tensors; vocab_size and the bos/eos/pad ids from the tokenizer metadata; then, where set,
   `arch.finish_config(field, hf_config, shapes)`: `field(full key)` is a metadata value (None when absent),
   `shapes` the file's tensor names -> shapes in torch layout (dims reversed from the file's listing). It fills
   what no single field gives (Phi-3's rotary fraction, Falcon's layout, Gemma's query scale, RoPE scaling:
   linear and YaRN on every RoPE architecture) and raises KvforgeError for what kvforge cannot read (Llama
   3.1's rope_freqs, Phi-3's LongRoPE factors, other scaling types).
2. Each tensor, as a float torch tensor in that layout, through `hf_tensors(arch, hf_config, name, value)`:
   its name looked up in `arch.names(hf_config)` (patterns: {i} the layer, {j} an expert), then
   `arch.transforms[hf pattern](tensor, hf_config)` where present. An HF name with {j} takes a stacked tensor
   ([experts, out, in]) apart along its first dimension: expert j is rows j*out..(j+1)*out of the file's
   [experts * out, in] view, so quantized codes follow it as a row selection.

Every transform only selects or permutes rows of an [out, in] weight (or of a bias the same way), except
GPT-2's four Conv1D weights (a transpose, listed in `transposed`; kvforge's GPT-2 table transposes them back, so
file -> kvforge parameter is a row selection again) and the norm / gate vectors (Gemma's w - 1, Qwen-MoE's
shared-expert gate reshaped to [1, hidden]), which llama.cpp always stores in F32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError

Transform = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
Field = Callable[[str], Any]  # a metadata value by its full key, None when absent
Finish = Callable[[Field, dict[str, Any], dict[str, tuple[int, ...]]], None]


@dataclass(frozen=True)
class Arch:
    model_type: str  # transformers' model_type
    architectures: tuple[str, ...]
    config: dict[str, str]  # metadata key under the architecture's prefix -> config.json key
    tensors: dict[str, str]  # GGUF tensor name ({i}: the layer) -> transformers' name ({j}: stacked experts)
    defaults: dict[str, Any] = field(default_factory=dict)  # config.json entries the metadata does not carry
    # transformers' name ({i}, {j}) -> (tensor in GGUF's layout, hf_config) -> transformers' layout
    transforms: dict[str, Transform] = field(default_factory=dict)
    tied_head: str | None = "output.weight"  # the head's GGUF name: its absence means tied embeddings
    # what the config needs beyond one field per key: (field, hf_config, tensor shapes) -> None, filling hf_config
    finish_config: Finish | None = None
    # names that depend on the config (read after finish_config): hf_config -> overrides of `tensors`
    renames: Callable[[dict[str, Any]], dict[str, str]] | None = None
    # transformers' names whose transform is exactly a transpose of the file's [out, in] (GPT-2's Conv1D)
    transposed: tuple[str, ...] = ()

    def names(self, hf_config: dict[str, Any]) -> dict[str, str]:
        """GGUF name pattern -> transformers' for this file's config."""
        return {**self.tensors, **self.renames(hf_config)} if self.renames else self.tensors


def _pattern(name: str) -> tuple[str, str | None]:
    """(the name with its layer as {i}, the layer)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        return ".".join(["blk", "{i}", *parts[2:]]), parts[1]
    return name, None


def hf_tensors(arch: Arch, hf_config: dict[str, Any], name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One GGUF tensor (float, torch layout) -> transformers' tensors: one, or one per expert for a stacked one."""
    key, layer = _pattern(name)
    pattern = arch.names(hf_config).get(key)
    if pattern is None:
        raise KvforgeError(f"GGUF tensor {name!r} has no place in a {arch.model_type} model")
    transform = arch.transforms.get(pattern)
    parts = [(pattern.format(i=layer), value)] if "{j}" not in pattern else \
        [(pattern.format(i=layer, j=j), v) for j, v in enumerate(value.unbind(0))]
    return {hf_name: v if transform is None else transform(v, hf_config) for hf_name, v in parts}


# --- transforms ---------------------------------------------------------------------
def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's two rotary halves into pairs (rows)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _q_rows(w, hf):
    return unpermute(w, hf["num_attention_heads"])


def _k_rows(w, hf):
    return unpermute(w, hf.get("num_key_value_heads") or hf["num_attention_heads"])


def _minus_one(w, hf):
    """Gemma: llama.cpp stores a norm's 1 + w (ggml multiplies by the weight), transformers w."""
    return w - 1.0


def _row_vector(w, hf):
    """Qwen-MoE's shared-expert gate, a [1, hidden] linear that llama.cpp squeezes to [hidden]."""
    return w.reshape(1, -1)


def _transpose(w, hf):
    return w.t()


def _bloom_qkv(w, hf):
    """llama.cpp regroups BLOOM's per-head [heads, 3, head_dim] rows as [q | k | v]; back to per head."""
    heads = hf["n_head"]
    return w.reshape(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _falcon_qkv(w, hf):
    """llama.cpp regroups Falcon's [kv_heads, G + 2, head_dim] rows (each group's G query heads, its key, its
    value) as [q | k | v]; back to groups (the identity for Falcon-7B's single KV head)."""
    heads = hf["num_attention_heads"]
    kv = (hf.get("num_kv_heads") or heads) if hf.get("new_decoder_architecture") else 1
    d = w.shape[0] // (heads + 2 * kv)
    rest = w.shape[1:]
    q, k, v = w.split([heads * d, kv * d, kv * d])
    groups = [q.reshape(kv, heads // kv, d, *rest), k.reshape(kv, 1, d, *rest), v.reshape(kv, 1, d, *rest)]
    return torch.cat(groups, dim=1).reshape(w.shape)


# --- config steps -------------------------------------------------------------------
def _rope_scaling(arch: str) -> Finish:
    """RoPE scaling as llama.cpp writes it (rope.scaling.*) -> transformers' rope_scaling; Llama 3.1's factors
    (a rope_freqs tensor, the parameters that made them not kept) are refused."""

    def finish(field: Field, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
        if "rope_freqs.weight" in shapes:
            raise KvforgeError("GGUF RoPE frequency factors (rope_freqs.weight, as Llama 3.1 files hold) are not read: "
                               "the llama3 scaling parameters they were computed from are not in the file")
        kind = field(f"{arch}.rope.scaling.type")
        if kind in (None, "none"):
            return
        factor = field(f"{arch}.rope.scaling.factor")
        if kind == "linear" and factor is not None:
            hf["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        elif kind == "yarn" and factor is not None:
            params = {"rope_type": "yarn", "factor": float(factor)}
            for key, name in (("original_context_length", "original_max_position_embeddings"),
                              ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if field(f"{arch}.rope.scaling.{key}") is not None:
                    params[name] = field(f"{arch}.rope.scaling.{key}")
            hf["rope_scaling"] = params
        else:
            raise KvforgeError(f"GGUF RoPE scaling {kind!r} (factor {factor}) is not read; kvforge reads linear "
                               "and yarn")
    return finish


def _phi3(field: Field, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Phi-3 writes the rotary dims, transformers wants their fraction of the head; LongRoPE's factors are
    tensors in the file (rope_factors_long/short), which kvforge does not read as config."""
    if any(name.startswith("rope_factors") for name in shapes):
        raise KvforgeError("Phi-3 GGUF files with LongRoPE factors (rope_factors_long/short tensors: the 128k-context "
                           "models) are not read; export the Hugging Face checkpoint instead")
    rot = field("phi3.rope.dimension_count")
    if rot is not None:
        hf["partial_rotary_factor"] = int(rot) / (hf["hidden_size"] // hf["num_attention_heads"])
    _rope_scaling("phi3")(field, hf, shapes)


def _falcon(field: Field, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """The layout transformers' FalconConfig names: Falcon-7B (one KV head, one LayerNorm) or the new decoder
    architecture (grouped KV heads; Falcon-40B's second LayerNorm, attn_norm_2, feeds the attention)."""
    kv = hf.get("num_kv_heads") or 1
    two_norms = "blk.0.attn_norm_2.weight" in shapes
    hf["bias"] = "blk.0.attn_qkv.bias" in shapes
    if kv > 1 or two_norms:
        hf.update(new_decoder_architecture=True, num_ln_in_parallel_attn=2 if two_norms else 1)
    else:
        hf.update(new_decoder_architecture=False, multi_query=True, num_kv_heads=1)
    _rope_scaling("falcon")(field, hf, shapes)


def _falcon_names(hf: dict[str, Any]) -> dict[str, str]:
    if hf.get("num_ln_in_parallel_attn") != 2:
        return {}
    # Falcon-40B's two LayerNorms (gguf's TensorNameMap: ln_mlp -> attn_norm, ln_attn -> attn_norm_2)
    return {**_weight_and_bias("blk.{i}.attn_norm", f"{H}.ln_mlp"),
            **_weight_and_bias("blk.{i}.attn_norm_2", f"{H}.ln_attn")}


def _query_scale(hf: dict[str, Any], layers_27b: int) -> None:
    """Gemma 2/3 scale queries by query_pre_attn_scalar ** -0.5, which GGUF does not carry: llama.cpp takes the
    head size, or hidden / heads for the 27B models (told apart by their layer count), which is what every
    released config.json says (transformers' GGUF loader assumes 256: right but for the 27B ones)."""
    per_head = hf["hidden_size"] // hf["num_attention_heads"]
    hf["query_pre_attn_scalar"] = per_head if hf["num_hidden_layers"] == layers_27b else hf.get("head_dim") or per_head


def _gemma2(field: Field, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    _query_scale(hf, 46)
    _rope_scaling("gemma2")(field, hf, shapes)


def _gemma3(field: Field, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Gemma 3's windowed layers when the file says (an int period or one flag per layer; transformers' default
    period, 6, otherwise), its query scale, and its global layers' RoPE scaling (linear for the 4B-27B models)."""
    pattern = field("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        hf["layer_types"] = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    elif pattern is not None:
        hf["sliding_window_pattern"] = int(pattern)
    _query_scale(hf, 62)
    _rope_scaling("gemma3")(field, hf, shapes)


# --- the tables ---------------------------------------------------------------------
def _without(table: dict[str, str], *parts: str) -> dict[str, str]:
    """`table` less the entries whose key holds any of `parts`."""
    return {k: v for k, v in table.items() if not any(p in k for p in parts)}


def _weight_and_bias(gguf_name: str, hf_name: str) -> dict[str, str]:
    return {f"{gguf_name}.{p}": f"{hf_name}.{p}" for p in ("weight", "bias")}


LLAMA_CONFIG = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.dimension_count": "head_dim",  # what llama.cpp's Llama writes as the head size
    "attention.key_length": "head_dim",  # written when config.json has head_dim: it wins
}
_CONFIG = _without(LLAMA_CONFIG, "rope.dimension_count")  # the others' rotary dims say nothing of the head
_MOE_CONFIG = {**_CONFIG, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
               "expert_feed_forward_length": "moe_intermediate_size"}
_GEMMA_CONFIG = {**_CONFIG, "attention.sliding_window": "sliding_window",
                 **{k: k for k in ("attn_logit_softcapping", "final_logit_softcapping")}}

L = "model.layers.{i}"
LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": f"{L}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": f"{L}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.attn_{p}.weight": f"{L}.self_attn.{p}_proj.weight" for p in "qkv"},
    "blk.{i}.attn_output.weight": f"{L}.self_attn.o_proj.weight",
    **{f"blk.{{i}}.ffn_{p}.weight": f"{L}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_QKV_BIASES = {f"blk.{{i}}.attn_{p}.bias": f"{L}.self_attn.{p}_proj.bias" for p in "qkv"}
_QK_NORMS = {f"blk.{{i}}.attn_{p}_norm.weight": f"{L}.self_attn.{p}_norm.weight" for p in "qk"}
_ATTENTION = _without(LLAMA_TENSORS, ".ffn_gate.", ".ffn_up.", ".ffn_down.")
_EXPERTS = {  # {j}: the stacked tensor's first dimension
    "blk.{i}.ffn_gate_inp.weight": f"{L}.mlp.gate.weight",
    **{f"blk.{{i}}.ffn_{p}_exps.weight": f"{L}.mlp.experts.{{j}}.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_SHARED_EXPERT = {
    "blk.{i}.ffn_gate_inp_shexp.weight": f"{L}.mlp.shared_expert_gate.weight",
    **{f"blk.{{i}}.ffn_{p}_shexp.weight": f"{L}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_PHI3_TENSORS = {  # fused [q | k | v] and [gate | up] rows, as transformers' Phi-3 holds them
    **_without(LLAMA_TENSORS, ".attn_q.", ".attn_k.", ".attn_v.", ".ffn_gate."),
    "blk.{i}.attn_qkv.weight": f"{L}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": f"{L}.mlp.gate_up_proj.weight",
}
_GEMMA_TENSORS = {k: v for k, v in LLAMA_TENSORS.items() if k != "output.weight"}  # always tied
_GEMMA2_TENSORS = {
    **_GEMMA_TENSORS,
    "blk.{i}.post_attention_norm.weight": f"{L}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": f"{L}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": f"{L}.post_feedforward_layernorm.weight",
}
_GEMMA3_TENSORS = {**_GEMMA2_TENSORS, **_QK_NORMS, "output.weight": "lm_head.weight"}

H = "transformer.h.{i}"
_GPT2_TENSORS = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output.weight": "lm_head.weight",
    **_weight_and_bias("output_norm", "transformer.ln_f"),
    **_weight_and_bias("blk.{i}.attn_norm", f"{H}.ln_1"),
    **_weight_and_bias("blk.{i}.ffn_norm", f"{H}.ln_2"),
    **_weight_and_bias("blk.{i}.attn_qkv", f"{H}.attn.c_attn"),
    **_weight_and_bias("blk.{i}.attn_output", f"{H}.attn.c_proj"),
    **_weight_and_bias("blk.{i}.ffn_up", f"{H}.mlp.c_fc"),
    **_weight_and_bias("blk.{i}.ffn_down", f"{H}.mlp.c_proj"),
}
_GPT2_CONV1D = tuple(f"{H}.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
_FALCON_TENSORS = {
    "token_embd.weight": "transformer.word_embeddings.weight",
    "output.weight": "lm_head.weight",
    **_weight_and_bias("output_norm", "transformer.ln_f"),
    **_weight_and_bias("blk.{i}.attn_norm", f"{H}.input_layernorm"),  # ln_mlp where there are two (renames)
    **_weight_and_bias("blk.{i}.attn_qkv", f"{H}.self_attention.query_key_value"),
    **_weight_and_bias("blk.{i}.attn_output", f"{H}.self_attention.dense"),
    **_weight_and_bias("blk.{i}.ffn_up", f"{H}.mlp.dense_h_to_4h"),
    **_weight_and_bias("blk.{i}.ffn_down", f"{H}.mlp.dense_4h_to_h"),
}
_BLOOM_TENSORS = {
    **_without(_FALCON_TENSORS, "attn_norm"),
    **_weight_and_bias("token_embd_norm", "transformer.word_embeddings_layernorm"),
    **_weight_and_bias("blk.{i}.attn_norm", f"{H}.input_layernorm"),
    **_weight_and_bias("blk.{i}.ffn_norm", f"{H}.post_attention_layernorm"),
}
_FUSED_QKV = f"{H}.self_attention.query_key_value"


def _on_norms(tensors: dict[str, str], transform: Transform) -> dict[str, Transform]:
    return {hf: transform for name, hf in tensors.items() if name.endswith("norm.weight")}


ARCHS: dict[str, Arch] = {
    # Llama, SmolLM, Mistral (llama.cpp writes Mistral 7B as `llama`; transformers' loader calls it mistral by
    # general.name: the same network, Mistral 7B v0.1's sliding window not being in the file)
    "llama": Arch("llama", ("LlamaForCausalLM",), LLAMA_CONFIG, LLAMA_TENSORS, {"hidden_act": "silu"},
                  {f"{L}.self_attn.q_proj.weight": _q_rows, f"{L}.self_attn.k_proj.weight": _k_rows},
                  finish_config=_rope_scaling("llama")),
    "qwen2": Arch("qwen2", ("Qwen2ForCausalLM",), _CONFIG, {**LLAMA_TENSORS, **_QKV_BIASES},
                  finish_config=_rope_scaling("qwen2")),
    "qwen3": Arch("qwen3", ("Qwen3ForCausalLM",), _CONFIG, {**LLAMA_TENSORS, **_QK_NORMS},
                  finish_config=_rope_scaling("qwen3")),
    "qwen2moe": Arch("qwen2_moe", ("Qwen2MoeForCausalLM",),
                     {**_MOE_CONFIG, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
                     {**_ATTENTION, **_QKV_BIASES, **_EXPERTS, **_SHARED_EXPERT},
                     {"norm_topk_prob": False},  # llama.cpp's qwen2moe does not renormalize the top-k weights
                     {f"{L}.mlp.shared_expert_gate.weight": _row_vector}, finish_config=_rope_scaling("qwen2moe")),
    "qwen3moe": Arch("qwen3_moe", ("Qwen3MoeForCausalLM",), _MOE_CONFIG, {**_ATTENTION, **_QK_NORMS, **_EXPERTS},
                     {"norm_topk_prob": True},  # llama.cpp's qwen3moe renormalizes (transformers' GGUF default too)
                     finish_config=_rope_scaling("qwen3moe")),
    "phi3": Arch("phi3", ("Phi3ForCausalLM",),
                 {**_without(_CONFIG, "key_length"), "attention.sliding_window": "sliding_window"}, _PHI3_TENSORS,
                 finish_config=_phi3),
    "gemma": Arch("gemma", ("GemmaForCausalLM",), _CONFIG, _GEMMA_TENSORS,
                  transforms=_on_norms(_GEMMA_TENSORS, _minus_one), finish_config=_rope_scaling("gemma")),
    "gemma2": Arch("gemma2", ("Gemma2ForCausalLM",), _GEMMA_CONFIG, _GEMMA2_TENSORS,
                   transforms=_on_norms(_GEMMA2_TENSORS, _minus_one), finish_config=_gemma2),
    "gemma3": Arch("gemma3_text", ("Gemma3ForCausalLM",),
                   {**_GEMMA_CONFIG, "rope.freq_base_swa": "rope_local_base_freq"}, _GEMMA3_TENSORS,
                   transforms=_on_norms(_GEMMA3_TENSORS, _minus_one), finish_config=_gemma3),
    # llama.cpp writes GPT-2's head, tied in the checkpoint, as output.weight (a copy of the embeddings)
    "gpt2": Arch("gpt2", ("GPT2LMHeadModel",),
                 {"block_count": "n_layer", "context_length": "n_positions", "embedding_length": "n_embd",
                  "feed_forward_length": "n_inner", "attention.head_count": "n_head",
                  "attention.layer_norm_epsilon": "layer_norm_epsilon"},
                 _GPT2_TENSORS, transforms={name: _transpose for name in _GPT2_CONV1D}, transposed=_GPT2_CONV1D),
    "falcon": Arch("falcon", ("FalconForCausalLM",),
                   {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
                    "embedding_length": "hidden_size", "feed_forward_length": "ffn_hidden_size",
                    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_kv_heads",
                    "attention.layer_norm_epsilon": "layer_norm_epsilon", "rope.freq_base": "rope_theta"},
                   _FALCON_TENSORS, {"parallel_attn": True, "alibi": False},
                   {f"{_FUSED_QKV}.{p}": _falcon_qkv for p in ("weight", "bias")},
                   finish_config=_falcon, renames=_falcon_names),
    # likewise BLOOM's (transformers' loader ties the two)
    "bloom": Arch("bloom", ("BloomForCausalLM",),
                  {"block_count": "n_layer", "context_length": "seq_length", "embedding_length": "hidden_size",
                   "attention.head_count": "n_head", "attention.layer_norm_epsilon": "layer_norm_epsilon"},
                  _BLOOM_TENSORS, transforms={f"{_FUSED_QKV}.{p}": _bloom_qkv for p in ("weight", "bias")}),
}
