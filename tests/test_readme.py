"""The README's commands and examples work as printed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands() -> list[str]:
    return [ln.strip() for ln in _blocks("bash")[0].splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _first_commands() -> list[str]:
    return _commands()[:2]


def test_the_first_two_commands_set_up_then_run_the_main_job_and_the_tests():
    main_job, tests = _first_commands()
    assert main_job.startswith("bash scripts/install.sh && ")
    assert tests.startswith("bash scripts/install.sh --test && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, ".ci/run must run the README's test command"


def test_the_test_command_runs_both_tiers_in_one_run():
    """A bare run leaves the slow tier out (pyproject's addopts: a developer's quick run); the README's test
    command, which .ci/run runs, selects both tiers in one run, so that no test goes unrun in CI and an export the
    two tiers share is made once."""
    tests = _first_commands()[1]
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert shlex.split(addopts)[-2:] == ["-m", "not slow"]
    pytest_run = next(part for part in tests.split(" && ") if "pytest" in part)
    assert shlex.split(pytest_run)[-2:] == ["-m", "slow or not slow"]  # the last -m wins over addopts'
    assert len(_commands()) == 2


@pytest.mark.slow
def test_the_main_job_runs(tmp_path):
    """The first command after its install step, from a scratch directory: the pipeline's summary table."""
    main_job = _first_commands()[0].split("&&", 1)[1]
    env = {**os.environ, "COLUMNS": "120"}
    out = subprocess.run(["bash", "-c", main_job], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "kvforge pipeline: tiny" in out.stdout
    rows = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.stdout.splitlines() if "│" in line]
    table = {cells[0]: cells for cells in rows}
    assert set(table) >= {"fp32", "fp16", "int8", "fp8", "int4"}, out.stdout
    assert all(cells[-1] == "pass" for cells in table.values()), out.stdout
    words = shlex.split(main_job)
    work = tmp_path / words[words.index("-o") + 1]
    report = json.loads((work / "report.json").read_text())
    assert report["passed"] and (work / "drift.png").is_file()
    for name in ("fp32", "fp16", "int8", "fp8", "int4"):
        assert (work / name / "kvforge.json").is_file() and (work / name / "model.onnx").is_file()


@pytest.mark.slow  # each example is a fresh process that exports its own model: 20-45 s apiece
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_examples_run(tmp_path, index):
    code = _blocks("python")[index]
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"README python example {index} failed:\n{code}\n{out.stderr[-3000:]}"
