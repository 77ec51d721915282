"""Vision-language models: a ViT image encoder, a projector into the decoder's width, and the decoder reading text
embeddings with image features merged in at the image-token positions (LLaVA's design; issue 37).

    pixel_values   float32 (N, C, H, W)     N images, preprocessed (kvforge/images.py)
    image features float32 (N, P, C_text)   P per image: the patches (and the class token, strategy "full")
    input_ids      int64   (B, T)           each image stands as P image tokens where its features go

The image encoder is the encoder layers' pre-norm `Block` (model_defs/model.py) around the same `Attention`, with
every patch seeing every patch, after a patch embedding (a strided convolution), an optional class token and
learned positions, and an optional norm on the embeddings (CLIP's pre_layrnorm). Its features are the hidden state
of one layer (`feature_layer`, counted as transformers counts hidden_states: 0 is the embeddings, -1 the last
layer), so the layers after it are not built; CLIP's class token is dropped from them unless the strategy is "full".

The merge is written for graphs: each image token takes the next row of the flattened features in reading order
(row by row, then position), found by a running count of image tokens, and every other token keeps its text
embedding; a step without images (decode) passes zero features.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kvforge.errors import KvforgeError
from kvforge.images import ImageProcessing

from .config import ConfigDict, ModelConfig
from .layers import Attention, activation_fn, build_ffn, build_norm
from .positions import Float32Tables
from .model import Block, Transformer, build_model
from .resampler import Resampler, ResamplerConfig

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "quick_gelu")
FEATURE_SELECT = ("default", "full")  # default: the patches only (CLIP's class token dropped); full: every position


@dataclass
class VisionConfig(ConfigDict):
    """A ViT image encoder (CLIP, SigLIP)."""

    image_size: int
    patch_size: int
    dim: int
    n_layers: int  # the layers the checkpoint has (those after feature_layer are not built)
    n_heads: int
    ffn_dim: int
    channels: int = 3
    class_token: bool = True  # CLIP: a learned class embedding before the patches; SigLIP: none
    patch_bias: bool = False  # the patch convolution's bias (SigLIP has one, CLIP not)
    pre_norm: bool = True  # a norm on the embeddings (CLIP's pre_layrnorm)
    post_norm: bool = False  # a norm on the features (SigLIP / Idefics take the last layer through post_layernorm)
    norm_eps: float = 1e-5
    activation: str = "quick_gelu"
    feature_layer: int = -1  # hidden_states index: 0 the embeddings, k the k-th layer's output, -1 the last
    feature_select: str = "default"
    # Idefics2/3's: each patch's position is the bucket its fractional coordinate falls in, computed in float32 as
    # transformers does (for some sides, 19, 25, 29, 31, ..., two neighbouring patches then share a position)
    position_buckets: bool = False
    # Qwen2-VL's: the graph takes each image's patches already cut and flattened ((C, T, P, P) each, in
    # merge_size x merge_size blocks, as its processor lays them out) as (N, rows, cols, C*T*P*P); one linear map
    # embeds them; their positions are 2-D rotary (rows and columns) inside attention, no table
    patch_input: str = "pixels"  # "pixels" | "patches"
    temporal_patch_size: int = 1
    merge_size: int = 1
    rope_theta: float | None = None  # 2-D RoPE's base; None: learned positions
    head_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # what the shared components read, fixed for image encoders
    norm: str = "layernorm"
    norm_bias: bool = True
    norm_placement: str = "pre"
    gated_ffn: bool = False
    ffn_bias: bool = True
    qkv_bias: bool = True
    out_bias: bool = True
    attn_scale: float | None = None
    n_kv_heads: int | None = None
    residual_scale: float = 1.0
    attn_softcap: None = None
    dropout: float = 0.0

    ARCHITECTURE: ClassVar[str] = "vision"

    def __post_init__(self) -> None:
        if self.head_dim is None and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0 \
                and self.dim % self.n_heads == 0:
            self.head_dim = self.dim // self.n_heads
        self.n_kv_heads = self.n_heads
        problems = self.problems()
        if problems:
            raise KvforgeError("invalid vision config:\n  " + "\n  ".join(problems))

    def problems(self) -> list[str]:
        problems = []
        for name in ("image_size", "patch_size", "dim", "n_layers", "n_heads", "ffn_dim", "channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            return problems
        if self.head_dim is None:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.image_size % self.patch_size:
            problems.append(f"image_size={self.image_size} is not a whole number of patch_size={self.patch_size} "
                            "patches")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.feature_select not in FEATURE_SELECT:
            problems.append(f"feature_select={self.feature_select!r} is not one of {FEATURE_SELECT}")
        if self.patch_input not in ("pixels", "patches"):
            problems.append(f"patch_input={self.patch_input!r} is not 'pixels' or 'patches'")
        if (self.patch_input == "patches") != (self.rope_theta is not None) or \
                (self.rope_theta is not None and (self.class_token or self.head_dim % 4)):
            problems.append("patch_input 'patches' goes with 2-D RoPE (rope_theta), no class token and a head_dim "
                            "divisible by 4")
        if not -self.n_layers - 1 <= self.feature_layer <= self.n_layers:
            problems.append(f"feature_layer={self.feature_layer} is not a hidden state of {self.n_layers} layers "
                            f"({-self.n_layers - 1}..{self.n_layers})")
        return problems

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def positions(self) -> int:
        return self.patches + (1 if self.class_token else 0)

    @property
    def layers_used(self) -> int:
        """The layers up to the feature layer (those after it do not change the features)."""
        return self.feature_layer % (self.n_layers + 1)

    @property
    def feature_tokens(self) -> int:
        """Features per image."""
        return self.patches + (1 if self.class_token and self.feature_select == "full" else 0)


class PatchEmbeddings(nn.Module):
    """A strided convolution over the image's patches, a class token in front (CLIP), learned positions."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch = nn.Conv2d(cfg.channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(cfg.dim)) if cfg.class_token else None
        self.positions = nn.Embedding(cfg.positions, cfg.dim)
        side = cfg.image_size // cfg.patch_size
        # the buckets' boundaries as torch.arange makes them, a float32 constant whatever the model's dtype (not a
        # buffer, which .to(dtype) would round; and not made in forward: ONNX's Range can count one fewer)
        self.boundaries = torch.arange(1 / side, 1.0, 1 / side) if cfg.position_buckets else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.position_buckets:  # any size of at least one patch: the positions follow its grid
            if pixel_values.shape[1] != cfg.channels or min(pixel_values.shape[2:]) < cfg.patch_size:
                raise KvforgeError(f"pixel_values of shape {tuple(pixel_values.shape)}: this image encoder takes "
                                   f"(images, {cfg.channels}, H, W) with H, W >= {cfg.patch_size}")
        elif tuple(pixel_values.shape[1:]) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise KvforgeError(f"pixel_values of shape {tuple(pixel_values.shape)}: this image encoder takes "
                               f"(images, {cfg.channels}, {cfg.image_size}, {cfg.image_size})")
        grid = self.patch(pixel_values.to(self.patch.weight.dtype))  # (N, C, rows, cols)
        x = grid.flatten(2).transpose(1, 2)  # (N, patches, C)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        positions = self.positions.weight
        if cfg.position_buckets:
            positions = positions[bucketized_positions(grid.shape[2], grid.shape[3], cfg.image_size // cfg.patch_size,
                                                       self.boundaries)]
        return x + positions.to(x.dtype)[None]


def bucketized_positions(rows, cols, side: int, boundaries: torch.Tensor | None = None) -> torch.Tensor:
    """The position of each patch of a rows x cols grid, as Idefics2/3's embeddings compute it: each row's and
    column's float32 fractional coordinate (i * (1 / rows)) bucketized by the boundaries 1/side, 2/side, ... of
    the full side x side grid (torch.bucketize(right=True) is the count of boundaries at or below it). A whole
    image's grid is not always arange: for some sides (19, 25, 29, 31, ...) two patches share a position."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side) if boundaries is None else boundaries.float()

    def buckets(n):
        coords = torch.arange(n, dtype=torch.float32) * (torch.ones((), dtype=torch.float32) / n)
        coords = torch.clamp(coords, max=1.0 - 1e-6)
        return (coords[:, None] >= boundaries[None, :]).sum(-1)

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


class FlatPatchEmbeddings(Float32Tables):
    """Qwen2-VL's patch embedding: each flattened patch (C*T*P*P, its Conv3d's window) through one linear map;
    pixel_values (N, rows, cols, C*T*P*P) -> (N, rows*cols, dim), and the patches' 2-D RoPE (cos, sin)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch = nn.Linear(cfg.channels * cfg.temporal_patch_size * cfg.patch_size ** 2, cfg.dim, bias=False)
        quarter = cfg.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        n, rows, cols, width = pixel_values.shape
        m = cfg.merge_size
        if width != self.patch.in_features or rows % m or cols % m:
            raise KvforgeError(f"pixel_values of shape {tuple(pixel_values.shape)}: this image encoder takes (images, "
                               f"rows, cols, {self.patch.in_features}) with rows and cols multiples of {m}")
        x = self.patch(pixel_values.reshape(n, rows * cols, width).to(self.patch.weight.dtype))
        # each patch's (row, col), in the processor's order: merge_size x merge_size blocks, row by row
        r = torch.arange(rows)[:, None].expand(rows, cols).reshape(rows // m, m, cols // m, m).transpose(1, 2)
        c = torch.arange(cols)[None, :].expand(rows, cols).reshape(rows // m, m, cols // m, m).transpose(1, 2)
        freqs = torch.cat([r.reshape(-1)[:, None].float() * self.inv_freq, c.reshape(-1)[:, None].float() * self.inv_freq],
                          dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[None]  # (1, patches, head_dim)
        return x, (emb.cos(), emb.sin())


class VisionTransformer(nn.Module):
    """pixel_values (N, C, H, W) -> the feature layer's hidden states (N, feature_tokens, dim); with flattened
    patches (Qwen2-VL), (N, rows, cols, C*T*P*P) -> (N, rows*cols, dim)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.embed = FlatPatchEmbeddings(cfg) if cfg.patch_input == "patches" else PatchEmbeddings(cfg)
        self.pre_norm = build_norm(cfg) if cfg.pre_norm else None
        self.layers = nn.ModuleList(Block(cfg, Attention(cfg), build_ffn(cfg)) for _ in range(cfg.layers_used))
        self.post_norm = build_norm(cfg) if cfg.post_norm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x, rope = self.embed(pixel_values) if self.config.patch_input == "patches" else (self.embed(pixel_values), None)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        mask = torch.ones(x.shape[0], 1, x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        for layer in self.layers:
            x, _ = layer(x, mask, rope, None)
        if self.post_norm is not None:
            x = self.post_norm(x)
        if self.config.class_token and self.config.feature_select == "default":
            x = x[:, 1:]
        return x


class MLPProjector(nn.Module):
    """LLaVA's projector: linear -> activation -> linear, from the image encoder's width to the decoder's."""

    def __init__(self, vision_dim: int, text_dim: int, activation: str, bias: bool = True):
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = activation_fn(activation)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ResamplerProjector(nn.Module):
    """Idefics2's connector: a gated MLP from the image encoder's width to the decoder's (its modality projection),
    then the Perceiver resampler (model_defs/resampler.py): every image becomes n_latents features."""

    def __init__(self, vision_dim: int, text_dim: int, hidden: int, activation: str, resampler: ResamplerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(vision_dim, hidden, bias=False)
        self.up_proj = nn.Linear(vision_dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, text_dim, bias=False)
        self.act = activation_fn(activation)
        self.resampler = Resampler(resampler)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resampler(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class PixelShuffleProjector(nn.Module):
    """Idefics3's connector: pixel shuffle (each scale x scale block of neighbouring patches becomes one feature of
    scale**2 times the width, so an image has scale**2 times fewer features), then one linear map to the decoder's
    width."""

    def __init__(self, vision_dim: int, text_dim: int, scale: int):
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(vision_dim * scale * scale, text_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, patches, dim = x.shape
        side, s = math.isqrt(patches), self.scale
        # (n, rows, cols, dim) -> blocks of s x s patches, each flattened row by row within the block as transformers
        # does (its two view/permute steps): (n, rows/s, cols/s, s*s*dim)
        x = x.reshape(n, side, side // s, s * dim).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, s * s * dim).permute(0, 2, 1, 3)
        return self.proj(x.reshape(n, patches // (s * s), s * s * dim))


class PatchMergerProjector(nn.Module):
    """Qwen2-VL's patch merger: a LayerNorm, then each merge_size x merge_size block of patches (consecutive in the
    processor's order) as one vector, through linear -> GELU -> linear to the decoder's width."""

    def __init__(self, vision_dim: int, text_dim: int, merge: int, eps: float):
        super().__init__()
        self.width = vision_dim * merge * merge
        self.ln_q = nn.LayerNorm(vision_dim, eps=eps)
        self.linear_1 = nn.Linear(self.width, self.width)
        self.act = activation_fn("gelu")
        self.linear_2 = nn.Linear(self.width, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, patches, _ = x.shape
        return self.linear_2(self.act(self.linear_1(self.ln_q(x).reshape(n, -1, self.width))))


def _mlp_projector(cfg: "VisionLanguageConfig") -> nn.Module:
    return MLPProjector(cfg.vision_config.dim, cfg.decoder_config.dim, cfg.projector_activation, cfg.projector_bias)


def _resampler_projector(cfg: "VisionLanguageConfig") -> nn.Module:
    return ResamplerProjector(cfg.vision_config.dim, cfg.decoder_config.dim, cfg.projector_ffn_dim,
                              cfg.projector_activation, cfg.resampler_config)


def _pixel_shuffle_projector(cfg: "VisionLanguageConfig") -> nn.Module:
    return PixelShuffleProjector(cfg.vision_config.dim, cfg.decoder_config.dim, cfg.projector_scale)


def _patch_merger_projector(cfg: "VisionLanguageConfig") -> nn.Module:
    v = cfg.vision_config
    return PatchMergerProjector(v.dim, cfg.decoder_config.dim, v.merge_size, v.norm_eps)


# projector name -> its builder: what a config's `projector` selects
PROJECTORS = {"mlp": _mlp_projector, "resampler": _resampler_projector, "pixel_shuffle": _pixel_shuffle_projector,
              "patch_merger": _patch_merger_projector}
# how a prompt's text stands for an image (its placeholder, expanded by the runtime: kvforge/images.py):
# "tokens" its image tokens alone; "idefics2" between two <fake_token_around_image>; "idefics3" Idefics3's tiles,
# each with its <row_r_col_c>, then the whole image after <global-img>
IMAGE_PROMPTS = ("tokens", "idefics2", "idefics3", "qwen2_vl")


def merge_image_features(embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                         image_token_id: int) -> torch.Tensor:
    """embeds (B, T, C) with the image tokens' rows replaced by features (M, C), taken in reading order. An image
    token beyond the features given (any, when M = 0: a decode step that generated the image token) keeps its
    own embedding, as transformers' models embed such a token when no pixel values come with the step. Callers
    check that a prompt's counts agree."""
    B, T, C = embeds.shape
    is_image = input_ids == image_token_id  # (B, T)
    flat = is_image.reshape(-1).to(torch.float32)
    # each image token's row in features: a running count, in float32 (exact below 2**24; the type TensorRT's
    # CumSum and Min take), made an index at the end
    order = torch.cumsum(flat, 0) - 1
    padded = torch.cat([features.to(embeds.dtype).reshape(-1, C), embeds.new_zeros(1, C)])  # row M: never taken
    given = torch.ones_like(order) * (padded.shape[0] - 1)  # M
    take = (flat > 0) & (order < given)
    rows = torch.where(take, order, given).to(torch.int64)
    return torch.where(take.reshape(B, T, 1), padded[rows].reshape(B, T, C), embeds)


@dataclass
class VisionLanguageConfig(ConfigDict):
    vision: dict[str, Any]  # VisionConfig's fields
    decoder: dict[str, Any]  # ModelConfig's fields
    image_token_id: int
    projector: str = "mlp"  # LLaVA's two-layer MLP
    projector_activation: str = "gelu"
    projector_bias: bool = True
    projector_ffn_dim: int | None = None  # the resampler projector's gated MLP width
    resampler: dict[str, Any] | None = None  # ResamplerConfig's fields (projector "resampler")
    projector_scale: int = 1  # the pixel-shuffle projector's block side (Idefics3's scale_factor)
    image_prompt: str = "tokens"  # IMAGE_PROMPTS: how the prompt's text stands for an image
    # how an image becomes pixel_values (kvforge/images.py ImageProcessing's fields); None: CLIP's at image_size
    image_processing: dict[str, Any] | None = None
    image_placeholder: str = "<image>"  # what stands for an image in a prompt's text
    family: str = "kvforge"
    architecture: str = "vision-language"
    extra: dict[str, Any] = field(default_factory=dict)

    ARCHITECTURE: ClassVar[str] = "vision-language"
    KIND: ClassVar[str] = "vision-language config"

    def __post_init__(self) -> None:
        # the parts' configs, as dicts in the fields (the manifest's form) and as checked configs beside them
        if not isinstance(self.vision, dict):
            self.vision = self.vision.to_dict()
        if not isinstance(self.decoder, dict):
            self.decoder = self.decoder.to_dict()
        self.vision_config = VisionConfig.from_dict(self.vision)
        self.decoder_config = ModelConfig.from_dict(self.decoder)
        self.resampler_config = ResamplerConfig.from_dict(self.resampler) if self.resampler is not None else None
        problems = []
        if self.projector not in PROJECTORS:
            problems.append(f"projector={self.projector!r} is not one kvforge builds ({list(PROJECTORS)})")
        elif (self.projector == "resampler") != (self.resampler_config is not None):
            problems.append("a resampler projector and a resampler config go together")
        elif self.projector == "resampler":
            if self.resampler_config.dim != self.decoder_config.dim:
                problems.append(f"the resampler's width {self.resampler_config.dim} is not the decoder's "
                                f"{self.decoder_config.dim}")
            if not isinstance(self.projector_ffn_dim, int) or self.projector_ffn_dim <= 0:
                problems.append(f"projector_ffn_dim must be a positive integer, got {self.projector_ffn_dim!r}")
        if self.projector == "pixel_shuffle":
            side = self.vision_config.image_size // self.vision_config.patch_size
            if not isinstance(self.projector_scale, int) or self.projector_scale < 1 or side % self.projector_scale:
                problems.append(f"projector_scale={self.projector_scale!r} does not divide the image's {side} patches "
                                "a side")
            if self.vision_config.class_token and self.vision_config.feature_select == "full":
                problems.append("a pixel-shuffle projector takes the patches only (no class token)")
        if self.image_prompt not in IMAGE_PROMPTS:
            problems.append(f"image_prompt={self.image_prompt!r} is not one of {IMAGE_PROMPTS}")
        if self.projector_activation not in ACTIVATIONS:
            problems.append(f"projector_activation={self.projector_activation!r} is not one of {ACTIVATIONS}")
        if not (isinstance(self.image_token_id, int) and 0 <= self.image_token_id < self.decoder_config.vocab_size):
            problems.append(f"image_token_id={self.image_token_id!r} is outside the vocabulary "
                            f"(size {self.decoder_config.vocab_size})")
        if self.image_processing is None:
            size = self.vision_config.image_size
            self.image_processing = ImageProcessing(size={"shortest_edge": size},
                                                    crop_size={"height": size, "width": size}).to_dict()
        processing = ImageProcessing(**self.image_processing)
        v = self.vision_config
        if v.patch_input == "patches" and (processing.patch_layout or {}).get("merge_size") != v.merge_size:
            problems.append(f"an image encoder that takes flattened patches needs image_processing.patch_layout with "
                            f"its merge_size {v.merge_size}, got {processing.patch_layout!r}")
        if processing.variable_size:
            takes_any = self.vision_config.position_buckets or self.vision_config.patch_input == "patches"
            if not takes_any or self.projector == "pixel_shuffle":
                problems.append("image_processing keeps each image's own size: the image encoder must take any size "
                                "(bucketized positions) and a projector that does not need a square grid")
        elif processing.output_size != (self.vision_config.image_size,) * 2:
            problems.append(f"image_processing makes {processing.output_size} images; the image encoder takes "
                            f"{self.vision_config.image_size} x {self.vision_config.image_size}")
        if not isinstance(self.image_placeholder, str) or not self.image_placeholder:
            problems.append(f"image_placeholder must be a non-empty string, got {self.image_placeholder!r}")
        if problems:
            raise KvforgeError("invalid vision-language config:\n  " + "\n  ".join(problems))

    # the decoder's, as the stages that read a generating model's config ask for them
    @property
    def vocab_size(self) -> int:
        return self.decoder_config.vocab_size

    @property
    def n_layers(self) -> int:
        return self.decoder_config.n_layers

    @property
    def dim(self) -> int:
        return self.decoder_config.dim

    @property
    def n_heads(self) -> int:
        return self.decoder_config.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.decoder_config.n_kv_heads

    @property
    def max_seq_len(self) -> int:
        return self.decoder_config.max_seq_len

    @property
    def tie_embeddings(self) -> bool:
        return self.decoder_config.tie_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        return self.decoder_config.eos_token_ids

    @property
    def image_tokens(self) -> int:
        """The image tokens (features) each image stands as."""
        if self.resampler_config:
            return self.resampler_config.n_latents
        if self.projector == "pixel_shuffle":
            return self.vision_config.patches // self.projector_scale ** 2
        if self.projector == "patch_merger":  # an image of the encoder's nominal size (each image: its own grid's)
            return self.vision_config.patches // self.vision_config.merge_size ** 2
        return self.vision_config.feature_tokens


class VisionLanguageModel(nn.Module):
    """image_features(pixel_values) -> (N, P, C_text); forward(input_ids, image_features, ...) -> the decoder's
    (logits, presents) over the text embeddings with the features merged in."""

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.config = cfg
        self.vision = VisionTransformer(cfg.vision_config)
        self.projector = PROJECTORS[cfg.projector](cfg)
        self.decoder: Transformer = build_model(cfg.decoder_config)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision(pixel_values))

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The images' features (N, image_tokens, C_text): what the vision graph computes, once per image."""
        return self.image_features(pixel_values)

    def embeddings(self, input_ids: torch.Tensor, image_features: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's input embeddings: the text's, with image features at the image tokens."""
        embeds = self.decoder.embed(input_ids)
        if image_features is None:
            image_features = embeds.new_zeros(0, embeds.shape[-1])
        return merge_image_features(embeds, input_ids, image_features, self.config.image_token_id)

    def forward(self, input_ids: torch.Tensor, image_features: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                past_key_values=None, pixel_values: torch.Tensor | None = None,
                rope_positions: torch.Tensor | None = None):
        """rope_positions (B, 3, T): multimodal RoPE's position streams (Qwen2-VL), else plain positions."""
        if pixel_values is not None:
            if image_features is not None:
                raise KvforgeError("pass pixel_values or image_features, not both")
            image_features = self.image_features(pixel_values)
        if image_features is not None:
            count = int((input_ids == self.config.image_token_id).sum())
            given = image_features.shape[0] * image_features.shape[1] if image_features.ndim == 3 else image_features.shape[0]
            if count != given:
                raise KvforgeError(f"the prompt has {count} image tokens but {given} image features were given "
                                   f"({self.config.image_tokens} per image)")
        return self.decoder(input_ids, attention_mask, position_ids, past_key_values,
                            inputs_embeds=self.embeddings(input_ids, image_features), rope_positions=rope_positions)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_vision_language(cfg: VisionLanguageConfig) -> VisionLanguageModel:
    return VisionLanguageModel(cfg)
