"""pytest fixtures for accuracy checks in your own test suite (registered through the `pytest11` entry point).

    def test_int8_bundle_matches_the_reference(kvforge_compare):
        report = kvforge_compare("artifacts/int8", max_tokens=2048, tolerances={"top1_agreement": 0.97})
        assert report["perplexity_delta_pct"] < 1.0          # anything else you care about

    def test_accuracy_has_not_regressed(kvforge_check):
        kvforge_check("checks/model.toml")                   # a `kvforge check` spec with its baseline

Both fail the test with the metrics that broke their bounds. `pytest
--kvforge-update-baseline` rewrites the baselines of the specs that
kvforge_check runs, on purpose, as `kvforge check --update-baseline` does.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("kvforge", "kvforge accuracy checks")
    group.addoption("--kvforge-update-baseline", action="store_true", default=False,
                    help="kvforge_check: rewrite the specs' baselines from this run instead of checking against them.")


@pytest.fixture
def kvforge_compare():
    """compare(candidate, reference=None, **options) -> Report; fails the test unless every bound holds
    (pass require_pass=False to get the report either way)."""
    from kvforge.verify.compare import compare  # pytest loads the plugin in every session: kvforge loads when used

    def run(candidate, reference=None, require_pass: bool = True, **options):
        report = compare(candidate, reference, **options)
        if require_pass and not report.passed:
            pytest.fail(f"kvforge compare {candidate}: {'; '.join(report.failures)}", pytrace=False)
        return report

    return run


@pytest.fixture
def kvforge_check(request, tmp_path_factory):
    """check(spec) -> CheckResult; fails the test on a regression against the spec's baseline."""
    from kvforge.verify.check import check  # as above: only when the fixture is used

    update = request.config.getoption("--kvforge-update-baseline")

    def run(spec, workdir=None, require_pass: bool = True):
        result = check(spec, update_baseline=update, workdir=workdir or tmp_path_factory.mktemp("kvforge-check"),
                       log=lambda message: None)
        if require_pass and not result.passed:
            lines = [f"{f.key} {f.metric}: {f.note} (baseline {f.baseline}, now {f.current}, limit {f.limit})"
                     for f in result.regressions]
            pytest.fail(f"kvforge check {spec}:\n  " + "\n  ".join(lines), pytrace=False)
        return result

    return run
