"""The pytest plugin: users write accuracy checks in their own test suites."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_fixtures_pass_a_good_bundle_and_fail_a_tolerance(pytester, tiny_int8):
    pytester.makepyfile(f"""
        BUNDLE = {str(tiny_int8.path)!r}
        QUICK = dict(max_tokens=512, steps=4, prompts=1)

        def test_good(kvforge_compare):
            report = kvforge_compare(BUNDLE, **QUICK)
            assert report["precision"] == "int8" and report.passed

        def test_too_strict(kvforge_compare):
            kvforge_compare(BUNDLE, tolerances={{"top1_agreement": 1.0}}, **QUICK)

        def test_report_either_way(kvforge_compare):
            report = kvforge_compare(BUNDLE, tolerances={{"top1_agreement": 1.0}}, require_pass=False, **QUICK)
            assert not report.passed
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*kvforge compare*top1_agreement*< 1*"])


def test_kvforge_check_fixture_and_baseline_option(pytester, tiny_int8):
    pytester.makefile(".toml", check=f"""
        baseline = "check.baseline.json"
        [data]
        max_tokens = 512
        steps = 4
        prompts = 1
        [[artifacts]]
        name = "int8"
        bundle = {str(tiny_int8.path)!r}
    """)
    pytester.makepyfile("""
        def test_no_regression(kvforge_check):
            result = kvforge_check("check.toml")
            assert result.passed
    """)
    first = pytester.runpytest("-p", "no:cacheprovider")
    first.assert_outcomes(failed=1)  # no baseline yet: an error that says how to make one
    first.stdout.fnmatch_lines(["*no baseline at*--update-baseline*"])
    pytester.runpytest("-p", "no:cacheprovider", "--kvforge-update-baseline").assert_outcomes(passed=1)
    assert (pytester.path / "check.baseline.json").is_file()
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
