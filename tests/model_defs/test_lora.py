"""LoRA slots on the Torch reference against PEFT (the oracle): an adapter read into kvforge's slots gives the
logits of PEFT's merged model; rows of one batch take different adapters; bad adapters are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.errors import KvforgeError
from kvforge.model_defs import load
from kvforge.model_defs.lora import add_slots, feeding, peft_adapter, torch_feed

from ..conftest import make_hf_model, make_peft_adapter

ATOL = 1e-4
VOCAB = 300
# family -> (PEFT target_modules, adapter rank); ranks differ, and stay below the slots' max rank of 8
FAMILIES = {
    "llama": ("all-linear", 4),
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 3),  # fused q/k/v and gate/up
    "gpt2": (["c_attn", "c_proj", "c_fc"], 5),  # Conv1D: (in, out) weights, fan_in_fan_out
    "gemma2": (["q_proj", "v_proj"], 2),  # two of seven: the others' slots stay zero
    "falcon": (["query_key_value", "dense"], 4),  # fused heads, grouped per kv head
}


def _adapter(family: str, targets, rank: int, path, seed: int = 0):
    """A PEFT adapter of `family`'s test model with random A and B (B is zero at PEFT's default init), saved to
    `path`; returns PEFT's merged model."""
    return make_peft_adapter(make_hf_model(family), path, seed + 7, r=rank, lora_alpha=2 * rank + 1,
                             target_modules=targets, fan_in_fan_out=family == "gpt2")


def _ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_an_adapter_in_the_slots_gives_pefts_merged_logits(family, hf_checkpoint, tmp_path):
    targets, rank = FAMILIES[family]
    merged = _adapter(family, targets, rank, tmp_path / "adapter")
    ours, _ = load(hf_checkpoint(family))
    ids = _ids(2, 9, seed=1)
    base = ours(ids)[0]
    slots = add_slots(ours)
    assert slots and all(ours.get_submodule(s).weight is not None for s in slots)
    hf_config = json.loads((hf_checkpoint(family) / "config.json").read_text())
    adapter = peft_adapter(tmp_path / "adapter", ours, family, hf_config, max_rank=8)
    assert adapter.rank == rank
    expected = merged(ids).logits
    with feeding(ours, torch_feed([0, 0], [adapter.slots], ours)):
        got = ours(ids)[0]
    assert (got - expected).abs().max() < ATOL
    assert (got - base).abs().max() > 100 * ATOL  # the adapter changed the logits
    # slots fed nothing, or an all-zero adapter, are the model without slots
    assert torch.equal(ours(ids)[0], base)
    with feeding(ours, torch_feed([None, None], [adapter.slots], ours)):  # its columns masked off
        assert torch.equal(ours(ids)[0], base)


@torch.no_grad()
def test_rows_of_one_batch_take_their_own_adapters(hf_checkpoint, tmp_path):
    """Three adapters (ranks 2, 4 and 6, side by side) and a row without: each row equals its merged model."""
    merged = [_adapter("llama", "all-linear", r, tmp_path / f"a{r}", seed=r) for r in (2, 4, 6)]
    ours, _ = load(hf_checkpoint("llama"))
    base = [ours(_ids(1, 7, seed=i))[0] for i in range(4)]
    add_slots(ours)
    adapters = [peft_adapter(tmp_path / f"a{r}", ours, "llama", max_rank=8).slots for r in (2, 4, 6)]
    ids = torch.cat([_ids(1, 7, seed=i) for i in range(4)])
    feed = torch_feed([0, 1, 2, None], adapters, ours)
    assert feed.weights[ours.lora_slots[0]][0].shape[-1] == 2 + 4 + 6  # their ranks side by side, no padding
    with feeding(ours, feed):
        got = ours(ids)[0]
    for row in range(3):
        assert (got[row] - merged[row](ids[row:row + 1]).logits[0]).abs().max() < ATOL
    assert (got[3] - base[3][0]).abs().max() < 1e-5


def _refusal(tmp_path, edit, match, max_rank=8, targets=None):
    _adapter("llama", "all-linear", 4, tmp_path / "bad")
    edit(tmp_path / "bad")
    ours, _ = load(make_hf_checkpoint_dir(tmp_path))
    add_slots(ours, targets)
    with pytest.raises(KvforgeError, match=match):
        peft_adapter(tmp_path / "bad", ours, "llama", max_rank=max_rank)


def make_hf_checkpoint_dir(tmp_path):
    path = tmp_path / "base"
    if not path.exists():
        make_hf_model("llama").save_pretrained(path, safe_serialization=True)
    return path


def _set_config(key, value):
    def edit(d):
        config = json.loads((d / "adapter_config.json").read_text())
        config[key] = value
        (d / "adapter_config.json").write_text(json.dumps(config))
    return edit


def _nan(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(d / "adapter_model.safetensors"))


def _pickle_only(d):
    tensors = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(d / "adapter_model.safetensors"))
    torch.save(tensors, d / "adapter_model.bin")
    (d / "adapter_model.safetensors").unlink()


def _other_base(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "q_proj.lora_A" in k)
    tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] + 8)
    save_file(tensors, str(d / "adapter_model.safetensors"))


@pytest.mark.parametrize("edit, match, max_rank, targets", [
    (lambda d: None, "rank 4, above the bundle's LoRA max rank 2", 2, None),
    (lambda d: None, "has no LoRA slot in this bundle", 8, ["q", "v"]),
    (_set_config("modules_to_save", ["lm_head"]), "modules_to_save", 8, None),
    (_set_config("use_dora", True), "DoRA", 8, None),
    (_set_config("peft_type", "IA3"), "not a LoRA adapter", 8, None),
    (_nan, "NaN or infinite", 8, None),
    (_pickle_only, "pickle", 8, None),
    (_other_base, "another base model|not a rank-r pair", 8, None),
], ids=["rank", "target", "modules_to_save", "dora", "not-lora", "nan", "pickle", "other-base"])
def test_bad_adapters_are_refused_by_name(tmp_path, edit, match, max_rank, targets):
    _refusal(tmp_path, edit, match, max_rank, targets)


def test_targets_the_model_lacks_are_refused(hf_checkpoint):
    ours, _ = load(hf_checkpoint("gpt2"))
    with pytest.raises(KvforgeError, match=r"\['gate'\] are not linear layers of this model"):
        add_slots(ours, ["q", "gate"])
    assert {s.rsplit(".", 1)[-1] for s in add_slots(ours)} == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                               "down_proj"}


# a mixture's routed experts: transformers keeps each layer's experts fused ((experts, out, in) parameters), which
# PEFT adapts with target_parameters (a LoRA per expert); kvforge's experts are per-expert layers
MOE = {"mixtral": ["q_proj", "o_proj"], "qwen2_moe": ["v_proj", "gate_proj", "down_proj"]}  # qwen2_moe: + its shared expert
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.mark.parametrize("family", list(MOE))
@torch.no_grad()
def test_an_adapter_of_a_mixtures_fused_experts_gives_pefts_merged_logits(family, hf_checkpoint, tmp_path):
    merged = make_peft_adapter(make_hf_model(family), tmp_path / "adapter", seed=3, scale=0.2, r=3, lora_alpha=5,
                               target_modules=MOE[family], target_parameters=list(FUSED_EXPERTS))
    ours, _ = load(hf_checkpoint(family))
    ids = _ids(3, 8, seed=2)
    base = ours(ids)[0]
    with pytest.raises(KvforgeError, match="experts of .* have no LoRA slots in this bundle"):  # not default targets
        add_slots(ours)
        peft_adapter(tmp_path / "adapter", ours, family, max_rank=4)
    ours, _ = load(hf_checkpoint(family))
    dense = ["gate", "up", "down"] if family == "qwen2_moe" else []  # its shared expert (Mixtral has none)
    slots = add_slots(ours, ["q", "k", "v", "o", *dense, "experts.gate", "experts.up", "experts.down"])
    assert sum(".experts.experts." in s for s in slots) == 3 * ours.config.n_experts * len(
        [i for i in range(ours.config.n_layers) if ours.config.is_moe_layer(i)])
    adapter = peft_adapter(tmp_path / "adapter", ours, family, max_rank=4)
    expected = merged(ids).logits
    # rows 0 and 2 take the adapter, row 1 none: its tokens, gathered into the experts beside the others', must not
    with feeding(ours, torch_feed([0, None, 0], [adapter.slots], ours)):
        got = ours(ids)[0]
    assert (got[[0, 2]] - expected[[0, 2]]).abs().max() < ATOL
    assert (got[1] - base[1]).abs().max() < 1e-5
    assert (got[0] - base[0]).abs().max() > 100 * ATOL


@torch.no_grad()
def test_latent_attentions_projections_take_adapters_as_peft_merges_them(hf_checkpoint, tmp_path):
    """DeepSeek-V3's latent attention: PEFT adapters on q_a/q_b, the joint latent + RoPE-key projection (whose rows
    kvforge reorders for its RoPE layout) and kv_b, through the family's weight table, equal PEFT's merged model."""
    merged = make_peft_adapter(make_hf_model("deepseek_v3"), tmp_path / "adapter", seed=5, r=3, lora_alpha=4,
                               target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"])
    ours, _ = load(hf_checkpoint("deepseek_v3"))
    ids = _ids(2, 7, seed=3)
    base = ours(ids)[0]
    # kv_b's weight is absorbed per head, never called: a slot there would change nothing, so it is refused
    with pytest.raises(KvforgeError, match="target 'kv_b' takes no slot: latent attention absorbs kv_b"):
        add_slots(ours, ["q_a", "kv_b"])
    make_peft_adapter(make_hf_model("deepseek_v3"), tmp_path / "kv_b", seed=6, r=2, target_modules=["kv_b_proj"])
    add_slots(ours, ["q_a", "q_b", "kv_a", "o"])
    with pytest.raises(KvforgeError, match="kv_b_proj, which has no LoRA slot in this bundle and takes none"):
        peft_adapter(tmp_path / "kv_b", ours, "deepseek_v3", max_rank=4)
    adapter = peft_adapter(tmp_path / "adapter", ours, "deepseek_v3", max_rank=4)
    with feeding(ours, torch_feed([0, 0], [adapter.slots], ours)):
        got = ours(ids)[0]
    assert (got - merged(ids).logits).abs().max() < ATOL
    assert (got - base).abs().max() > 100 * ATOL
