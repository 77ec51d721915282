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
from kvforge.calibration.auto import SPACES, choose_activations
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


@pytest.fixture(scope="module")
def default_int8(tiny_fp32, tmp_path_factory):
    """tiny calibrated to INT8 by the default (automatic) recipe, once for this file's tests that read it."""
    return calibrate(tiny_fp32.path, tmp_path_factory.mktemp("auto") / "int8", precision="int8", samples=16,
                     seq_len=64)


@pytest.mark.slow
def test_the_default_recipe_is_searched_recorded_and_in_the_graph(tmp_path, tiny_fp32, tiny_heldout, default_int8):
    auto = default_int8
    q, c = auto.manifest["precision"]["quantization"], auto.manifest["calibration"]
    assert q["recipe"] == "auto" and q["smoothquant_alpha"] is None
    r = c["recipe"]
    assert r["measured_on"]["tokens"] > 0 and r["tried"] and r["target"]["perplexity_delta_pct"] == 1.0
    assert r["target"]["kl_divergence_mean"] == pytest.approx(np.log(1.01))  # +1% on the float model's own text
    assert r["met"] == (r["result"]["kl_divergence_mean"] <= np.log(1.01))
    assert r["result"] == {k: r["tried"][-1][k] for k in r["result"]} or r["result"] in [
        {k: t[k] for k in r["result"]} for t in r["tried"]]
    # every space was measured, static and per-token, the fixed recipe's among them, and the best one kept
    firsts = {t["space"]: (t["kl_divergence_mean"], t["perplexity_delta_pct"]) for t in r["tried"]
              if not t["kept_in_float"] and t.get("weight_rounding") != "gptq" and "lm_head" not in t}
    assert set(firsts) == set(SPACES)
    assert r["chosen"]["space"] == min(firsts, key=firsts.get)  # ranked by KL from the float graph, then perplexity
    assert r["result"]["kl_divergence_mean"] <= firsts["max"][0]
    per_token = SPACES[r["chosen"]["space"]].per_token
    assert q["activations"] == ("per-token dynamic" if per_token else "per-tensor static")
    assert q["method"] == (None if per_token else "per-activation search")
    # every activation the graph quantizes has its choice recorded, and each smoothing is a Mul by 1/s in the graph
    chosen = r["chosen"]["activations"]
    assert {a["tensor"] for a in c["scales"]["activations"].values()} == set(chosen)
    graph = onnx.load(str(auto.graph_file)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    smoothed = [n for n in inits if n.endswith(".input_smooth")]
    assert len(smoothed) == sum(v["smoothquant_alpha"] is not None for v in chosen.values())
    for record in c["scales"]["activations"].values():  # the stored scale is the chosen (clipped) range / 127
        assert record["scale"] == "per-token dynamic" if per_token else \
            record["scale"] == pytest.approx(record["amax"] / 127.0, rel=1e-6)
    # against the Torch reference on held-out text: within +1%, and within 0.5 points of the fixed defaults (max, no
    # smoothing: on tiny, which has no outlier channels, both sit near zero and the choice on the calibration text's
    # tail does not transfer beyond that noise; SmolLM2's figures are in benchmarks/features/quantization_smollm2.py)
    fixed = calibrate(tiny_fp32.path, tmp_path / "fixed", precision="int8", samples=16, seq_len=64, recipe="fixed")
    assert fixed.manifest["precision"]["quantization"]["recipe"] == "fixed"
    assert fixed.manifest["calibration"]["recipe"] is None
    chunks = tiny_heldout[:8]
    d_auto, d_fixed = _perplexity_delta(auto.path, "tiny", chunks), _perplexity_delta(fixed.path, "tiny", chunks)
    assert d_auto <= max(d_fixed, 0.0) + 0.5 and d_auto < 1.0, (d_auto, d_fixed)


def test_w8a8_that_misses_its_target_measures_gptq_rounding_in_the_chosen_space(tmp_path, tiny_fp32, monkeypatch):
    """FP8's error is mostly its weights' (E4M3 keeps three mantissa bits): where the best space misses the target,
    that space's weights rounded by GPTQ (against its smoothing) are measured before any layer is kept in float,
    and the better rounding is kept, recorded and stated in the manifest."""
    from kvforge.calibration import auto

    monkeypatch.setitem(auto.TARGET_PPL_PCT, "fp8", -50.0)  # unreachable (a negative KL): every step runs
    monkeypatch.setattr(auto, "FLOAT_BUDGET", 0.0)  # no layer kept in float: step 2 alone
    q = calibrate(tiny_fp32.path, tmp_path / "fp8", precision="fp8", activations="static", samples=16, seq_len=64,
                  quantize_lm_head=False)
    quant, r = q.manifest["precision"]["quantization"], q.manifest["calibration"]["recipe"]
    assert "lm_head" not in r["chosen"] and not any("lm_head" in t for t in r["tried"])  # (float, as asked)
    spaces = [t for t in r["tried"] if t.get("weight_rounding") is None]
    assert [t["space"] for t in spaces] == [name for name, sp in SPACES.items() if not sp.per_token]
    rank = lambda t: (t["kl_divergence_mean"], t["perplexity_delta_pct"])  # noqa: E731
    best_space = min(spaces, key=rank)
    (gptq,) = [t for t in r["tried"] if t.get("weight_rounding") == "gptq"]
    assert r["tried"].index(gptq) == len(spaces) and gptq["space"] == best_space["space"] == r["chosen"]["space"]
    rounding = "gptq" if rank(gptq) < rank(best_space) else "nearest"
    assert r["chosen"]["weight_rounding"] == quant["weight_rounding"] == rounding
    assert (quant["gptq_damp"] is not None) == (rounding == "gptq")
    kept = gptq if rounding == "gptq" else best_space
    assert r["result"]["perplexity_delta_pct"] == kept["perplexity_delta_pct"] and not r["met"]


def test_the_head_is_quantized_by_measurement_and_its_cost_recorded(tmp_path, tiny_fp32, tiny_heldout, monkeypatch,
                                                                   default_int8):
    """The default recipe measures the tied vocabulary projection quantized, in the chosen space, and keeps it
    where the target still holds: the bundle then stores the table once, as codes both the embedding and the
    head read, and its recorded cost is the KL divergence it adds to the float-head candidate. Where nothing
    meets the target, the better of the two is kept, unless the head's own cost is small against the target.
    (--float-lm-head, which keeps it float unmeasured: test_w8a8_that_misses_its_target_...)"""
    from kvforge.calibration import auto

    q = default_int8
    quant, r = q.manifest["precision"]["quantization"], q.manifest["calibration"]["recipe"]
    rank = lambda t: (t["kl_divergence_mean"], t["perplexity_delta_pct"])  # noqa: E731
    (head,) = [t for t in r["tried"] if t.get("lm_head") == "quantized" and not t["kept_in_float"]]
    (plain,) = [t for t in r["tried"] if t.get("space") == head["space"] and "lm_head" not in t
                and not t["kept_in_float"] and t.get("weight_rounding", "nearest") == head["weight_rounding"]]
    assert r["chosen"]["lm_head"]["cost"]["kl_divergence_mean"] == pytest.approx(
        head["kl_divergence_mean"] - plain["kl_divergence_mean"], abs=1e-6)
    assert head["kl_divergence_mean"] <= r["target"]["kl_divergence_mean"]  # tiny's head quantizes well
    assert r["chosen"]["lm_head"]["quantized"] and "lm_head" in quant["quantized_layers"] and r["met"]
    assert q.manifest["calibration"]["scales"]["weights"]["lm_head"]["shared_with_embedding"]
    tables = [i.name for i in onnx.load(str(q.graph_file)).graph.initializer if len(i.dims) == 2 and 4096 in i.dims]
    assert tables[0] == "model.embed_and_lm_head.weight_quantized"  # one table, in codes (and its scales)
    assert all(not t.startswith("lm_head") for t in tables)
    # per-token layers: the head is Q8_0's weight-only blocks (its activation float), which ONNX Runtime's variant
    # evaluates to float at the exact level and keeps as codes feeding the MatMul alone at level 4 (8-bit
    # MatMulNBits, llama.cpp's dot product)
    assert r["chosen"]["space"].startswith("per-token") and r["chosen"]["lm_head"]["form"].startswith("int8 blocks")
    assert quant["int8_layers"] == ["lm_head"]
    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import variant_path

    for level in (0, 4):
        graph = onnx.load(str(variant_path(Bundle(q.path), attention=True, accuracy_level=level))).graph
        inits = {i.name for i in graph.initializer}
        producer = {o: n for n in graph.node for o in n.output}
        weight = producer["logits"].input[1]
        if level == 0:
            assert weight in inits
        else:
            dq = producer[weight]
            assert dq.op_type == "DequantizeLinear" and dict((a.name, a.i) for a in dq.attribute)["block_size"] == 32
    ids = tiny_heldout[:2, :40]
    with runtime.load(q.path, accuracy_level=4) as fast, runtime.load(q.path, variant=False) as exact:
        last, _ = fast.forward(ids, last_logits_only=True)
        full, _ = exact.forward(ids)
    assert metrics.kl_divergence(last[:, 0], full[:, -1]).mean() < 0.01  # level 4: int8 activations per block
    with runtime.load(q.path) as s, runtime.load("tiny") as ref:  # the bundle as ONNX Runtime runs it, against Torch
        kl = [metrics.kl_divergence(a, b).mean() for (a, _), (b, _) in
              zip(window_logits(s, tiny_heldout[:4]), window_logits(ref, tiny_heldout[:4]))]
    assert np.mean(kl) < 3 * r["target"]["kl_divergence_mean"]
    # nothing meets an unreachable target: the better of the two candidates is kept
    monkeypatch.setitem(auto.TARGET_PPL_PCT, "int8", -50.0)
    monkeypatch.setattr(auto, "FLOAT_BUDGET", 0.0)
    q = calibrate(tiny_fp32.path, tmp_path / "missed", precision="int8", activations="per-token", samples=16,
                  seq_len=64)
    r = q.manifest["calibration"]["recipe"]
    (head,) = [t for t in r["tried"] if t.get("lm_head") == "quantized"]
    best = min((t for t in r["tried"] if t.get("weight_rounding", "nearest") == head["weight_rounding"]
                and t["space"] == head["space"]), key=rank)
    assert r["chosen"]["lm_head"]["quantized"] == (best is head) and not r["met"]
    assert ("lm_head" in q.manifest["precision"]["quantization"]["quantized_layers"]) == (best is head)
    # a head whose own cost is within HEAD_COST_SHARE of the target is kept quantized, met or not
    monkeypatch.setitem(auto.TARGET_PPL_PCT, "int8", 1e-4)
    monkeypatch.setattr(auto, "HEAD_COST_SHARE", 1e6)
    monkeypatch.setattr(auto, "FLOAT_BUDGET", 0.10)  # layers kept in float, measured with the head quantized
    q = calibrate(tiny_fp32.path, tmp_path / "cheap", precision="int8", activations="per-token", samples=16,
                  seq_len=64)
    r = q.manifest["calibration"]["recipe"]
    assert r["chosen"]["lm_head"]["quantized"] and not r["met"]
    first = next(i for i, t in enumerate(r["tried"]) if t.get("lm_head"))
    after = r["tried"][first:]  # layers kept in float with the head quantized; no float head searched after it
    assert len(after) > 1 and all(t.get("lm_head") == "quantized" for t in after)


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
    kl = r["result"]["kl_divergence_mean"]
    measured = r["measured_on"]
    assert measured["data"] == "held-out pieces of built-in tiny corpus"  # tiny's own text: pieces kept out of it
    assert (f"on {measured['tokens']} tokens of {measured['data']}: KL {kl:.4f} vs float (target <= "
            f"{np.log(1.04):.4f}: +4.0% perplexity") in " ".join(out.output.split())
    assert r["met"] == (kl <= np.log(1.04))


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


def test_int4_keeps_the_layer_types_that_help_most_per_element_as_int8_within_the_budget():
    """INT4's step 3 (Search.promote): each layer type (v_proj of every layer, ...) measured alone as INT8 blocks,
    then the ones that helped added most gain per element first, within INT8_BUDGET of the weights, until the target
    holds. The measurements here are a stated function of the INT8 set, so the choice can be checked by hand."""
    from kvforge.calibration.auto import INT8_BUDGET, Search

    layers = [f"layers.{i}.{t}" for i in range(4) for t in ("attn.q_proj", "attn.v_proj", "ffn.up_proj", "ffn.down_proj")]
    sizes = {name: {"q_proj": 100, "v_proj": 25, "up_proj": 400, "down_proj": 200}[name.rsplit(".", 1)[1]]
             for name in layers}
    gain = {"attn.q_proj": 0.1, "attn.v_proj": 2.0, "ffn.up_proj": 0.0, "ffn.down_proj": 3.0}  # points per type
    search = Search.__new__(Search)
    search.target, search.tried, search.started, search.time_bound = 4.0, [], 0.0, float("inf")
    search.out_of_time = lambda: False

    def measure(model, what):  # the "model": the INT8 layers' names
        search.tried.append(what)
        ppl = 9.0 - sum(gain[t] for t in {".".join(n.split(".")[2:]) for n in model})
        return {"perplexity_delta_pct": ppl, "kl_divergence_mean": np.log1p(ppl / 100)}  # met at ppl <= 4.0

    search.measure = measure
    result, metrics_, kept = search.promote(lambda int8: (list(int8),), ([],),
                                            {"perplexity_delta_pct": 9.0, "kl_divergence_mean": np.log1p(0.09)}, sizes)
    total = sum(sizes.values())
    assert 4 * (25 + 200) <= INT8_BUDGET * total < 4 * 400  # v_proj and down_proj fit the budget together, up_proj not
    # each type measured alone (up_proj, 1600 of 2900 elements, is over the budget: never tried)
    alone = [w["int8_layers"] for w in search.tried if len(w["int8_layers"]) == 1]
    assert sorted(t for (t,) in alone) == ["layers.*.attn.q_proj", "layers.*.attn.v_proj", "layers.*.ffn.down_proj"]
    # v_proj gains most per element, then down_proj; together they meet the target (9 - 5 = 4), so q_proj is not added
    assert search.tried[-1]["int8_layers"] == ["layers.*.attn.v_proj", "layers.*.ffn.down_proj"]
    assert sorted(kept) == sorted(n for n in layers if n.endswith(("v_proj", "down_proj")))
    assert metrics_["perplexity_delta_pct"] == pytest.approx(4.0) and search.meets(metrics_)


def test_int4_with_zero_points_keeps_int8_layer_types_and_runs_as_the_dequantized_float_graph(tmp_path, tiny_fp32,
                                                                                            tiny_heldout, monkeypatch):
    """The automatic INT4 recipe (zero points: ONNX Runtime's form) with a target no candidate meets goes through
    every block candidate and step 3: layer types kept as INT8 blocks. The bundle's graph holds signed INT4 codes
    with a scale and a float offset per block (a minimum each) and block-wise INT8 codes for the promoted layers; on
    ONNX Runtime (the runtime's variant: INT8 blocks as float weights) it computes the float graph with each weight
    replaced by its codes dequantized here from the definition, q * s + offset."""
    import ml_dtypes

    from kvforge.calibration import auto
    from kvforge.calibration.qdq import find_targets
    from kvforge.ort_session import make_session, prefill_feeds
    from kvforge.tensorrt_env import check_precision_supported

    monkeypatch.setitem(auto.TARGET_PPL_PCT, "int4", -50.0)  # unreachable (a negative KL): every step runs
    q = calibrate(tiny_fp32.path, tmp_path / "int4", precision="int4", zero_points=True, samples=16, seq_len=64,
                  quantize_lm_head=False)  # (the layers' forms here; the head's: test_the_head_is_quantized_...)
    quant, r = q.manifest["precision"]["quantization"], q.manifest["calibration"]["recipe"]
    assert quant["zero_points"] is True and quant["weights"] == "block-wise with minimums" and not r["met"]
    blocks_tried = [t for t in r["tried"] if "weight_rounding" in t]
    assert [(t["block_size"], t["weight_rounding"]) for t in blocks_tried] == list(
        (b, "gptq" if g else "nearest") for b, g in auto.INT4_CANDIDATES)
    promoted = quant["int8_layers"]
    assert promoted and promoted == r["chosen"]["int8_layers"]
    types = {t["int8_layers"][0] for t in r["tried"] if len(t.get("int8_layers", [])) == 1}
    assert types and all("*" in t for t in types)  # measured per layer type
    best = min(r["tried"], key=lambda t: (t["kl_divergence_mean"], t["perplexity_delta_pct"]))
    assert r["result"]["kl_divergence_mean"] == best["kl_divergence_mean"]
    assert not q.manifest["lint"]["passed"]  # TensorRT takes neither; the build is refused, naming the way out
    with pytest.raises(KvforgeError, match="--no-zero-points"):
        check_precision_supported(quant, "9.0", "H100")

    g = onnx.load(str(q.graph_file)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    block = quant["block_size"]
    dequantized = {}
    for layer in quant["quantized_layers"]:
        codes, scale = inits[f"{layer}.weight_quantized"], inits[f"{layer}.weight_scale"]
        if layer in promoted:
            assert codes.dtype == np.int8 and f"{layer}.weight_zero_point" not in inits
            steps = np.repeat(scale, auto.PROMOTED_BLOCK, 0)[:len(codes)]
            dequantized[layer] = codes.astype(np.float32) * steps
        else:
            offset = inits[f"{layer}.weight_offset"]
            assert codes.dtype == ml_dtypes.int4 and f"{layer}.weight_zero_point" not in inits
            assert offset.shape == scale.shape and offset.dtype == np.float32
            dequantized[layer] = codes.astype(np.float32) * np.repeat(scale, block, 0)[:len(codes)] \
                + np.repeat(offset, block, 0)[:len(codes)]
    reference = onnx.load(str(tiny_fp32.graph_file))
    targets, _ = find_targets(reference)
    weights = {i.name: i for i in reference.graph.initializer}
    for t in targets:
        k = weights[t.weight].dims[0]
        weights[t.weight].CopyFrom(numpy_helper.from_array(dequantized[t.layer][:k], t.weight))
    ids = tiny_heldout[:2, :64].copy()
    (theirs,) = make_session(reference.SerializeToString()).run(
        ["logits"], prefill_feeds(ids, tiny_fp32.model_config, tiny_fp32.io, "float32"))
    from kvforge.runtime.ort.variant import variant_path

    with runtime.load(q.path) as fast:
        read = {i for n in onnx.load(str(variant_path(q))).graph.node for i in n.input}
        assert not read & {f"{layer}.weight_quantized" for layer in promoted}  # the variant's are float weights
        assert any(i.endswith("_quantized") for i in read)  # the INT4 codes stay codes (MatMulNBits)
        np.testing.assert_allclose(fast.forward(ids)[0], theirs, rtol=0, atol=2e-4)
