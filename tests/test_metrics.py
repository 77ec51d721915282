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
