"""Calibration of a mixture of experts: every expert gets activation statistics.

An expert sees only the calibration tokens its router sends it, and a small
calibration set can leave some experts few or none. For each expert the
calibration counts the tokens that reached it; an expert with fewer than
`min_tokens` ("starved") is either

- calibrated on every calibration token, as if the router had sent it all of
  them (statistics only, as NVIDIA Model Optimizer does): its input is the MoE
  layer's input (what the router reads, observed for every token), and its
  down projection's input is computed here from kept rows of it through the
  expert's own gate and up weights; or
- kept in float (`starved="float"`).

The manifest's `calibration.experts` says, per MoE layer and expert, how many
tokens reached it and which of the two happened (or "routed" for an expert
calibrated on its own tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvforge import onnx_graph
from kvforge.errors import KvforgeError
from kvforge.onnx_graph import layer_name

router_choices = onnx_graph.router_choices  # the core's (runtime/ort/moe.py reads it too); benchmarks import it here

EXPERT = re.compile(r"^(?P<moe>layers\.\d+\.ffn)\.experts\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
STARVED = ("all-tokens", "float")
KEEP_ROWS = 4096  # rows of each MoE layer's input kept to compute starved experts' down-projection inputs


@dataclass
class Expert:
    moe: str  # "layers.1.ffn"
    index: int
    gate_up_input: str  # the activation its gate and up projections read (the rows routed to it)
    down_input: str
    gate_weight: str  # initializers, [in, out]
    up_weight: str
    layers: list[str]  # its three linear layers' names


def find_experts(targets) -> list[Expert]:
    found: dict[tuple[str, int], dict] = {}
    for t in targets:
        m = EXPERT.match(t.layer)
        if m:
            found.setdefault((m["moe"], int(m["e"])), {})[m["proj"]] = t
    experts = []
    for (moe, e), parts in sorted(found.items()):
        if set(parts) != {"gate_proj", "up_proj", "down_proj"}:
            continue  # an expert partly excluded by the user: its remaining layers calibrate on their own rows
        experts.append(Expert(moe, e, parts["gate_proj"].activation, parts["down_proj"].activation,
                              parts["gate_proj"].weight, parts["up_proj"].weight, [parts[p].layer for p in parts]))
    return experts


def router_inputs(model, moes: set[str]) -> dict[str, str]:
    """Each MoE layer's input as its router reads it (every token): moe prefix -> activation name."""
    out = {}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            name = layer_name(node)
            if name.endswith(".router") and name[: -len(".router")] in moes:
                out[name[: -len(".router")]] = node.input[0]
    missing = sorted(moes - set(out))
    if missing:
        raise KvforgeError(f"the routers of the MoE layers {missing} were not found in the graph")
    return out


def routing_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The fraction of tokens whose set of chosen experts is the same in both (tokens, k) index arrays."""
    return float(np.mean(np.all(np.sort(reference, axis=-1) == np.sort(candidate, axis=-1), axis=-1)))


def _act(name: str):
    if name == "silu":
        return lambda x: x / (1.0 + np.exp(-x))
    if name == "relu":
        return lambda x: np.maximum(x, 0.0)
    if name == "gelu":  # erf by Abramowitz & Stegun 7.1.26 (error < 1.5e-7): plenty for an amax
        def erf(z):
            t = 1.0 / (1.0 + 0.3275911 * np.abs(z))
            y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-z * z)
            return np.sign(z) * y

        return lambda x: 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))
    return lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))  # gelu_tanh


def cover_starved(experts: list[Expert], observers, routers: dict[str, str], weights, act_amax: dict[str, float],
                  min_tokens: int, starved: str, activation: str, dim: int) -> tuple[dict, list[str]]:
    """Fill starved experts' activation amax from every token (or list their layers to keep in float).

    Returns (the manifest record per MoE layer and expert, the layers to keep in float)."""
    if starved not in STARVED:
        raise KvforgeError(f"starved experts are handled by {STARVED}, not {starved!r}")
    act = _act(activation)
    record: dict[str, dict[str, dict]] = {}
    keep_float: list[str] = []
    inputs: dict[str, np.ndarray] = {}  # each MoE layer's kept input rows, joined once
    for ex in experts:
        tokens = int(observers[ex.gate_up_input].count // dim)
        entry = {"tokens": tokens, "calibrated": "routed"}
        if tokens < min_tokens:
            if starved == "float":
                entry["calibrated"] = "float"
                keep_float += ex.layers
            else:
                if ex.moe not in inputs:
                    rows = observers[routers[ex.moe]].rows
                    inputs[ex.moe] = np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
                x = inputs[ex.moe]
                if not len(x):
                    raise KvforgeError(f"no calibration rows of {ex.moe}'s input to calibrate its starved expert {ex.index}")
                h = act(x @ weights[ex.gate_weight]) * (x @ weights[ex.up_weight])
                act_amax[ex.gate_up_input] = float(observers[routers[ex.moe]].amax)
                act_amax[ex.down_input] = float(np.abs(h).max())
                entry["calibrated"] = "all-tokens"
        record.setdefault(ex.moe, {})[str(ex.index)] = entry
    return record, keep_float
