"""How verify's results read in a terminal: the tables of `kvforge compare`, `check` and `pipeline`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from kvforge.metrics import HIGHER_IS_BETTER, REPORT_METRICS

from .kinds import comparer_of
from .pipeline import bundle_megabytes


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def print_compare(r: dict[str, Any], console) -> None:
    """A comparison's metrics against their bounds, the per-layer ranking if measured, and what was measured on."""
    table = Table(title=f"{r['candidate']} ({r['precision']}, {r['candidate_backend']}) vs {r['reference']} ({r['reference_backend']})")
    for col in ("metric", "value", "bound"):
        table.add_column(col)
    for key in r.get("metric_keys", REPORT_METRICS):
        bound = r["tolerances"].get(key)
        table.add_row(key, fmt(r[key]), "" if bound is None else (">= " if key in HIGHER_IS_BETTER else "<= ") + fmt(bound))
    console.print(table)
    if r.get("per_layer"):
        layers = Table(title="per-layer error, ranked by contribution (a block's own rel L2, fed the reference's input)")
        for col in ("rank", "layer", "accumulated rel L2", "contribution", "cosine", "max abs"):
            layers.add_column(col)
        for row in sorted(r["per_layer"], key=lambda x: x["rank"]):
            layers.add_row(str(row["rank"]), row["layer"], fmt(row["rel_l2"]), fmt(row["contribution"]), fmt(row["cosine"]), fmt(row["max_abs"]))
        console.print(layers)
    console.print(f"data: {comparer_of(r).data_line(r)}")


def print_check(result, spec, console) -> None:
    """Every finding of a check against its baseline, and the artifacts it skipped."""
    table = Table(title=f"check {spec}: against {result.spec.baseline.name}")
    for col in ("artifact/backend", "metric", "baseline", "now", "limit", ""):
        table.add_column(col)
    for f in result.findings:
        table.add_row(f.key, f.metric, fmt(f.baseline), fmt(f.current), fmt(f.limit),
                      "[green]ok[/]" if f.ok else f"[red]{f.note}[/]")
    for o in result.outcomes:
        if o.skipped:
            table.add_row(o.key, "-", "", "", "", f"skipped: {o.skipped}")
    console.print(table)
    if result.estimates:
        table = Table(title="the automatic recipe's estimate (its held-out text) beside this check's measurement")
        for col in ("artifact/backend", "", "KL", "perplexity change", "top-1", "text"):
            table.add_column(col)
        for key, pair in result.estimates.items():
            for which in ("estimated", "measured"):
                e = pair[which]
                table.add_row(key if which == "estimated" else "", which, fmt(e["kl_divergence_mean"]),
                              f"{e['perplexity_delta_pct']:+.2f}%", f"{e['top1_agreement']:.4f}",
                              f"{e['tokens']} tokens of {e['data']}")
        console.print(table)


def print_pipeline(result, source, console) -> None:
    """The pipeline's one table: every artifact on every backend, and what the reference was."""

    table = Table(title=f"kvforge pipeline: {source or 'tiny'} -> {result.workdir} ({result.seconds:.0f} s)")
    first = next((o.report for o in result.outcomes if o.report is not None), None)
    encoder = first is not None and "embedding_cosine_min" in first.result  # an encoder's report: no perplexity
    columns = (("embedding cos min", "hidden rel L2", "top-1") if encoder
               else ("perplexity", "delta %", "top-1", "KL", "greedy"))
    for col in ("artifact", "backend", "MB", *columns, "result"):
        table.add_column(col)
    for o in result.outcomes:
        if o.report is None:
            table.add_row(o.artifact, o.backend, "", *[""] * len(columns), f"skipped: {o.skipped}")
            continue
        r = o.report.result
        if encoder:
            values = [f"{r['embedding_cosine_min']:.5f}", fmt(r["hidden_rel_l2"]), fmt(r["top1_agreement"])]
        else:
            values = [f"{r['perplexity_candidate']:.3f}", f"{r['perplexity_delta_pct']:+.2f}", f"{r['top1_agreement']:.4f}",
                      fmt(r["kl_divergence_mean"]), f"{r['greedy_agreement']:.3f}"]
        table.add_row(o.artifact, o.backend, f"{bundle_megabytes(o.bundle):.1f}", *values,
                      "[green]pass[/]" if o.report.passed else "[red]FAIL: " + "; ".join(o.report.failures) + "[/]")
    console.print(table)
    if encoder:
        console.print(f"reference: {first['reference']} on torch; {first['inputs']} right-padded inputs, "
                      f"{first['tokens']} real tokens of {first['data']}")
    elif first is not None:
        console.print(f"reference: {first['reference']} on torch, perplexity {first['perplexity_reference']:.3f} over "
                      f"{first['tokens']} tokens of {first['data']}; greedy = teacher-forced agreement over "
                      f"{first['prompts']} x {first['steps']} decode steps")


class PhaseProgress:
    """A rich progress display on stderr: one bar per phase of a long job (the CLI's progress= callback)."""

    def __init__(self, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(stderr=True), disable=not enabled, transient=False,
        )
        self.tasks: dict[str, int] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)
