"""The logits metrics computed a piece of positions at a time (kvforge/metrics.py: float64 temporaries bounded
whatever the vocabulary) against Torch's own float64 computation of the whole: KL divergence per position and
the largest absolute difference, with pieces of a few values forced and at the default size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import metrics


@pytest.mark.parametrize("chunk", [7, 1 << 22])
@pytest.mark.parametrize("shape", [(2, 5, 300), (3, 1001), (1, 1, 2), (0, 9)])
def test_pieces_compute_what_torch_computes_on_the_whole(monkeypatch, chunk, shape):
    monkeypatch.setattr(metrics, "CHUNK_VALUES", chunk)
    rng = np.random.default_rng(sum(shape))
    c = (rng.standard_normal(shape) * 4).astype(np.float32)
    r = (rng.standard_normal(shape) * 4).astype(np.float32)
    lc = torch.log_softmax(torch.from_numpy(c).double(), -1)
    lr = torch.log_softmax(torch.from_numpy(r).double(), -1)
    expected = torch.nn.functional.kl_div(lc, lr, reduction="none", log_target=True).sum(-1).numpy()
    got = metrics.kl_divergence(c, r)
    assert got.shape == shape[:-1]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    whole = float((torch.from_numpy(c).double() - torch.from_numpy(r).double()).abs().max()) if c.size else 0.0
    assert metrics.max_abs(c, r) == whole


@pytest.mark.parametrize("shapes", [((300,), (1, 300)), ((3, 300), (1, 300))])
def test_shapes_broadcast_as_the_whole_computation_does(monkeypatch, shapes):
    """A step's logits (V,) against a reference row (1, V) (verify/compare_decoder.py), or rows against one row."""
    monkeypatch.setattr(metrics, "CHUNK_VALUES", 64)
    rng = np.random.default_rng(3)
    c, r = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    lc, lr = torch.broadcast_tensors(torch.log_softmax(torch.from_numpy(c).double(), -1),
                                     torch.log_softmax(torch.from_numpy(r).double(), -1))
    expected = torch.nn.functional.kl_div(lc, lr, reduction="none", log_target=True).sum(-1).numpy()
    np.testing.assert_allclose(metrics.kl_divergence(c, r), expected, rtol=1e-12, atol=1e-14)
    assert metrics.max_abs(c, r) == float((torch.from_numpy(c).double() - torch.from_numpy(r).double()).abs().max())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [3 * 257, 1 << 22])
def test_window_sums_are_torchs_on_the_whole_in_pieces_on_threads(monkeypatch, chunk, threads):
    """WindowStats (the held-out measurements of calibration's candidates): perplexities, KL, top-1 agreement and
    the logits' distances, a piece of positions at a time on one or two threads, against Torch in float64."""
    monkeypatch.setattr(metrics, "CHUNK_VALUES", chunk)
    monkeypatch.setattr(metrics.WindowStats, "THREADS", threads)
    rng = np.random.default_rng(5)
    c = (rng.standard_normal((3, 11, 257)) * 4).astype(np.float32)
    r = (c + rng.standard_normal(c.shape) * 0.5).astype(np.float32)
    targets = rng.integers(0, 257, (3, 11))
    stats = metrics.WindowStats()
    stats.add(c[:2], r[:2], targets[:2])  # two calls add as one
    stats.add(c[2:], r[2:], targets[2:])
    got = stats.result()
    tc, tr = torch.from_numpy(c).double().reshape(-1, 257), torch.from_numpy(r).double().reshape(-1, 257)
    t = torch.from_numpy(targets).reshape(-1)
    nll_c = torch.nn.functional.cross_entropy(tc, t, reduction="mean")
    nll_r = torch.nn.functional.cross_entropy(tr, t, reduction="mean")
    kl = torch.nn.functional.kl_div(torch.log_softmax(tc, -1), torch.log_softmax(tr, -1), reduction="sum",
                                    log_target=True) / len(t)
    assert got["perplexity_candidate"] == pytest.approx(float(nll_c.exp()), rel=1e-12)
    assert got["perplexity_reference"] == pytest.approx(float(nll_r.exp()), rel=1e-12)
    assert got["kl_divergence_mean"] == pytest.approx(float(kl), rel=1e-10)
    assert got["top1_agreement"] == float((tc.argmax(-1) == tr.argmax(-1)).double().mean())
    assert 0.0 < got["top1_agreement"] < 1.0  # the check above can fail both ways
    assert got["logits_max_abs"] == float((tc - tr).abs().max())
    assert got["logits_rel_l2"] == pytest.approx(float((tc - tr).norm() / tr.norm()), rel=1e-12)
    assert got["logits_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(
        tc.reshape(1, -1), tr.reshape(1, -1))), rel=1e-12)
