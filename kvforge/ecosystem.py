"""What other runtimes need beside a bundle's graph: ONNX Runtime GenAI and Hugging Face Optimum.

kvforge's graphs already use Optimum's and ONNX Runtime GenAI's IO names (docs/design.md); these files
let those runtimes open a bundle directory as it is:

- `genai_config.json` for `onnxruntime_genai.Model(bundle)`: the decoder's IO names, sizes, context
  length, special ids and greedy search defaults. Its model type is GenAI's generic decoder-only one,
  "llama": the graph itself computes the family's function (norms, positions, scaling), so GenAI needs
  no family-specific handling. FP8 bundles ask for basic graph optimizations: ONNX Runtime's extended
  level deletes a ReLU before an FP8 QuantizeLinear (runtime/ort_backend.py).
- `config.json` + `generation_config.json` for `optimum.onnxruntime.ORTModelForCausalLM`: the
  source checkpoint's own files when it was a Hugging Face directory, else a Llama config written from
  the model config where a Llama expresses it.

What a runtime cannot run gets no file, and the manifest's `ecosystem` entry says why.
Torch-free: calibration and the runtime side read this without Torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.bundle import IOSpec
from kvforge.kinds import kind_name, kind_of
from kvforge.schema import read_json

if TYPE_CHECKING:
    from kvforge.tokenizer import Tokenizer

GENAI_CONFIG = "genai_config.json"
HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"


def _layer_pattern(names: list[list[str]], slot: int) -> str | None:
    """'past_key_values.%d.key' from per-layer names, when every layer follows one pattern."""
    pattern = names[0][slot].replace(".0.", ".%d.", 1)
    return pattern if all(layer[slot] == pattern.replace("%d", str(i)) for i, layer in enumerate(names)) else None


def _first(value):
    return value[0] if isinstance(value, list) and value else value


LORA_REASON = ("this bundle's LoRA slots take kvforge's inputs (lora_mask and each slot's A and B), which neither "
               "ONNX Runtime GenAI nor Optimum feeds; export without --lora-max-rank for them")


def genai_config(model: dict[str, Any], io: IOSpec, graph: str, precision: dict[str, Any],
                 tokenizer: Tokenizer | None) -> tuple[dict[str, Any] | None, str | None]:
    """(genai_config.json's content, None), or (None, why GenAI cannot run this bundle). Special ids the
    model config does not name come from the tokenizer."""
    if not kind_of(model).ecosystem:
        return None, f"ONNX Runtime GenAI's config describes decoder LMs; this bundle is {kind_name(model['architecture'])}"
    if io.extra.get("lora"):
        return None, LORA_REASON
    if any(w is not None for w in io.windows):
        return None, ("ONNX Runtime GenAI sizes every present tensor past + new positions, and this bundle's windowed "
                      "layers keep capped caches of min(past + new, W) positions")
    if any(len(layer) != 2 for layer in io.past):
        return None, ("ONNX Runtime GenAI's config names a key and a value per layer; this bundle's latent-attention "
                      "layers cache one latent tensor each")
    patterns = [_layer_pattern(io.past, 0), _layer_pattern(io.past, 1), _layer_pattern(io.present, 0), _layer_pattern(io.present, 1)]
    if None in patterns or [t.name for t in io.inputs[:3]] != ["input_ids", "attention_mask", "position_ids"]:
        return None, "the graph's cache tensors do not follow one naming pattern per layer, which GenAI's config needs"
    eos = model.get("eos_token_id")
    eos = eos if eos is not None or tokenizer is None else tokenizer.eos_token_id
    if eos is None:
        return None, "the model names no end-of-sequence token (GenAI needs one); set eos_token_id"
    bos = model.get("bos_token_id")
    bos = bos if bos is not None or tokenizer is None else tokenizer.bos_token_id
    pad = model.get("pad_token_id")
    pad = pad if pad is not None else _first(eos)
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    quant = precision.get("quantization") or {}
    if quant.get("format") == "fp8" or quant.get("kv_cache") == "fp8":
        session["graph_optimization_level"] = "ORT_ENABLE_BASIC"
    context = io.max_context or model["max_seq_len"]
    config = {
        "model": {
            "type": "llama",  # GenAI's generic decoder-only path: the graph computes the family's function
            "vocab_size": model["vocab_size"],
            "context_length": context,
            "bos_token_id": bos if bos is not None else _first(eos),
            "eos_token_id": eos,
            "pad_token_id": pad,
            "decoder": {
                "filename": graph,
                "session_options": session,
                "head_size": model["head_dim"],
                "hidden_size": model["dim"],
                "num_attention_heads": model["n_heads"],
                "num_key_value_heads": model["n_kv_heads"],
                "num_hidden_layers": model["n_layers"],
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                           "past_key_names": patterns[0], "past_value_names": patterns[1]},
                "outputs": {"logits": "logits", "present_key_names": patterns[2], "present_value_names": patterns[3]},
            },
        },
        "search": {
            "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
            "early_stopping": True, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
            "past_present_share_buffer": False,  # kvforge graphs concatenate past and new: no shared buffer
        },
    }
    return config, None


def llama_config(model: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A transformers LlamaConfig for a kvforge config a Llama expresses exactly, or (None, why not)."""
    if not kind_of(model).ecosystem:
        return None, (f"{kind_name(model['architecture'])} made from a kvforge preset or checkpoint has no Hugging Face config "
                      "to give Optimum (bundles of Hugging Face checkpoints carry theirs)")
    differs = []
    expect = {"position": "rope", "norm": "rmsnorm", "norm_placement": "pre", "block": "sequential", "activation": "silu",
              "gated_ffn": True, "final_norm": True, "embed_norm": False, "qk_norm": None, "rotary_fraction": 1.0,
              "sliding_window": None, "attn_scale": None, "attn_softcap": None, "final_softcap": None,
              "embed_scale": 1.0, "residual_scale": 1.0, "logit_scale": 1.0, "lm_head_bias": False,
              "local_rope_theta": None, "n_experts": 0, "kv_lora_rank": 0}
    for key, value in expect.items():
        if model.get(key, value) != value:
            differs.append(f"{key}={model.get(key)!r}")
    if model.get("qkv_bias") != model.get("out_bias"):
        differs.append("q/k/v and output biases differ (Llama's attention_bias sets both)")
    scaling = model.get("rope_scaling")
    if scaling is not None and scaling.get("type") not in ("linear", "llama3", "yarn"):
        differs.append(f"rope_scaling {scaling.get('type')!r}")
    if differs:
        return None, "no Llama config expresses this design (" + ", ".join(differs) + ")"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if scaling is not None:
        rope = {"rope_theta": model["rope_theta"], "rope_type": scaling["type"],
                **{("original_max_position_embeddings" if k == "original_max_seq_len" else k): v
                   for k, v in scaling.items() if k != "type"}}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model["vocab_size"], "hidden_size": model["dim"], "intermediate_size": model["ffn_dim"],
        "num_hidden_layers": model["n_layers"], "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"], "head_dim": model["head_dim"],
        "max_position_embeddings": model["max_seq_len"], "rms_norm_eps": model["norm_eps"], "hidden_act": "silu",
        "attention_bias": bool(model.get("qkv_bias")), "mlp_bias": bool(model.get("ffn_bias")),
        "tie_word_embeddings": bool(model.get("tie_embeddings")), "rope_parameters": rope,
        "bos_token_id": model.get("bos_token_id"), "eos_token_id": model.get("eos_token_id"),
        "pad_token_id": model.get("pad_token_id"), "use_cache": True,
    }, None


def write_ecosystem_files(directory: Path, model: dict[str, Any], io: IOSpec, graph: str, precision: dict[str, Any],
                          tokenizer: Tokenizer | None, hf_source: Path | None = None,
                          from_bundle: Path | None = None) -> dict[str, Any]:
    """Write what GenAI and Optimum need into `directory` (a staged bundle); returns the manifest's `ecosystem` entry.

    hf_source: the Hugging Face checkpoint the model came from (its config files are copied as they are);
    from_bundle: a bundle whose Optimum files carry over (calibrate: the float bundle it quantizes).
    """
    record: dict[str, Any] = {}
    config, reason = genai_config(model, io, graph, precision, tokenizer)
    if config is not None:
        (directory / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    record["onnxruntime_genai"] = {"config": GENAI_CONFIG if config else None, "reason": reason}

    source = hf_source if hf_source is not None else from_bundle
    for name in (HF_CONFIG, HF_GENERATION_CONFIG):
        if source is not None and (source / name).is_file():
            shutil.copy2(source / name, directory / name)
    if (directory / HF_CONFIG).is_file():
        model_type = read_json(directory / HF_CONFIG).get("model_type")
        carried = from_bundle is not None and hf_source is None
        record["optimum"] = {"config": HF_CONFIG, "model_type": model_type, "reason": None,
                             "from": "the float bundle" if carried else "the source checkpoint"}
    else:
        hf, why = llama_config(model)
        if hf is not None:
            (directory / HF_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
            record["optimum"] = {"config": HF_CONFIG, "model_type": "llama", "reason": None, "from": "kvforge (a Llama config)"}
        else:
            record["optimum"] = {"config": None, "model_type": None, "reason": why, "from": None}
    if io.extra.get("lora"):  # config.json stays (kvforge lora add reads the family's weight names by it)
        record["optimum"] = {**record["optimum"], "config": None, "reason": LORA_REASON}
    if record["optimum"]["config"] and not (directory / HF_GENERATION_CONFIG).is_file():
        gen = {k: model.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if model.get(k) is not None}
        (directory / HF_GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    return record
