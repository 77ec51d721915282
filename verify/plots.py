"""PNG pictures beside the JSON reports: per-step decode drift and per-layer error (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def drift_png(curves: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Per-step logits rel L2 and KL of the teacher-forced decode, one line per artifact."""
    plt = _pyplot()
    fig, (ax_l2, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, drift in curves.items():
        steps = [d["step"] for d in drift]
        ax_l2.plot(steps, [max(d["logits_rel_l2"], 1e-12) for d in drift], marker=".", label=label)
        ax_kl.plot(steps, [max(d["kl_divergence"], 1e-15) for d in drift], marker=".", label=label)
    for ax, title in ((ax_l2, "logits rel L2 per decode step"), (ax_kl, "KL(reference || candidate) per step")):
        ax.set_yscale("log")
        ax.set_xlabel("decode step (0 = prefill)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    ax_kl.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def layers_png(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Per block: rel L2 of the residual stream after it (accumulated), and its contribution (its own error)."""
    plt = _pyplot()
    names = [r["layer"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(rows) + 3), 3.6))
    ax.bar([i - 0.2 for i in x], [r["rel_l2"] for r in rows], width=0.4, label="accumulated rel L2 after the block")
    ax.bar([i + 0.2 for i in x], [r["contribution"] for r in rows], width=0.4, label="contribution (own rel L2 on the reference's input)")
    ax.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    ax.set_title(title or "per-layer error vs reference", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
