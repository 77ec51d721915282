"""The Torch reference backend. Torch and model_defs are imported only when it activates."""

from __future__ import annotations

import numpy as np

from kvforge.errors import KvforgeError, MissingDependencyError

from .backend import Backend, KVCache


class TorchBackend(Backend):
    """Runs the kvforge reference model built from `source` (a preset, checkpoint or HF directory)."""

    name = "torch"
    option_names = ("device", "source (for a bundle)", "dtype (for a model source)")

    def __init__(self, config, io, source, dtype: str = "float32", device: str = "cpu", **options):
        super().__init__(config, io, **options)
        if not isinstance(device, str) or not (device == "cpu" or device.split(":")[0] == "cuda"):
            raise KvforgeError(f"torch device {device!r} is not 'cpu' or 'cuda[:N]'")
        self.source = source
        self.dtype = dtype
        self.device = device
        self.model = None

    def activate_impl(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise MissingDependencyError("PyTorch (for the torch backend)", "Install it with `bash scripts/install.sh`.") from e
        from kvforge.model_defs import load  # torch: imported on activation only (module docstring)

        if self.device != "cpu" and not torch.cuda.is_available():
            raise KvforgeError(f"torch device {self.device!r}: this PyTorch build sees no CUDA device; use device='cpu'")
        self._torch = torch
        model, _ = load(self.source, dtype=self.dtype)
        if model.config.to_dict() != self.config:
            raise KvforgeError(f"the source {self.source!r} builds a model whose config differs from the bundle's")
        lora = self.io.extra.get("lora")
        if lora:  # the bundle's LoRA slots on the reference (model_defs/lora.py), fed what the graph is fed
            from kvforge.model_defs.lora import add_slots

            add_slots(model, lora["targets"])
        self.model = model.to(self.device)

    def deactivate_impl(self) -> None:
        self.model = None

    def empty_cache_impl(self, batch: int):
        return [t for kv in self.model.empty_cache(batch) for t in kv]

    def forward_impl(self, input_ids, attention_mask, position_ids, cache: KVCache, last_only: bool, inputs=None):
        torch = self._torch
        dev = self.device
        past, at = [], 0
        for layer in self.io.past:  # per layer: (key, value), or (latent,)
            past.append(tuple(cache.values[at:at + len(layer)]))
            at += len(layer)
        with torch.inference_mode(), self._feeding(inputs):
            logits, present = self.model(
                torch.from_numpy(input_ids).to(dev),
                torch.from_numpy(attention_mask).to(dev),
                torch.from_numpy(position_ids).to(dev),
                tuple(past),
            )
        values = [t for kv in present for t in kv]
        if last_only:
            logits = logits[:, -1:]
        return logits.float().cpu().numpy(), KVCache(self.name, cache.batch, cache.length + input_ids.shape[1], values)

    def merge_lora(self, slots) -> None:
        """W += (A B)^T for each slot (module name) of an adapter: the model with the adapter merged, as PEFT's
        merge_and_unload makes it."""
        self.check_active()
        torch = self._torch
        with torch.no_grad():
            for slot, (a, b) in slots.items():
                weight = self.model.get_submodule(slot).weight
                delta = torch.from_numpy(np.asarray(a, np.float64) @ np.asarray(b, np.float64)).T
                weight.add_(delta.to(weight.dtype).to(weight.device))

    def _feeding(self, inputs):
        """The step's LoRA inputs (runtime/step_inputs.py) as the reference's slots take them."""
        import contextlib

        if inputs is None:
            return contextlib.nullcontext()
        if inputs.token_rows or inputs.per_token:
            raise KvforgeError(f"the torch backend runs a decoder's reference model, which takes no "
                               f"{sorted({**inputs.token_rows, **inputs.per_token})}: run it on onnxruntime")
        if inputs.adapter_rows is None:
            return contextlib.nullcontext()
        from kvforge.adapters import slot_input_names
        from kvforge.model_defs.lora import LoraFeed, feeding

        torch, dev, lora = self._torch, self.device, inputs.adapter_weights
        weights = {}
        for slot in self.model.lora_slots:
            a, b = slot_input_names(slot)
            weights[slot] = (torch.from_numpy(lora[a]).to(dev), torch.from_numpy(lora[b]).to(dev))
        return feeding(self.model, LoraFeed(torch.from_numpy(inputs.adapter_rows).to(dev), weights))

    def drop_oldest_impl(self, values, drops):
        return [v[:, :, n:].contiguous() if n else v for v, n in zip(values, drops)]

    def slice_impl(self, value, start: int, stop: int):
        return value[:, :, start:stop]

    def join_impl(self, first, second):
        return self._torch.cat([first, second], dim=2)

    def to_numpy(self, value) -> np.ndarray:
        return value.float().cpu().numpy()

    def from_numpy_impl(self, arrays):  # to_numpy gave float32; the cast back is exact
        dtype = getattr(self._torch, self.dtype)
        return [self._torch.from_numpy(a).to(self.device, dtype) for a in arrays]
