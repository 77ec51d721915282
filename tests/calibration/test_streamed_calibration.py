"""Calibration that keeps the float weights on disk: the graph is read without its data, each weight when it is
quantized, the sessions map the bundle's data file, a batch's activations run in parts, and the written bundle
copies the weights that stayed float from the input's data file (docs/design.md, Calibration's memory)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from kvforge.bundle import MANIFEST, Bundle, write_manifest
from kvforge.calibration import calibrate, passes
from kvforge.onnx_graph import save_with_data


def _with_external_data(bundle: Bundle, out) -> Bundle:
    """The same bundle with its weights in model.onnx.data (as a large export writes it), manifest rewritten."""
    shutil.copytree(bundle.path, out)
    model = onnx.load(str(out / bundle.manifest["graph"]))
    onnx.save(model, str(out / bundle.manifest["graph"]), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    manifest = {k: v for k, v in bundle.manifest.items() if k not in ("format", "format_version", "files")}
    (out / MANIFEST).unlink()
    write_manifest(out, manifest)
    return Bundle(out)


def _initializers(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))  # onnx's own reader, external data and all
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("precision,options", [("int8", {"recipe": "fixed", "smoothquant": 0.5, "method": "percentile"}),
                                               ("int4", {"recipe": "fixed", "block_size": 32})])
def test_weights_on_disk_calibrate_as_weights_in_the_graph(tiny_fp32, tmp_path, precision, options):
    """A bundle whose weights lie in its data file calibrates to the same graph, bit for bit, as the same bundle
    with its weights in the graph; its calibrated graph keeps a data file too, the weights that stayed float
    copied from the input's, and onnx reads every tensor back equal."""
    external = _with_external_data(tiny_fp32, tmp_path / "external")
    assert (external.path / "model.onnx.data").stat().st_size > 0.9 * sum(
        a.nbytes for a in _initializers(tiny_fp32.graph_file).values())
    kw = dict(precision=precision, samples=8, seq_len=64, **options)
    inline = calibrate(tiny_fp32.path, tmp_path / "inline", **kw)
    streamed = calibrate(external.path, tmp_path / "streamed", **kw)
    assert (streamed.path / "model.onnx.data").is_file() and not (inline.path / "model.onnx.data").exists()
    assert streamed.manifest["calibration"]["scales"] == inline.manifest["calibration"]["scales"]
    a, b = _initializers(inline.graph_file), _initializers(streamed.graph_file)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    ids = np.arange(1, 33, dtype=np.int64)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(32)[None]}
    outs = []
    for bundle in (inline, streamed):
        sess = ort.InferenceSession(str(bundle.graph_file), providers=["CPUExecutionProvider"])
        io = bundle.io
        extra = {n: np.zeros(io.empty_shape(n, 1), np.float32) for layer in io.past for n in layer}
        outs.append(sess.run(["logits"], {**{k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}},
                                          **extra})[0])
    assert np.array_equal(outs[0], outs[1])


def test_a_batch_run_in_parts_gives_the_batch_scales(tiny_fp32, tmp_path, monkeypatch):
    """A batch whose activations pass the probe's run bound runs in parts of fewer rows; the observers are
    order-independent, so the scales are those of the batch run whole."""
    kw = dict(recipe="fixed", precision="int8", method="percentile", smoothquant=0.5, samples=12, seq_len=64, batch_size=12)
    whole = calibrate(tiny_fp32.path, tmp_path / "whole", **kw)
    rows = []
    run_feeds = passes.Probe.run_feeds

    def counting(self, feeds):
        rows.append(feeds["input_ids"].shape[0])
        return run_feeds(self, feeds)

    monkeypatch.setattr(passes.Probe, "run_feeds", counting)
    monkeypatch.setattr(passes, "RUN_BYTES", 5 * 64 * 4 * 1024)  # tiny's activations: a few rows per run
    parts = calibrate(tiny_fp32.path, tmp_path / "parts", **kw)
    assert rows and max(rows) < 12 and sum(rows) == 2 * 12  # observation and the histogram pass, in parts
    a, b = whole.manifest["calibration"]["scales"], parts.manifest["calibration"]["scales"]
    assert a["weights"] == b["weights"]
    for name, act in a["activations"].items():
        assert b["activations"][name]["amax"] == pytest.approx(act["amax"], rel=1e-6), name


def test_a_graph_is_written_with_its_weights_moved_and_copied(tmp_path):
    """save_with_data: weights held in the graph move to the data file, those in another file are copied in
    pieces, small ones stay in the graph; onnx reads them all back equal and ONNX Runtime runs the result."""
    rng = np.random.default_rng(0)
    w_inline = rng.standard_normal((300, 700)).astype(np.float32)  # over 1 MB: aligned
    w_far = rng.standard_normal((700, 5)).astype(np.float32)
    bias = np.arange(5, dtype=np.float32)
    source = tmp_path / "source"
    source.mkdir()
    far = numpy_helper.from_array(w_far, "w_far")
    far_model = helper.make_model(helper.make_graph([], "g", [], [], [far]))
    onnx.save(far_model, str(source / "far.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    far = onnx.load(str(source / "far.onnx"), load_external_data=False).graph.initializer[0]
    nodes = [helper.make_node("MatMul", ["x", "w_inline"], ["h"]), helper.make_node("MatMul", ["h", "w_far"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 300])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2, 5])],
                              [numpy_helper.from_array(w_inline, "w_inline"), far, numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = tmp_path / "out"
    out.mkdir()
    save_with_data(model, out / "model.onnx", source, "model.onnx.data")
    assert (out / "model.onnx").stat().st_size < 4096  # the graph file holds the small tensor alone
    back = _initializers(out / "model.onnx")
    assert np.array_equal(back["w_inline"], w_inline) and np.array_equal(back["w_far"], w_far)
    assert np.array_equal(back["bias"], bias)
    stored = {i.name: {e.key: e.value for e in i.external_data}
              for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert stored["bias"] == {} and int(stored["w_inline"]["offset"]) % 65536 == 0
    x = rng.standard_normal((2, 300)).astype(np.float32)
    y = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, (x.astype(np.float64) @ w_inline @ w_far) + bias, rtol=1e-4, atol=1e-3)
    with pytest.raises(FileExistsError):  # nothing already written is overwritten
        save_with_data(model, out / "model.onnx", source, "model.onnx.data")


def test_held_out_reference_logits_are_made_once_and_never_beside_a_candidate(tiny_fp32, tiny_heldout, monkeypatch):
    """The automatic recipe's measurements: the float graph's logits on the held-out windows are made once, kept
    in a scratch file and read back batch by batch (the float graph measured against itself: no change at
    all, every batch), and its session is gone before a candidate's runs."""
    import weakref

    from kvforge.calibration import budget

    model = tiny_fp32.load_graph(external_data=False)
    ids = [int(t) for t in np.asarray(tiny_heldout[:9]).reshape(-1)]
    ev = budget.HeldOutEvaluator(tiny_fp32, model, (ids, "held-out text"))
    assert len(ev.chunks) > ev.batch_size  # several batches, so several offsets in the file
    made, alive_at_make = [], []
    real = budget.make_session

    def tracking(*args, **kwargs):
        alive_at_make.append(sum(r() is not None for r in made))
        session = real(*args, **kwargs)
        made.append(weakref.ref(session))
        return session

    monkeypatch.setattr(budget, "make_session", tracking)
    first = ev.metrics(model, None)
    second = ev.metrics(model, None)
    assert len(made) == 3 and alive_at_make == [0, 0, 0]  # the reference once, then one session per candidate
    for m in (first, second):
        assert m["perplexity_delta_pct"] == 0.0 and m["top1_agreement"] == 1.0 and m["logits_max_abs"] == 0.0
        assert m["kl_divergence_mean"] == 0.0
    assert first == second


def test_the_plan_counts_the_held_out_logits_scratch_file(tiny_fp32, tmp_path, monkeypatch):
    """The automatic recipe keeps the float logits of its held-out windows under TMPDIR: the plan checked before
    any work counts them (the calibration text's held-out tokens x the vocabulary x 4 bytes); random tokens hold
    nothing out, so nothing is counted."""
    from kvforge import resources
    from kvforge.calibration.auto import HOLD_OUT_TOKENS

    plans = []
    check = resources.check
    monkeypatch.setattr(resources, "check", lambda plan, out: (plans.append(plan), check(plan, out))[1])
    calibrate(tiny_fp32.path, tmp_path / "text", precision="int8", samples=8, seq_len=64)
    calibrate(tiny_fp32.path, tmp_path / "random", precision="int8", samples=8, seq_len=64, random_data=True)
    assert [p.scratch for p in plans] == [HOLD_OUT_TOKENS * tiny_fp32.model_config["vocab_size"] * 4, 0]
    assert plans[0].stage == "calibration" and plans[0].disk > 0
