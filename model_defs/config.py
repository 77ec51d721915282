"""One config dataclass for every decoder kvforge builds, and named presets as data.

The fields span the decoder design space of the notes the project grew from:
the attention variant (MHA / GQA / MQA by the number of KV heads, q/k norms,
sliding windows on all or some layers, each with a capped cache), the position
scheme (learned, sinusoidal, ALiBi, RoPE with partial rotary and linear /
Llama-3 / LongRoPE frequency scaling, a base of its own for windowed layers),
the norm (LayerNorm / RMSNorm; pre, post, sandwich or output placement), the
block (sequential, or attention and FFN in parallel off one or two norms), the
FFN (plain or gated, with ReLU / GELU / GELU-tanh / SiLU), the constants some
families scale by (embeddings, residual branches, attention scores, logits,
soft-capping) and tied or untied embeddings. Derived fields are filled in
`__post_init__` only when the user left them unset.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvforge.errors import KvforgeError

POSITIONS = ("rope", "alibi", "learned", "sinusoidal", "none")
NORMS = ("rmsnorm", "layernorm")
NORM_PLACEMENTS = ("pre", "post", "sandwich", "output")
BLOCKS = ("sequential", "parallel", "parallel_two_norms")
QK_NORMS = ("head", "proj")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
    "yarn": ("factor", "original_max_seq_len"),  # beta_fast 32, beta_slow 1, truncate, attention_factor: optional
    "longrope": ("short_factor", "long_factor", "original_max_seq_len", "attention_factor"),
}


class ConfigDict:
    """to_dict / to_json / from_dict for a config dataclass; from_dict refuses unknown fields, naming them."""

    KIND: ClassVar[str | None] = None  # how errors name the config; None: the class's name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KvforgeError(f"unknown {cls.KIND or cls.__name__} fields: {unknown}")
        return cls(**data)


@dataclass
class ModelConfig(ConfigDict):
    KIND: ClassVar[str] = "model config"

    vocab_size: int
    dim: int  # model width (hidden_size / n_embd)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int | None = None  # None -> n_heads (MHA); 1 -> MQA; a divisor of n_heads -> GQA
    head_dim: int | None = None  # None -> dim // n_heads; may differ (then q/o are not square)
    ffn_dim: int | None = None  # hidden width of the FFN; None -> 4 * dim
    max_seq_len: int = 2048  # the longest context (past + seq) the model is meant for

    # attention
    qkv_bias: bool = False  # Qwen2 and GPT-2 have biases on the q/k/v projections
    out_bias: bool = False  # bias on the attention output projection (GPT-2)
    sliding_window: int | None = None  # a query sees at most this many keys, itself included
    sliding_window_layers: list[int] | None = None  # layers with the window; None -> all of them
    qk_norm: str | None = None  # norm q and k before RoPE: "head" (each head: Qwen3, Gemma3, Cohere), "proj" (OLMo2)
    attn_scale: float | None = None  # scores = q.k * attn_scale; None -> 1/sqrt(head_dim) (Gemma, Granite set it)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before masking (Gemma 2)
    # Multi-head latent attention (DeepSeek-V2/V3, model_defs/mla.py) when kv_lora_rank > 0: each token's keys and
    # values come from one latent c_kv of kv_lora_rank features (kv_a_proj_with_mqa, normed, then kv_b_proj per
    # head) plus one RoPE key of qk_rope_head_dim shared by all heads; the cache holds only those
    # kv_lora_rank + qk_rope_head_dim values per token and layer. A head's query is qk_nope_head_dim features
    # without positions and qk_rope_head_dim rotated ones (from q_proj, or through a q_lora_rank bottleneck
    # with its own norm); its value has v_head_dim. head_dim must equal qk_rope_head_dim (the rotated width);
    # attn_scale None -> 1/sqrt(qk_nope_head_dim + qk_rope_head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # positions
    position: str = "rope"
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # partial rotary: rotate only the first fraction of head_dim
    # {"type": "linear", "factor": f} or {"type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_seq_len"} or {"type": "yarn", "factor", "original_max_seq_len",
    # ["beta_fast", "beta_slow", "attention_factor", "truncate"]} or {"type": "longrope", "short_factor": [...],
    # "long_factor": [...], "original_max_seq_len", "attention_factor"}; None = plain RoPE
    rope_scaling: dict[str, Any] | None = None
    # Windowed layers' RoPE base (Gemma 3's rope_local_base_freq): they then rotate with RoPE of this base
    # and local_rope_scaling (linear / llama3 / yarn, or None), and rope_scaling applies to full-attention
    # layers only. None: one RoPE for all layers.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # multimodal RoPE (Qwen2-VL): the rotary frequencies in three sections, each turned by its own position stream
    # (time, height, width; a text token's three are equal, so it rotates as plain RoPE); None: one stream
    mrope_section: list[int] | None = None
    alibi_scale: float = 1.0  # position="alibi": multiplies BLOOM's slopes (Falcon: 1/sqrt(head_dim))
    alibi_bf16: bool = False  # Falcon: slopes, key positions and biases rounded to bfloat16, as transformers computes them

    # norms
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only: learned shift
    # pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + norm(f(norm(x))) (Gemma 2/3);
    # output: x + norm(f(x)) (OLMo 2)
    norm_placement: str = "pre"
    final_norm: bool = True  # a norm before lm_head (pre-norm models need it)
    embed_norm: bool = False  # a norm right after the embeddings (BLOOM)

    # sequential: attention, then FFN; parallel: x + attn(norm(x)) + ffn(norm(x)) (GPT-J, Falcon, Cohere);
    # parallel_two_norms: x + attn(norm1(x)) + ffn(norm2(x)) (GPT-NeoX, Falcon-40B)
    block: str = "sequential"

    # FFN: gated (SwiGLU / GeGLU / ReGLU) or plain two-layer MLP, with `activation`
    activation: str = "silu"
    gated_ffn: bool = True
    ffn_bias: bool = False

    # mixture of experts (model_defs/moe.py): 0 experts = a dense FFN on every layer. A MoE layer's FFN is
    # n_experts gated FFNs of expert_ffn_dim, experts_per_token of them chosen per token by a router
    # (softmax or sigmoid scores, top-k, renormalized or not, scaled, optionally with a correction bias that
    # steers the choice only), plus an always-on shared expert (optionally gated by a sigmoid: Qwen2-MoE).
    # moe_layers: the layers that have experts (None: all); the others keep the dense FFN of ffn_dim.
    n_experts: int = 0
    experts_per_token: int = 2
    expert_ffn_dim: int | None = None
    router_scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = False
    shared_expert_ffn_dim: int = 0
    shared_expert_gate: bool = False
    moe_layers: list[int] | None = None
    # group-limited routing (DeepSeek): experts form router_groups equal groups, each token first keeps its
    # router_topk_groups best groups (a group's score: its best expert's, "max" (V2), or its best two summed,
    # "top2" (V3)), then picks experts_per_token experts within them. 1 group: plain top-k.
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: str = "max"

    tie_embeddings: bool = False  # lm_head shares the token embedding matrix
    lm_head_bias: bool = False  # GPT-J

    # constants (1.0 / None = absent): embeddings * embed_scale (Gemma sqrt(dim), Granite), each residual
    # branch * residual_scale (Granite), logits * logit_scale (Cohere; Granite divides: 1/logits_scaling),
    # then final_softcap * tanh(logits / final_softcap) (Gemma 2)
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    final_softcap: float | None = None
    dropout: float = 0.0  # residual/attention/embedding dropout; identity at inference

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # a list when several tokens end generation
    pad_token_id: int | None = None

    # Where the config came from ("llama", "gpt2", ... or "kvforge"); informational.
    family: str = "kvforge"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise KvforgeError(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim
        if self.sliding_window_layers is not None:
            self.sliding_window_layers = sorted(int(i) for i in self.sliding_window_layers)
        if self.n_experts and self.expert_ffn_dim is None:
            self.expert_ffn_dim = self.ffn_dim
        if self.moe_layers is not None:
            self.moe_layers = sorted(int(i) for i in self.moe_layers)
        self.validate()

    def validate(self) -> None:
        problems = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        for name, allowed in (
            ("position", POSITIONS),
            ("norm", NORMS),
            ("norm_placement", NORM_PLACEMENTS),
            ("block", BLOCKS),
            ("activation", ACTIVATIONS),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            problems.append(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS} (or None)")
        if self.block != "sequential" and self.norm_placement != "pre":
            problems.append(f"block={self.block!r} normalizes before its sublayers; norm_placement must be 'pre', "
                            f"got {self.norm_placement!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 2):
            # A window of 1 sees only the token itself; its capped cache would be a one-position buffer.
            problems.append(f"sliding_window must be an integer >= 2, got {self.sliding_window!r}")
        for name in ("embed_scale", "residual_scale", "logit_scale", "alibi_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value == 0:
                problems.append(f"{name} must be a finite non-zero number, got {value!r}")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
                problems.append(f"{name} must be a positive number or None, got {value!r}")
        if self.mrope_section is not None:
            sections = self.mrope_section
            if not (isinstance(sections, (list, tuple)) and len(sections) == 3
                    and all(isinstance(x, int) and x > 0 for x in sections)):
                problems.append(f"mrope_section must be three positive ints, got {sections!r}")
            elif self.position != "rope" or self.rope_scaling is not None or 2 * sum(sections) != self.rotary_dim:
                problems.append(f"mrope_section {list(sections)} splits plain RoPE's {self.rotary_dim // 2} frequencies: "
                                "it needs position='rope', no rope_scaling and sections summing to rotary_dim / 2")
        if self.local_rope_theta is not None and (self.position != "rope" or self.sliding_window is None):
            problems.append("local_rope_theta is the RoPE base of windowed layers: it needs position='rope' and a sliding_window")
        if self.local_rope_scaling is not None:
            if self.local_rope_theta is None:
                problems.append("local_rope_scaling scales the windowed layers' own RoPE: it needs local_rope_theta")
            problems += self._scaling_problems("local_rope_scaling", self.local_rope_scaling, ("linear", "llama3", "yarn"))
        if self.sliding_window_layers is not None and any(
            not 0 <= i < self.n_layers for i in self.sliding_window_layers
        ):
            problems.append(f"sliding_window_layers {self.sliding_window_layers} name layers outside 0..{self.n_layers - 1}")
        if self.position == "rope":
            rot = self.rotary_dim if not problems else 0
            if not 0.0 < self.rotary_fraction <= 1.0:
                problems.append(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
            elif not problems and (rot < 2 or rot % 2):
                problems.append(f"rotary dimension {rot} (head_dim * rotary_fraction) must be even and >= 2")
            if self.rope_scaling is not None:
                problems += self._scaling_problems("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
                if self.rope_scaling.get("type") == "longrope" and not problems:
                    for key in ("short_factor", "long_factor"):
                        if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                            problems.append(f"rope_scaling longrope {key} has {len(self.rope_scaling[key])} factors; "
                                            f"the rotary dimension {self.rotary_dim} needs {self.rotary_dim // 2}")
        if self.position == "sinusoidal" and self.dim % 2:
            problems.append(f"sinusoidal positions need an even dim, got {self.dim}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.n_experts:
            problems += self._moe_problems()
        if self.kv_lora_rank:
            problems += self._mla_problems()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            for i in value if isinstance(value, list) else [value]:
                if i is not None and not (isinstance(i, int) and 0 <= i < self.vocab_size):
                    problems.append(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")
        if problems:
            raise KvforgeError("invalid model config:\n  " + "\n  ".join(problems))

    def _moe_problems(self) -> list[str]:
        problems = []
        if not isinstance(self.n_experts, int) or self.n_experts < 1:
            problems.append(f"n_experts must be a positive integer (or 0 for a dense model), got {self.n_experts!r}")
        elif not isinstance(self.experts_per_token, int) or not 1 <= self.experts_per_token <= self.n_experts:
            problems.append(f"experts_per_token must be in 1..n_experts={self.n_experts}, got {self.experts_per_token!r}")
        if not isinstance(self.expert_ffn_dim, int) or self.expert_ffn_dim < 1:
            problems.append(f"expert_ffn_dim must be a positive integer, got {self.expert_ffn_dim!r}")
        if self.router_scoring not in ("softmax", "sigmoid"):
            problems.append(f"router_scoring={self.router_scoring!r} is not one of ('softmax', 'sigmoid')")
        if not isinstance(self.shared_expert_ffn_dim, int) or self.shared_expert_ffn_dim < 0:
            problems.append(f"shared_expert_ffn_dim must be an integer >= 0, got {self.shared_expert_ffn_dim!r}")
        if self.shared_expert_gate and not self.shared_expert_ffn_dim:
            problems.append("shared_expert_gate gates the shared expert: it needs shared_expert_ffn_dim")
        if not self.gated_ffn:
            problems.append("experts are gated FFNs (gate, up, down): set gated_ffn=True")
        if self.moe_layers is not None and any(not 0 <= i < self.n_layers for i in self.moe_layers):
            problems.append(f"moe_layers {self.moe_layers} name layers outside 0..{self.n_layers - 1}")
        g, kg = self.router_groups, self.router_topk_groups
        if not isinstance(g, int) or not isinstance(kg, int) or g < 1 or not 1 <= kg <= g:
            problems.append(f"router_groups ({g!r}) and router_topk_groups ({kg!r}) must be integers with "
                            "1 <= router_topk_groups <= router_groups")
        elif isinstance(self.n_experts, int) and self.n_experts >= 1:
            if self.n_experts % g:
                problems.append(f"n_experts={self.n_experts} is not divisible into router_groups={g}")
            elif isinstance(self.experts_per_token, int) and self.experts_per_token > kg * (self.n_experts // g):
                problems.append(f"experts_per_token={self.experts_per_token} exceeds the {kg * (self.n_experts // g)} "
                                f"experts of router_topk_groups={kg} groups")
            elif g > 1 and self.router_group_score == "top2" and self.n_experts // g < 2:
                problems.append("router_group_score 'top2' sums each group's best two experts: groups need >= 2 experts")
        if self.router_group_score not in ("max", "top2"):
            problems.append(f"router_group_score={self.router_group_score!r} is not one of ('max', 'top2')")
        return problems

    def _mla_problems(self) -> list[str]:
        problems = []
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"latent attention needs {name} to be a positive integer, got {value!r}")
        if not isinstance(self.qk_nope_head_dim, int) or self.qk_nope_head_dim < 0:
            problems.append(f"qk_nope_head_dim must be an integer >= 0, got {self.qk_nope_head_dim!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            problems.append(f"q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}")
        if self.position != "rope":
            problems.append(f"latent attention rotates its decoupled RoPE dims: position must be 'rope', got {self.position!r}")
        if self.head_dim != self.qk_rope_head_dim:
            problems.append(f"latent attention: head_dim (the rotated width) must equal qk_rope_head_dim="
                            f"{self.qk_rope_head_dim}, got {self.head_dim}")
        if self.rotary_fraction != 1.0 and not problems:
            problems.append("latent attention rotates all qk_rope_head_dim features: rotary_fraction must be 1")
        if self.sliding_window is not None:
            problems.append("latent attention keeps a full latent cache: sliding_window is not supported with it")
        if self.qk_norm is not None or self.attn_softcap is not None or self.position == "alibi":
            problems.append("latent attention has no q/k norms or soft-capping")
        return problems

    def cache_entries(self, layer: int) -> list[tuple[str, int, int]]:
        """Layer `layer`'s cache tensors: (name, heads, features per head), each (batch, heads, positions, features).

        Per-head attention caches a key and a value per KV head; latent attention one `latent` of
        kv_lora_rank + qk_rope_head_dim features ([normed c_kv | rotated k_pe]) shared by every head.
        """
        if self.kv_lora_rank:
            return [("latent", 1, self.kv_lora_rank + self.qk_rope_head_dim)]
        return [("key", self.n_kv_heads, self.head_dim), ("value", self.n_kv_heads, self.head_dim)]

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_experts) and (self.moe_layers is None or layer in self.moe_layers)

    @staticmethod
    def _scaling_problems(name: str, scaling: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
        kind = scaling.get("type")
        if kind not in allowed:
            return [f"{name} type {kind!r} is not one of {allowed}"]
        missing = [k for k in _ROPE_SCALING_KEYS[kind] if k not in scaling]
        return [f"{name} {kind!r} lacks {missing}"] if missing else []

    # -- derived ---------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        value = self.eos_token_id
        return [] if value is None else list(value) if isinstance(value, list) else [value]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    # -- (de)serialization -----------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise KvforgeError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        return cls(**PRESETS[name])


# Named presets, as data. `tiny` is the project's trained default (its weights
# ship with the package); the others are architecture shapes that load with
# seeded random weights: the `*-micro` ones span the design space in models
# small enough for every test, the larger ones are the benchmark shapes.
PRESETS: dict[str, dict[str, Any]] = {
    # Llama-style, GQA 8/4, SwiGLU, RMSNorm, RoPE; trained by model_defs/train_tiny.py.
    "tiny": dict(
        vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
        max_seq_len=1024, rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-5,
        activation="silu", gated_ffn=True, tie_embeddings=True, family="llama",
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # The trained mixture of experts (weights ship with the package; model_defs/train_tiny.py --preset tiny-moe, on
    # tiny's corpus with tiny's tokenizer): DeepSeek-style latent attention (q through a 128 bottleneck, a 64-wide
    # latent + 16 RoPE dims cached per token), a dense first layer, then 8 experts, top-2, beside a shared expert.
    "tiny-moe": dict(
        vocab_size=4096, dim=256, n_layers=4, n_heads=8, head_dim=16, ffn_dim=704, max_seq_len=1024,
        kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_experts=8, experts_per_token=2, expert_ffn_dim=192, shared_expert_ffn_dim=192, moe_layers=[1, 2, 3],
        rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-5, activation="silu", gated_ffn=True, tie_embeddings=True,
        family="kvforge", bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # The ~125M Llama shape of the runtime benchmarks.
    "llama-125m": dict(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
        max_seq_len=2048, rope_theta=10000.0, norm_eps=1e-5, family="llama",
        bos_token_id=1, eos_token_id=2,
    ),
    # GPT-2 small: learned positions, LayerNorm, GELU-tanh MLP, biases, tied embeddings.
    "gpt2-124m": dict(
        vocab_size=50257, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_seq_len=1024,
        position="learned", norm="layernorm", activation="gelu_tanh", gated_ffn=False,
        qkv_bias=True, out_bias=True, ffn_bias=True, tie_embeddings=True, family="gpt2",
        bos_token_id=50256, eos_token_id=50256,
    ),
    # --- micro shapes (byte-level vocabulary, random weights) ---
    "gpt2-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=256,
        position="learned", norm="layernorm", activation="gelu_tanh", gated_ffn=False,
        qkv_bias=True, out_bias=True, ffn_bias=True, tie_embeddings=True, family="gpt2",
    ),
    # Llama-3 frequency scaling, GQA, untied embeddings.
    "llama3-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=512,
        rope_theta=500000.0,
        rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64),
        family="llama",
    ),
    # Sliding window (shorter than the validation sequences), GQA.
    "mistral-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256,
        sliding_window=8, family="mistral",
    ),
    # q/k/v biases, MQA, window on the upper layer only.
    "qwen2-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=160, max_seq_len=256,
        qkv_bias=True, sliding_window=6, sliding_window_layers=[1], rope_theta=1000000.0, norm_eps=1e-6,
        family="qwen2",
    ),
    # The original Transformer decoder: post-norm LayerNorm, sinusoidal positions, ReLU MLP.
    "classic-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=256,
        position="sinusoidal", norm="layernorm", norm_placement="post", final_norm=False,
        activation="relu", gated_ffn=False, ffn_bias=True, qkv_bias=True, out_bias=True,
    ),
    # GeGLU (exact GELU), partial rotary, head_dim != dim / n_heads.
    "geglu-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=128,
        max_seq_len=256, rotary_fraction=0.5, activation="gelu", gated_ffn=True,
        rope_scaling=dict(type="linear", factor=2.0),
    ),
    # ReGLU with biases, LayerNorm without shift, no positions at all (NoPE).
    "reglu-micro": dict(
        vocab_size=259, dim=48, n_layers=3, n_heads=3, ffn_dim=96, max_seq_len=256,
        position="none", norm="layernorm", norm_bias=False, activation="relu", gated_ffn=True,
        ffn_bias=True, tie_embeddings=True,
    ),
    # BLOOM-style: ALiBi with 6 heads (not a power of two), a LayerNorm on the embeddings, GELU-tanh MLP.
    "alibi-micro": dict(
        vocab_size=259, dim=48, n_layers=2, n_heads=6, ffn_dim=192, max_seq_len=256, position="alibi",
        norm="layernorm", embed_norm=True, activation="gelu_tanh", gated_ffn=False, qkv_bias=True, out_bias=True,
        ffn_bias=True, tie_embeddings=True, family="bloom",
    ),
    # GPT-NeoX-style parallel block off two LayerNorms, a quarter of each head rotated.
    "neox-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=256, block="parallel_two_norms",
        rotary_fraction=0.25, norm="layernorm", activation="gelu", gated_ffn=False, qkv_bias=True, out_bias=True,
        ffn_bias=True, family="gpt_neox",
    ),
    # GPT-J / Cohere-style parallel block off one bias-free LayerNorm, per-head q/k LayerNorm, a biased
    # head and a logit multiplier.
    "parallel-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256, block="parallel",
        norm="layernorm", norm_bias=False, qk_norm="head", lm_head_bias=True, logit_scale=0.5, family="cohere",
    ),
    # OLMo 2-style: norms on the attention and FFN outputs only, q/k norms over whole projections.
    "olmo-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256,
        norm_placement="output", qk_norm="proj", rope_theta=500000.0, family="olmo2",
    ),
    # Granite-style constants: embeddings, residual branches, attention scores and logits scaled.
    "granite-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256,
        embed_scale=12.0, residual_scale=0.22, attn_scale=0.0625, logit_scale=0.125, tie_embeddings=True,
        family="granite",
    ),
    # Mixtral-style mixture of experts: 8 gated experts, 2 per token (softmax, renormalized), GQA.
    "mixtral-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256,
        n_experts=8, experts_per_token=2, expert_ffn_dim=96, family="mixtral",
    ),
    # Qwen2-MoE-style: a dense first layer, then 6 experts (top-2, not renormalized) beside a shared expert
    # behind a sigmoid gate.
    "qwen2moe-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256, qkv_bias=True,
        n_experts=6, experts_per_token=2, expert_ffn_dim=48, norm_topk_prob=False, shared_expert_ffn_dim=128,
        shared_expert_gate=True, moe_layers=[1], family="qwen2_moe",
    ),
    # DeepSeek-V3-style: latent attention (q low-rank path, 16-wide latent + 8 RoPE dims cached), a dense first
    # layer, then 8 sigmoid-scored experts in 4 groups (best 2 groups kept), top-2, a correction bias, scaled
    # weights, a shared expert.
    "deepseek-micro": dict(
        vocab_size=259, dim=64, n_layers=2, n_heads=4, head_dim=8, ffn_dim=160, max_seq_len=256,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12,
        n_experts=8, experts_per_token=2, expert_ffn_dim=48, router_scoring="sigmoid", router_correction_bias=True,
        router_groups=4, router_topk_groups=2, router_group_score="top2", routed_scaling_factor=2.5,
        shared_expert_ffn_dim=48, moe_layers=[1], family="deepseek_v3",
    ),
    # Gemma 2/3-style: sandwich norms, per-head q/k norms, attention and final soft-capping,
    # query_pre_attn_scalar, embeddings * sqrt(dim), local (windowed, capped cache, own RoPE base) and
    # global layers alternating.
    "gemma-micro": dict(
        vocab_size=259, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=256,
        norm_placement="sandwich", qk_norm="head", attn_scale=20 ** -0.5, attn_softcap=5.0, final_softcap=3.0,
        embed_scale=8.0, activation="gelu_tanh", sliding_window=8, sliding_window_layers=[0, 2],
        local_rope_theta=10000.0, rope_theta=1000000.0, rope_scaling=dict(type="linear", factor=4.0),
        tie_embeddings=True, family="gemma3_text",
    ),
}
