"""How much top-1 agreement W8A8 FP8 E4M3 can keep on `tiny`, whatever the calibration method.

E4M3 rounds every value to 3 mantissa bits: a relative error that no scale
changes. This script separates where tiny's FP8 error comes from, over the
full held-out corpus, against the FP32 Torch reference:

- activations alone (weights exact), weights alone, both;
- each with and without a randomized Hadamard rotation of every linear's
  input (x -> xR, W -> R^T W: QuaRot/SpinQuant-style incoherence processing),
  the one transform that changes what E4M3 rounds;
- how often FP32's own top-2 logits are nearly tied (where rounding flips
  the argmax).

FP8 rounding is simulated in Torch (float8_e4m3fn casts: round to nearest
even, saturated at +-448, as ONNX QuantizeLinear with saturate=1) with the
recipe's scales: per-output-channel weights, one per-tensor activation
scale from the calibration corpus's amax (128 x 256 tokens, as `kvforge
calibrate`). The simulation is checked against the real FP8 bundle
(`calibrate --precision fp8 --method max`, run on ONNX Runtime).

    python3 -m benchmarks.features.fp8_headroom_tiny [--out benchmarks/results/fp8_headroom_tiny.json]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

FP8_MAX = 448.0


def fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def hadamard_rotation(k: int, generator: torch.Generator) -> torch.Tensor:
    """Orthogonal K x K: random signs times block-diagonal Sylvester Hadamard blocks (largest power of 2 dividing K)."""
    b = k & -k
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (k,), generator=generator).float() * 2 - 1
    return signs[:, None] * torch.block_diag(*[h / math.sqrt(b)] * (k // b))


class SimulatedFP8:
    """Forward pre-hooks on every nn.Linear but the vocabulary projection (the recipe's default)."""

    def __init__(self, model: torch.nn.Module, calibration: torch.Tensor, rotate: bool, seed: int = 0):
        self.model = model
        self.linears = [(n, m) for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
        g = torch.Generator().manual_seed(seed)
        self.rotation = {n: hadamard_rotation(m.in_features, g) if rotate else None for n, m in self.linears}
        self.weight = {n: m.weight.data.clone() for n, m in self.linears}
        self.amax = {n: torch.zeros(()) for n, _ in self.linears}
        hooks = [m.register_forward_pre_hook(self._observe(n)) for n, m in self.linears]
        with torch.no_grad():
            for i in range(0, len(calibration), 8):
                model(calibration[i : i + 8])
        for h in hooks:
            h.remove()

    def _rotated(self, name, x):
        r = self.rotation[name]
        return x if r is None else x @ r

    def _observe(self, name):
        def hook(module, inputs):
            self.amax[name] = torch.maximum(self.amax[name], self._rotated(name, inputs[0]).abs().max())
        return hook

    def _quantize_input(self, name, on: bool):
        scale = self.amax[name] / FP8_MAX

        def hook(module, inputs):
            x = self._rotated(name, inputs[0])
            return (fp8(x, scale) if on else x,)
        return hook

    def apply(self, activations: bool, weights: bool):
        """Returns a callable that undoes it."""
        hooks = []
        for n, m in self.linears:
            w = self.weight[n] if self.rotation[n] is None else self.weight[n] @ self.rotation[n]  # y = (xR)(WR)^T
            if weights:
                w = fp8(w, w.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX)
            m.weight.data = w
            hooks.append(m.register_forward_pre_hook(self._quantize_input(n, activations)))

        def undo():
            for h in hooks:
                h.remove()
            for n, m in self.linears:
                m.weight.data = self.weight[n]
        return undo


def agreement(model, inputs: torch.Tensor, reference: list[np.ndarray], batch: int = 16) -> tuple[float, float]:
    from kvforge import metrics

    agree, kl = [], []
    with torch.no_grad():
        for i, ref in zip(range(0, len(inputs), batch), reference):
            logits = model(inputs[i : i + batch])
            logits = (logits[0] if isinstance(logits, tuple) else logits).numpy()
            agree.append(logits.argmax(-1) == ref.argmax(-1))
            kl.append(metrics.kl_divergence(logits, ref).ravel())
    return float(np.concatenate([a.ravel() for a in agree]).mean()), float(np.concatenate(kl).mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "fp8_headroom_tiny.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import metrics, runtime
    from kvforge.calibration import calibrate
    from kvforge.calibration.data import load_calibration_set
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import load
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.runtime.evaluate import window_logits, windows
    from kvforge.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = load("tiny").model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export("tiny", Path(tmp) / "fp32")
        tok = Tokenizer.from_file(fp32.tokenizer_file)
        chunks = windows(tok.encode(heldout_text(), add_special_tokens=False), 256)
        calibration = torch.from_numpy(load_calibration_set(fp32).samples)
        inputs = torch.from_numpy(np.ascontiguousarray(chunks[:, :-1]))
        with torch.no_grad():
            reference = []
            for i in range(0, len(inputs), 16):
                out = model(inputs[i : i + 16])
                reference.append((out[0] if isinstance(out, tuple) else out).numpy())
        # the real FP8 bundle on ONNX Runtime, against the same Torch reference
        q = calibrate(fp32.path, Path(tmp) / "fp8", recipe="fixed", precision="fp8", method="max")
        with runtime.load(q.path) as s:
            bundle_logits = np.concatenate([lg for lg, _ in window_logits(s, chunks)])
    ref = np.concatenate(reference)
    real = {"top1_agreement": metrics.top1_agreement(bundle_logits, ref),
            "kl_divergence_mean": float(metrics.kl_divergence(bundle_logits, ref).mean())}

    top2 = np.sort(ref, axis=-1)[..., -2:]
    margin = (top2[..., 1] - top2[..., 0]).ravel()
    rows = []
    for rotate in (False, True):
        sim = SimulatedFP8(model, calibration, rotate)
        for activations, weights in ((True, False), (False, True), (True, True)):
            undo = sim.apply(activations, weights)
            t = time.perf_counter()
            top1, kl = agreement(model, inputs, reference)
            undo()
            what = {(True, False): "activations only", (False, True): "weights only", (True, True): "weights and activations"}
            rows.append({"quantized": what[activations, weights], "hadamard_rotation": rotate,
                         "top1_agreement": top1, "kl_divergence_mean": kl, "seconds": time.perf_counter() - t})
            print(f"{rows[-1]['quantized']:24s} rotation {'on ' if rotate else 'off'}  top-1 {top1:.4f}  KL {kl:.5f}", flush=True)
    result = {
        "benchmark": "fp8_headroom_tiny", "corpus": "tiny held-out", "tokens": int(inputs.numel()),
        "reference": "FP32 Torch", "simulation": rows,
        "real_fp8_bundle_max_rtn": real,
        "fp32_top2_margin": {"median": float(np.median(margin)),
                             "fraction_below": {str(t): float((margin < t).mean()) for t in (0.05, 0.1, 0.25)},
                             "median_top1_probability": float(np.median(np.exp(metrics.log_softmax(ref)).max(-1)))},
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    sim_both = next(r for r in rows if r["quantized"] == "weights and activations" and not r["hadamard_rotation"])
    print(f"real FP8 bundle (max, round to nearest) on ONNX Runtime: top-1 {real['top1_agreement']:.4f} "
          f"(simulation {sim_both['top1_agreement']:.4f})")
    print(f"FP32 top-2 logit margin: median {result['fp32_top2_margin']['median']:.3f}, "
          f"{100 * result['fp32_top2_margin']['fraction_below']['0.1']:.1f}% of positions below 0.1")
    write_result("fp8_headroom_tiny", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
