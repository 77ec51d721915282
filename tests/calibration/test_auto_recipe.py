"""The default calibration recipe (calibration/auto.py): chosen by measurement, recorded, overridable."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from kvforge import metrics, runtime
from kvforge.calibration import calibrate
from kvforge.calibration.auto import choose_activations
from kvforge.calibration.observers import TensorObserver
from kvforge.calibration.qdq import Target
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.runtime.evaluate import window_logits


def _int8_output_error(x, w, s, amax):
    """Plain numpy W8A8 (per-tensor activation, per-output-channel weight, round half to even): the oracle."""
    xs, ws = (x / s, w * s[:, None]) if s is not None else (x, w)
    step_w = np.abs(ws).max(axis=0) / 127.0
    wq = np.clip(np.rint(ws / step_w), -128, 127) * step_w
    step_x = np.float32(amax / 127.0)
    xq = np.clip(np.rint(xs / step_x), -128, 127) * step_x
    y = x @ w
    return float(np.sum((xq @ wq - y) ** 2) / np.sum(y * y))


def test_the_search_beats_a_plain_scale_on_an_outlier_channel_and_records_its_error():
    """One input channel 100x the others (a real LLM's outlier): the plain per-tensor scale loses the rest; the
    chosen smoothing and clipping must cut the output error tenfold, and the error it records must be what plain
    numpy computes for that choice."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    x[:, 3] *= 100.0
    w = (0.1 * rng.standard_normal((64, 48))).astype(np.float32)
    obs = TensorObserver("a")
    obs.observe_range(x)
    obs.sampled.append(x)
    channel_amax = np.abs(x).max(axis=0)
    targets = [Target(None, "layers.0.ffn.up_proj", "w", "a")]
    amax, smooth, chosen = choose_activations(targets, {"w": w}, {"a": obs}, {"a": channel_amax}, "int8", np.float32,
                                              lambda *a: None)
    plain = _int8_output_error(x, w, None, float(np.abs(x).max()))
    c = chosen["a"]
    assert c["output_error"] < plain / 10, (c, plain)
    s = smooth.get("a")
    if c["smoothquant_alpha"] is not None:
        expected = channel_amax ** c["smoothquant_alpha"] / np.abs(w).max(axis=1) ** (1 - c["smoothquant_alpha"])
        np.testing.assert_allclose(s, expected, rtol=1e-5)
    assert c["output_error"] == pytest.approx(_int8_output_error(x, w, s, amax["a"]), rel=1e-3)
    assert c["layer_errors"]["layers.0.ffn.up_proj"] == pytest.approx(c["output_error"], rel=1e-6)


def _perplexity_delta(bundle, reference, chunks):
    with runtime.load(bundle) as s, runtime.load(reference) as r:
        nll, ref_nll = [], []
        for (cand, targets), (ref, _) in zip(window_logits(s, chunks), window_logits(r, chunks)):
            nll.append(-np.take_along_axis(metrics.log_softmax(cand), targets[..., None], -1).ravel())
            ref_nll.append(-np.take_along_axis(metrics.log_softmax(ref), targets[..., None], -1).ravel())
    return 100 * (np.exp(np.mean(np.concatenate(nll)) - np.mean(np.concatenate(ref_nll))) - 1)


@pytest.mark.slow
def test_the_default_recipe_is_searched_recorded_and_in_the_graph(tmp_path, tiny_fp32, tiny_heldout):
    auto = calibrate(tiny_fp32.path, tmp_path / "auto", precision="int8", samples=32, seq_len=128)
    q, c = auto.manifest["precision"]["quantization"], auto.manifest["calibration"]
    assert q["recipe"] == "auto" and q["method"] == "per-activation search" and q["smoothquant_alpha"] is None
    r = c["recipe"]
    assert r["measured_on"]["tokens"] > 0 and r["tried"] and r["target"]["perplexity_delta_pct"] == 1.0
    assert r["result"] == {k: r["tried"][-1][k] for k in r["result"]} or r["result"] in [
        {k: t[k] for k in r["result"]} for t in r["tried"]]
    # the three spaces were measured, the fixed recipe's among them, and the best one kept
    firsts = {t["space"]: t["perplexity_delta_pct"] for t in r["tried"] if not t["kept_in_float"]}
    assert set(firsts) == {"smoothed and clipped", "clipped", "max"}
    assert r["chosen"]["space"] == min(firsts, key=firsts.get)
    assert r["result"]["perplexity_delta_pct"] <= firsts["max"]
    # every activation the graph quantizes has its choice recorded, and each smoothing is a Mul by 1/s in the graph
    chosen = r["chosen"]["activations"]
    assert {a["tensor"] for a in c["scales"]["activations"].values()} == set(chosen)
    graph = onnx.load(str(auto.graph_file)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    smoothed = [n for n in inits if n.endswith(".input_smooth")]
    assert len(smoothed) == sum(v["smoothquant_alpha"] is not None for v in chosen.values())
    for record in c["scales"]["activations"].values():  # the stored scale is the chosen (clipped) range / 127
        assert record["scale"] == pytest.approx(record["amax"] / 127.0, rel=1e-6)
    # against the Torch reference on held-out text: within +1%, and within 0.5 points of the fixed defaults (max, no
    # smoothing: on tiny, which has no outlier channels, both sit near zero and the choice on the calibration text's
    # tail does not transfer beyond that noise; SmolLM2's figures are in benchmarks/quantization_smollm2.py)
    fixed = calibrate(tiny_fp32.path, tmp_path / "fixed", precision="int8", samples=32, seq_len=128, recipe="fixed")
    assert fixed.manifest["precision"]["quantization"]["recipe"] == "fixed"
    assert fixed.manifest["calibration"]["recipe"] is None
    chunks = tiny_heldout[:8]
    d_auto, d_fixed = _perplexity_delta(auto.path, "tiny", chunks), _perplexity_delta(fixed.path, "tiny", chunks)
    assert d_auto <= max(d_fixed, 0.0) + 0.5 and d_auto < 1.0, (d_auto, d_fixed)


def test_the_recipe_mode_is_stated_not_inferred_from_tuning_options(tmp_path, tiny_fp32):
    q = calibrate(tiny_fp32.path, tmp_path / "mse", precision="fp8", recipe="fixed", method="mse", samples=8, seq_len=64)
    assert q.manifest["precision"]["quantization"]["recipe"] == "fixed"
    assert q.manifest["precision"]["quantization"]["method"] == "mse" and q.manifest["calibration"]["recipe"] is None
    # a tuning option under the default (auto) is refused before any work, naming the mode that takes it
    with pytest.raises(KvforgeError, match=r"the automatic recipe \(the default\) chooses what --method would fix; "
                                           r"add --recipe fixed"):
        calibrate(tiny_fp32.path, tmp_path / "y", precision="fp8", method="mse", samples=8, seq_len=64)
    assert not (tmp_path / "y").exists()
    with pytest.raises(KvforgeError, match="--recipe auto chooses what --smoothquant, --gptq would fix; add --recipe fixed"):
        calibrate(tiny_fp32.path, tmp_path / "x", precision="int8", recipe="auto", smoothquant=0.5, gptq=True)
    with pytest.raises(KvforgeError, match="--recipe 'best' is not one of"):
        calibrate(tiny_fp32.path, tmp_path / "x", precision="int8", recipe="best")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_int4_picks_a_block_size_by_measurement_and_the_cli_prints_the_choice(tmp_path, tiny_fp32):
    out = CliRunner().invoke(main, ["calibrate", str(tiny_fp32.path), "-o", str(tmp_path / "int4"), "--precision", "int4",
                                    "--samples", "16", "--seq-len", "128", "--quiet"])
    assert out.exit_code == 0, out.output
    m = onnx.load(str(tmp_path / "int4" / "model.onnx"))
    from kvforge.bundle import Bundle

    b = Bundle(tmp_path / "int4")
    q, r = b.manifest["precision"]["quantization"], b.manifest["calibration"]["recipe"]
    assert r["chosen"]["block_size"] == q["block_size"] and q["weight_rounding"] == r["chosen"]["weight_rounding"]
    blocks = {a.i for n in m.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "block_size"}
    assert blocks == {q["block_size"]}
    tried = [(t["block_size"], t["weight_rounding"]) for t in r["tried"]]
    assert tried[0] == (128, "nearest") and (q["block_size"], q["weight_rounding"]) in tried
    assert f"recipe auto: block {q['block_size']}, {q['weight_rounding']} rounding" in out.output
    assert "held-out calibration tokens: perplexity" in out.output


def test_the_held_out_text_comes_from_every_part_of_the_corpus(tmp_path, tiny_fp32):
    """The automatic recipe measures its choices on held-out pieces spread over the whole corpus (a corpus's tail
    is only its last text), and none of them is calibrated on."""
    from kvforge.calibration import load_calibration_set
    from kvforge.texts import builtin_prose
    from kvforge.tokenizer import Tokenizer

    (botchan, constitution), _ = builtin_prose("calibration")
    first, second = botchan[:30000], constitution[:6000]  # the second text is a sixth of the corpus
    data = tmp_path / "two.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in (first, second)))
    tok = Tokenizer.from_file(tiny_fp32.tokenizer_file)
    stream = tok.encode(first) + tok.encode(second)
    cset = load_calibration_set(tiny_fp32, data, samples=64, seq_len=128, hold_out=1024)
    held = cset.held_out
    assert len(held) == 1024
    pieces = [held[i:i + 128] for i in range(0, len(held), 128)]
    starts = [next(s for s in range(len(stream) - 127) if stream[s:s + 128] == p) for p in pieces]
    boundary = len(tok.encode(first))
    assert min(starts) < boundary / 4 and max(starts) >= boundary  # both texts, from the start to the end
    held_runs = {tuple(held[i:i + 32]) for i in range(len(held) - 31)}  # prose repeats no 32-token run
    for sample in cset.samples.tolist():  # no calibration window reads held-out text
        assert not any(tuple(sample[i:i + 32]) in held_runs for i in range(len(sample) - 31))
