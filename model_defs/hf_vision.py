"""Hugging Face vision-language checkpoints (LLaVA) into model_defs/vision.py's VisionLanguageModel, strictly.

The decoder's weights go through its own family's table (model_defs/hf_families.py: a LLaVA over Llama reads its
language model as a Llama checkpoint), the image encoder's and the projector's through the tables here. Every
checkpoint tensor is used or named as one transformers does not use either (the image encoder's layers after the
feature layer, and its post_layernorm when the features are taken before it); anything else is an error that
lists it, as for the other kinds.

Checkpoints name their parts two ways: as released and as transformers writes them (`language_model.model.`,
`language_model.lm_head.`, `vision_tower.`, with `vision_tower.vision_model.` in older releases) or as its module
tree names them (`model.language_model.`, `lm_head.`, `model.vision_tower.`, `model.multi_modal_projector.`); both
are read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from kvforge.errors import KvforgeError

from .architectures import tied_parameters
from .hf import config_from_hf, read_hf_config, read_safetensors, safetensors_files, state_dict_from_hf
from .vision import VisionConfig, VisionLanguageConfig, VisionLanguageModel

VISION_FAMILIES = ("llava",)
_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "relu": "relu", "silu": "silu"}
# the module tree's names -> the released ones
_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."),
            ("vision_tower.vision_model.", "vision_tower."))


def _activation(name: Any, where: str) -> str:
    if name not in _ACTIVATIONS:
        raise KvforgeError(f"{where}={name!r} is not an activation kvforge builds ({sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _clip_vision(vc: dict[str, Any], feature_layer: int, select: str) -> VisionConfig:
    kind = vc.get("model_type", "clip_vision_model")
    if kind != "clip_vision_model":
        raise KvforgeError(f"vision_config.model_type={kind!r}: kvforge reads LLaVA's CLIP image encoder "
                           "(clip_vision_model)")
    try:
        return VisionConfig(image_size=vc.get("image_size", 224), patch_size=vc.get("patch_size", 32),
                            dim=vc.get("hidden_size", 768), n_layers=vc.get("num_hidden_layers", 12),
                            n_heads=vc.get("num_attention_heads", 12), ffn_dim=vc.get("intermediate_size", 3072),
                            channels=vc.get("num_channels", 3), class_token=True, patch_bias=False, pre_norm=True,
                            post_norm=False, norm_eps=vc.get("layer_norm_eps", 1e-5),
                            activation=_activation(vc.get("hidden_act", "quick_gelu"), "vision_config.hidden_act"),
                            feature_layer=feature_layer, feature_select=select)
    except TypeError as e:
        raise KvforgeError(f"vision_config does not describe a CLIP image encoder: {e}") from e


def llava_config(hf: dict[str, Any]) -> VisionLanguageConfig:
    """A LLaVA config.json -> VisionLanguageConfig (the decoder through its own family's config mapping)."""
    text, vision = hf.get("text_config"), hf.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise KvforgeError("a llava config.json needs text_config and vision_config objects")
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise KvforgeError(f"vision_feature_layer={layer!r}: features concatenated from several layers are not "
                           "built by kvforge (one layer, an integer)")
    select = hf.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise KvforgeError(f"vision_feature_select_strategy={select!r} is not 'default' or 'full'")
    decoder = config_from_hf({"model_type": "llama", **text})
    token = hf.get("image_token_id", hf.get("image_token_index", 32000))
    return VisionLanguageConfig(
        vision=_clip_vision(vision, layer, select).to_dict(), decoder=decoder.to_dict(), image_token_id=token,
        projector="mlp", projector_activation=_activation(hf.get("projector_hidden_act", "gelu"), "projector_hidden_act"),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)), family="llava")


def vision_table(cfg: VisionConfig, prefix: str = "vision_tower.") -> dict[str, str]:
    """kvforge's image-encoder parameters (under `vision.`) -> a CLIP vision tower's names."""
    table = {"vision.embed.patch.weight": f"{prefix}embeddings.patch_embedding.weight",
             "vision.embed.positions.weight": f"{prefix}embeddings.position_embedding.weight"}
    if cfg.patch_bias:
        table["vision.embed.patch.bias"] = f"{prefix}embeddings.patch_embedding.bias"
    if cfg.class_token:
        table["vision.embed.class_embedding"] = f"{prefix}embeddings.class_embedding"
    norms = {"pre_norm": "pre_layrnorm"} if cfg.pre_norm else {}
    if cfg.post_norm:
        norms["post_norm"] = "post_layernorm"
    for ours, theirs in norms.items():
        for p in ("weight", "bias"):
            table[f"vision.{ours}.{p}"] = f"{prefix}{theirs}.{p}"
    parts = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
             "attn.o_proj": "self_attn.out_proj", "attn_norm": "layer_norm1", "ffn_norm": "layer_norm2",
             "ffn.up_proj": "mlp.fc1", "ffn.down_proj": "mlp.fc2"}
    for i in range(cfg.layers_used):
        for ours, theirs in parts.items():
            for p in ("weight", "bias"):
                table[f"vision.layers.{i}.{ours}.{p}"] = f"{prefix}encoder.layers.{i}.{theirs}.{p}"
    return table


def _unused(cfg: VisionConfig, prefix: str = "vision_tower.") -> re.Pattern:
    """The image encoder's tensors that its features do not depend on (transformers computes, then drops, them)."""
    after = [rf"encoder\.layers\.{i}\." for i in range(cfg.layers_used, cfg.n_layers)]
    if not cfg.post_norm:
        after.append(r"post_layernorm\.")
    return re.compile(rf"^{re.escape(prefix)}(?:{'|'.join(after)})" if after else r"^$(?!)")


def state_dict_from_llava(model: VisionLanguageModel, tensors: dict[str, torch.Tensor],
                          hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    cfg = model.config
    named = {}
    for name, t in tensors.items():
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        named[name] = t
    text = {n[len("language_model."):]: t for n, t in named.items() if n.startswith("language_model.")}
    text_hf = {"model_type": "llama", **hf["text_config"]}
    state = {f"decoder.{k}": v for k, v in
             state_dict_from_hf(model.decoder, cfg.decoder_config.family, text, text_hf).items()}
    table = vision_table(cfg.vision_config)
    table.update({f"projector.linear_{i}.{p}": f"multi_modal_projector.linear_{i}.{p}"
                  for i in (1, 2) for p in (("weight", "bias") if cfg.projector_bias else ("weight",))})
    expected = model.state_dict()
    missing, shapes, used = [], [], set()
    for ours, theirs in table.items():
        if theirs not in named:
            missing.append(theirs)
            continue
        used.add(theirs)
        if tuple(named[theirs].shape) != tuple(expected[ours].shape):
            shapes.append(f"{theirs}: checkpoint {tuple(named[theirs].shape)} vs config {tuple(expected[ours].shape)}")
            continue
        state[ours] = named[theirs]
    unused = _unused(cfg.vision_config)
    extra = sorted(n for n in named if not n.startswith("language_model.") and n not in used and not unused.search(n))
    if missing or extra or shapes:
        lines = [f"missing tensors ({len(missing)}): {missing}"] if missing else []
        lines += [f"unexpected tensors ({len(extra)}): {extra}"] if extra else []
        lines += ["shape mismatches:\n    " + "\n    ".join(shapes)] if shapes else []
        raise KvforgeError("llava checkpoint does not match its config:\n  " + "\n  ".join(lines))
    return state


def load_vision_language(directory: str | Path) -> VisionLanguageModel:
    """A Hugging Face LLaVA checkpoint directory -> the VisionLanguageModel with its weights, in eval mode."""
    directory = Path(directory)
    hf = read_hf_config(directory)
    family = hf.get("model_type")
    if family not in VISION_FAMILIES:
        raise KvforgeError(f"{directory}: model_type={family!r} is not a vision-language family kvforge reads "
                           f"({list(VISION_FAMILIES)})")
    cfg = llava_config(hf)
    model = VisionLanguageModel(cfg)
    state = state_dict_from_llava(model, read_safetensors(safetensors_files(directory)), hf)
    tied = {f"decoder.{n}" for n in tied_parameters(model.decoder)}
    result = model.load_state_dict(state, strict=False)
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise KvforgeError(f"{directory}: parameters left unfed {sorted(set(result.missing_keys) - tied)}")
    return model.eval()
