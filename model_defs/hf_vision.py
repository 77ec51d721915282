"""Hugging Face vision-language checkpoints (LLaVA, Idefics2, Idefics3/SmolVLM, Qwen2-VL) as model_defs/vision.py's
VisionLanguageModel: Families of model_defs/hf_families.py like the others, read by the same strict importer
(model_defs/hf.py). Qwen2.5-VL is refused by name there (hf_families.NOT_BUILT says why).

The decoder's weights go through its own family's table (a LLaVA over Llama reads its language model as a Llama
checkpoint, under `language_model.`), the image encoder's and the projector's through the tables here. Every
checkpoint tensor is used or is one that transformers does not use either (the image encoder's layers after the
feature layer, and its post_layernorm when the features are taken before it); anything else is an error that
lists it, as for the other kinds. The image processing comes from preprocessor_config.json beside config.json
(kvforge/images.py), else CLIP's at the encoder's image size.

Checkpoints name their parts two ways: as released and as transformers writes them (`language_model.model.`,
`language_model.lm_head.`, `vision_tower.`, with `vision_tower.vision_model.` in older releases) or as its module
tree names them (`model.language_model.`, `lm_head.`, `model.vision_tower.`, `model.multi_modal_projector.`); both
are read.
"""

from __future__ import annotations

from typing import Any

from kvforge.errors import KvforgeError
from kvforge.kinds import get_kind

from kvforge.images import ImageProcessing

from .config import ModelConfig
from .resampler import ResamplerConfig
from .vision import VisionConfig

_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "relu": "relu", "silu": "silu"}
# the module tree's names -> the released ones
LLAVA_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
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


def llava_config(families: dict[str, Any]):
    """A LLaVA config.json -> VisionLanguageConfig's fields (the decoder through its own family's mapping)."""

    def config(hf: dict[str, Any]) -> dict[str, Any]:
        vision = hf.get("vision_config")
        if not isinstance(vision, dict):
            raise KvforgeError("a llava config.json needs a vision_config object")
        layer = hf.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise KvforgeError(f"vision_feature_layer={layer!r}: features concatenated from several layers are not "
                               "built by kvforge (one layer, an integer)")
        select = hf.get("vision_feature_select_strategy", "default")
        if select not in ("default", "full"):
            raise KvforgeError(f"vision_feature_select_strategy={select!r} is not 'default' or 'full'")
        text, decoder = _text_config(families, hf, "llama")
        encoder = _clip_vision(vision, layer, select)
        processing = hf.get("preprocessor_config")
        if processing is None:
            size = encoder.image_size
            image = ImageProcessing(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        else:
            image = ImageProcessing.from_hf(processing)
        if image.output_size != (encoder.image_size, encoder.image_size):
            raise KvforgeError(f"the image processor makes {image.output_size} images; the encoder takes "
                               f"{encoder.image_size} x {encoder.image_size}")
        return dict(vision=encoder.to_dict(), decoder=decoder.to_dict(),
                    image_token_id=hf.get("image_token_id", hf.get("image_token_index", 32000)),
                    projector="mlp",
                    projector_activation=_activation(hf.get("projector_hidden_act", "gelu"), "projector_hidden_act"),
                    projector_bias=bool(hf.get("multimodal_projector_bias", True)), image_processing=image.to_dict(),
                    family="llava")

    return config


def vision_table(cfg: VisionConfig, prefix: str = "vision_tower.") -> dict[str, tuple[str, None]]:
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
    return {k: (v, None) for k, v in table.items()}


def llava_weights(families: dict[str, Any]):
    """The whole model's table: the decoder family's entries for each layer, under decoder. / language_model.,
    then the image encoder's and the projector's."""

    def weights(hf: dict[str, Any], cfg) -> dict[str, tuple[str, Any]]:
        text = {"model_type": "llama", **hf.get("text_config", {})}
        table = _decoder_table(families, text, cfg.decoder_config, lambda name: f"language_model.{name}")
        table.update(vision_table(cfg.vision_config))
        bias = ("weight", "bias") if cfg.projector_bias else ("weight",)
        table.update({f"projector.linear_{i}.{p}": (f"multi_modal_projector.linear_{i}.{p}", None)
                      for i in (1, 2) for p in bias})
        return table

    return weights


def _decoder_table(families: dict[str, Any], text: dict[str, Any], dec, rename) -> dict[str, tuple[str, Any]]:
    """The decoder family's table for each layer, under decoder. and the checkpoint names `rename` gives."""
    table = {}
    for ours, (theirs, transform) in families[text["model_type"]].weights(text, dec).items():
        for i in range(dec.n_layers) if "{i}" in ours else [None]:
            key, name = (ours, theirs) if i is None else (ours.replace("{i}", str(i)), theirs.replace("{i}", str(i)))
            table[f"decoder.{key}"] = (rename(name), transform)
    return table


def _text_config(families: dict[str, Any], hf: dict[str, Any], default: str) -> tuple[dict[str, Any], ModelConfig]:
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise KvforgeError(f"a {hf.get('model_type')} config.json needs a text_config object")
    text = {"model_type": default, **text}
    family = families.get(text["model_type"])
    if family is None or not get_kind(family.architecture).kv_cache:
        raise KvforgeError(f"text_config.model_type={text['model_type']!r} is not a decoder family kvforge reads")
    return text, ModelConfig(**family.config(text))


def resampler_table(n_layers: int, prefix: str) -> dict[str, tuple[str, None]]:
    """kvforge's Resampler parameters (model_defs/resampler.py) -> transformers' Idefics2PerceiverResampler's."""
    table = {"latents": f"{prefix}latents", "norm.weight": f"{prefix}norm.weight"}
    parts = {"latent_norm": "input_latents_norm", "context_norm": "input_context_norm",
             "ffn_norm": "post_attention_layernorm", "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
             "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj", "ffn.gate_proj": "mlp.gate_proj",
             "ffn.up_proj": "mlp.up_proj", "ffn.down_proj": "mlp.down_proj"}
    for i in range(n_layers):
        for ours, theirs in parts.items():
            table[f"layers.{i}.{ours}.weight"] = f"{prefix}layers.{i}.{theirs}.weight"
    return {k: (v, None) for k, v in table.items()}


def _idefics_vision(vc: dict[str, Any], family: str) -> VisionConfig:
    """Idefics2's and Idefics3's image encoder: SigLIP-style (no class token, a patch bias, post_layernorm on the
    last layer), its patches' positions bucketized as transformers computes them."""
    try:
        return VisionConfig(image_size=vc.get("image_size", 224), patch_size=vc.get("patch_size", 32),
                            dim=vc.get("hidden_size", 768), n_layers=vc.get("num_hidden_layers", 12),
                            n_heads=vc.get("num_attention_heads", 12), ffn_dim=vc.get("intermediate_size", 3072),
                            channels=vc.get("num_channels", 3), class_token=False, patch_bias=True,
                            pre_norm=False, post_norm=True, norm_eps=vc.get("layer_norm_eps", 1e-6),
                            activation=_activation(vc.get("hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act"),
                            feature_layer=-1, feature_select="full", position_buckets=True)
    except TypeError as e:
        raise KvforgeError(f"vision_config does not describe {family}'s image encoder: {e}") from e


def idefics2_config(families: dict[str, Any]):
    """An Idefics2 config.json -> VisionLanguageConfig's fields: a SigLIP-style encoder (no class token, a patch
    bias, post_layernorm on the last layer), the connector's gated projection and Perceiver resampler."""

    def config(hf: dict[str, Any]) -> dict[str, Any]:
        text, decoder = _text_config(families, hf, "mistral")
        vc, pc = hf.get("vision_config") or {}, hf.get("perceiver_config") or {}
        processor = hf.get("preprocessor_config")
        encoder = _idefics_vision(vc, "Idefics2")
        heads, head_dim = pc.get("resampler_n_heads", 16), pc.get("resampler_head_dim", 96)
        resampler = ResamplerConfig(dim=decoder.dim, n_latents=pc.get("resampler_n_latents", 64),
                                    n_layers=pc.get("resampler_depth", 3), n_heads=heads, head_dim=head_dim,
                                    n_kv_heads=pc.get("num_key_value_heads", heads), ffn_dim=4 * decoder.dim,
                                    activation=_activation(pc.get("hidden_act", "silu"), "perceiver_config.hidden_act"),
                                    norm_eps=pc.get("rms_norm_eps", 1e-6))
        if processor is None:  # no processor beside it: images resized to the encoder's own size
            size = encoder.image_size
            image = ImageProcessing(size={"height": size, "width": size}, do_center_crop=False, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, resample=2)
        else:  # its processor: the bounded resize keeps each image's size (the encoder's positions follow its grid)
            image = ImageProcessing.from_hf({"image_processor_type": "Idefics2ImageProcessor", **processor})
        return dict(vision=encoder.to_dict(), decoder=decoder.to_dict(), image_token_id=hf.get("image_token_id", 32001),
                    projector="resampler",
                    projector_activation=_activation(text.get("hidden_act", "silu"), "text_config.hidden_act"),
                    projector_ffn_dim=decoder.ffn_dim, resampler=resampler.to_dict(), image_processing=image.to_dict(),
                    image_placeholder="<image>", image_prompt="idefics2", family="idefics2")

    return config


def _idefics_table(families: dict[str, Any], hf: dict[str, Any], cfg, text_type: str) -> dict[str, tuple[str, Any]]:
    """Idefics2's and Idefics3's decoder (under model.text_model.) and image encoder (model.vision_model.)."""
    text = {"model_type": text_type, **hf.get("text_config", {})}
    table = _decoder_table(families, text, cfg.decoder_config,
                           lambda name: "model.text_model." + name[len("model."):] if name.startswith("model.") else name)
    table.update(vision_table(cfg.vision_config, "model.vision_model."))
    return table


def idefics2_weights(families: dict[str, Any]):
    def weights(hf: dict[str, Any], cfg) -> dict[str, tuple[str, Any]]:
        table = _idefics_table(families, hf, cfg, "mistral")
        for p in ("gate_proj", "up_proj", "down_proj"):
            table[f"projector.{p}.weight"] = (f"model.connector.modality_projection.{p}.weight", None)
        table.update({f"projector.resampler.{k}": v for k, v in
                      resampler_table(cfg.resampler_config.n_layers, "model.connector.perceiver_resampler.").items()})
        return table

    return weights


def idefics3_config(families: dict[str, Any]):
    """An Idefics3 (SmolVLM) config.json -> VisionLanguageConfig's fields: Idefics2's image encoder, the connector's
    pixel shuffle (scale_factor) and linear projection, a Llama decoder; the image processor's resize, tiles and
    the prompt's row/column tokens (kvforge/images.py)."""

    def config(hf: dict[str, Any]) -> dict[str, Any]:
        text, decoder = _text_config(families, hf, "llama")
        encoder = _idefics_vision(hf.get("vision_config") or {}, "Idefics3")
        processor = hf.get("preprocessor_config")
        image = ImageProcessing.from_hf({"image_processor_type": "Idefics3ImageProcessor", **(processor or {})})
        if processor is None:  # the processor's defaults, its tiles the encoder's size
            side = encoder.image_size
            image = ImageProcessing(**{**image.to_dict(), "size": {"longest_edge": 4 * side},
                                       "max_image_size": {"longest_edge": side}})
        return dict(vision=encoder.to_dict(), decoder=decoder.to_dict(), image_token_id=hf.get("image_token_id", 128257),
                    projector="pixel_shuffle", projector_scale=hf.get("scale_factor", 2),
                    image_processing=image.to_dict(), image_placeholder="<image>", image_prompt="idefics3",
                    family="idefics3")

    return config


def idefics3_weights(families: dict[str, Any]):
    def weights(hf: dict[str, Any], cfg) -> dict[str, tuple[str, Any]]:
        table = _idefics_table(families, hf, cfg, "llama")
        table["projector.proj.weight"] = ("model.connector.modality_projection.proj.weight", None)
        return table

    return weights


QWEN2_VL_RENAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))  # module tree -> released


def qwen2_vl_config(families: dict[str, Any]):
    """A Qwen2-VL config.json -> VisionLanguageConfig's fields: its vision tower (flattened patches, 2-D RoPE,
    pre-norm blocks with QuickGELU MLPs, full attention within each image: no windows in Qwen2-VL), the patch
    merger, and a Qwen2 decoder turning multimodal RoPE (mrope_section); the image processor's smart resize and
    patch layout (kvforge/images.py)."""

    def config(hf: dict[str, Any]) -> dict[str, Any]:
        text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k not in ("vision_config",)})
        params = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
        sections = params.get("mrope_section")
        if not sections:
            raise KvforgeError("a qwen2_vl config.json needs rope_parameters.mrope_section (multimodal RoPE's sections)")
        if params.get("rope_type", params.get("type", "default")) not in ("default", "mrope"):
            raise KvforgeError(f"qwen2_vl with rope type {params.get('rope_type')!r}: kvforge turns multimodal RoPE "
                               "without frequency scaling")
        theta = params.get("rope_theta", text.get("rope_theta", hf.get("rope_theta", 1000000.0)))
        text = {**text, "model_type": "qwen2", "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        decoder = ModelConfig(**{**families["qwen2"].config(text), "mrope_section": [int(x) for x in sections]})
        vc = hf.get("vision_config") or {}
        if vc.get("fullatt_block_indexes") or vc.get("window_size"):
            raise KvforgeError("window attention over patches (Qwen2.5-VL's) is not built by kvforge")
        dim, heads = vc.get("embed_dim", 1280), vc.get("num_heads", 16)
        merge, patch = vc.get("spatial_merge_size", 2), vc.get("patch_size", 14)
        vision_params = vc.get("rope_parameters") or {}
        try:
            encoder = VisionConfig(image_size=patch * merge * 2, patch_size=patch, dim=dim, n_layers=vc.get("depth", 32),
                                   n_heads=heads, ffn_dim=int(dim * vc.get("mlp_ratio", 4)),
                                   channels=vc.get("in_channels", vc.get("in_chans", 3)), class_token=False,
                                   patch_bias=False, pre_norm=False, post_norm=False, norm_eps=1e-6,
                                   activation=_activation(vc.get("hidden_act", "quick_gelu"), "vision_config.hidden_act"),
                                   feature_layer=-1, feature_select="full", patch_input="patches",
                                   temporal_patch_size=vc.get("temporal_patch_size", 2), merge_size=merge,
                                   rope_theta=float(vision_params.get("rope_theta", 10000.0)))
        except TypeError as e:
            raise KvforgeError(f"vision_config does not describe Qwen2-VL's vision tower: {e}") from e
        if vc.get("hidden_size", decoder.dim) != decoder.dim:
            raise KvforgeError(f"vision_config.hidden_size {vc.get('hidden_size')} (the merger's output) is not the "
                               f"decoder's width {decoder.dim}")
        processor = hf.get("preprocessor_config") or {}
        image = ImageProcessing.from_hf({"image_processor_type": "Qwen2VLImageProcessor", **processor})
        layout = image.patch_layout
        if (layout["patch_size"], layout["merge_size"], layout["temporal_patch_size"]) != \
                (patch, merge, encoder.temporal_patch_size):
            raise KvforgeError(f"the image processor's patch layout {layout} is not the vision tower's (patch {patch}, "
                               f"merge {merge}, temporal {encoder.temporal_patch_size})")
        return dict(vision=encoder.to_dict(), decoder=decoder.to_dict(), image_token_id=hf.get("image_token_id", 151655),
                    projector="patch_merger", image_processing=image.to_dict(), image_placeholder="<|image_pad|>",
                    image_prompt="qwen2_vl", family="qwen2_vl")

    return config


def qwen2_vl_weights(families: dict[str, Any]):
    def weights(hf: dict[str, Any], cfg) -> dict[str, tuple[str, Any]]:
        text = {**(hf.get("text_config") or hf), "model_type": "qwen2"}
        table = _decoder_table(families, text, cfg.decoder_config, lambda name: name)
        flat = lambda t, c: t.reshape(t.shape[0], -1)  # noqa: E731 - Conv3d (dim, C, T, P, P) as one linear map
        table["vision.embed.patch.weight"] = ("visual.patch_embed.proj.weight", flat)
        parts = {"attn_norm": "norm1", "ffn_norm": "norm2", "attn.o_proj": "attn.proj", "ffn.up_proj": "mlp.fc1",
                 "ffn.down_proj": "mlp.fc2"}
        for i in range(cfg.vision_config.n_layers):
            for p in ("weight", "bias"):
                for ours, theirs in parts.items():
                    table[f"vision.layers.{i}.{ours}.{p}"] = (f"visual.blocks.{i}.{theirs}.{p}", None)
                for j, q in enumerate("qkv"):  # the fused [q | k | v] projection, split
                    table[f"vision.layers.{i}.attn.{q}_proj.{p}"] = (f"visual.blocks.{i}.attn.qkv.{p}",
                                                                     lambda t, c, j=j: t.chunk(3, dim=0)[j])
        for p in ("weight", "bias"):
            table[f"projector.ln_q.{p}"] = (f"visual.merger.ln_q.{p}", None)
            table[f"projector.linear_1.{p}"] = (f"visual.merger.mlp.0.{p}", None)
            table[f"projector.linear_2.{p}"] = (f"visual.merger.mlp.2.{p}", None)
        return table

    return weights


def llava_leftovers(cfg) -> tuple[str, ...]:
    """The image encoder's tensors its features do not depend on (transformers computes, then drops, them)."""
    v = cfg.vision_config
    unused = tuple(f"vision_tower.encoder.layers.{i}." for i in range(v.layers_used, v.n_layers))
    return unused + (() if v.post_norm else ("vision_tower.post_layernorm.",))
