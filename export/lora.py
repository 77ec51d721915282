"""`kvforge lora add`: a PEFT LoRA adapter into a bundle's slots (kvforge/adapters.py stores it).

The bundle's model is rebuilt from its manifest on torch's meta device (shapes only, no weights), given the
bundle's slots, and the adapter is read through its Hugging Face family's weight table
(model_defs/lora.py: peft_adapter); nothing of the bundle is written but adapters/NAME.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvforge.adapters import AdapterInfo, lora_spec, write_adapter
from kvforge.bundle import Bundle
from kvforge.ecosystem import HF_CONFIG
from kvforge.errors import KvforgeError
from kvforge.model_defs.architectures import build, config_from_dict
from kvforge.model_defs.lora import add_slots, peft_adapter


def _skeleton(bundle: Bundle, spec: dict) -> torch.nn.Module:
    """The bundle's model with its slots, on the meta device."""
    cfg = config_from_dict(bundle.manifest["model"])
    with torch.device("meta"):
        model = build(cfg)
    slots = add_slots(model, spec["targets"])
    if sorted(slots) != sorted(spec["slots"]):
        raise KvforgeError(f"{bundle.path}: its manifest's LoRA slots do not match its model's {spec['targets']} "
                           "layers (a damaged manifest?)")
    return model


def add_adapter(bundle_path: str | Path, adapter: str | Path, name: str, force: bool = False) -> AdapterInfo:
    """Validate the PEFT adapter directory `adapter` against the bundle and store it as `name`."""
    bundle = Bundle(bundle_path)
    spec = lora_spec(bundle)
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise KvforgeError(f"{adapter} is not a directory (a PEFT adapter: adapter_config.json and "
                           "adapter_model.safetensors)")
    model = _skeleton(bundle, spec)
    family = bundle.manifest["model"].get("family")
    hf_config = _base_config(bundle)
    converted = peft_adapter(adapter, model, family, hf_config, max_rank=spec["max_rank"])
    slots = {s: (a.numpy(), b.numpy()) for s, (a, b) in converted.slots.items()}
    record = {"source": str(adapter.resolve()), "peft": {k: converted.config.get(k) for k in (
        "base_model_name_or_path", "r", "lora_alpha", "use_rslora", "target_modules", "fan_in_fan_out")}}
    return write_adapter(bundle, name, slots, record, force=force)


def _base_config(bundle: Bundle) -> dict:
    """The Hugging Face config.json the bundle was exported from, where it kept one (some weight tables read it)."""
    path = bundle.path / HF_CONFIG
    if path.is_file() and HF_CONFIG in bundle.manifest["files"]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
    return {}
