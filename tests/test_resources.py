"""Export and calibration refuse, before any work, a model that the memory this process may use cannot hold
(kvforge/resources.py), naming what the stage needs and what is free; the parameter count the plan reads from a
source's config alone is transformers' count."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time

import pytest
import torch

from kvforge.model_defs.checkpoint import source_parameters


def _capped(args: list[str], cap_bytes: int, cwd) -> subprocess.CompletedProcess:
    """`python -m kvforge ARGS` with its address space capped (as `ulimit -v` does)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_SKIP_RESOURCE_CHECK"}
    return subprocess.run([sys.executable, "-m", "kvforge", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, preexec_fn=cap, env=env, stdin=subprocess.DEVNULL)


def _needs_and_free(text: str) -> tuple[float, float]:
    m = re.search(r"needs about ([\d.]+) GiB of memory at its peak, and ([\d.]+) GiB is free \(the address-space "
                  r"limit \(RLIMIT_AS\)\)", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_an_export_too_large_for_the_capped_process_is_refused_before_it_loads(tmp_path):
    out = tmp_path / "bundle"
    started = time.monotonic()
    done = _capped(["export", "gpt2-124m", "-o", str(out)], 5 << 29, tmp_path)  # 2.5 GiB
    seconds = time.monotonic() - started
    assert done.returncode != 0
    needs, free = _needs_and_free(done.stderr + done.stdout)
    assert "export of this model (0.12B parameters)" in done.stderr + done.stdout
    # what the process may still map is under the cap, and the plan holds at least the float32 weights
    assert free < 2.5 and needs > free and needs >= 124_439_808 * 4 / 2**30
    assert not out.exists() and not list(tmp_path.glob(".*bundle*"))  # nothing written, not even staged
    assert seconds < 120, seconds  # refused at once: loading and tracing gpt2-124m takes longer


def test_a_calibration_too_large_for_the_capped_process_is_refused(micro_bundle, tmp_path):
    bundle = micro_bundle("llama3-micro")
    out = tmp_path / "int8"
    done = _capped(["calibrate", str(bundle.path), "-o", str(out), "--precision", "int8", "--random-data"],
                   9 << 27, tmp_path)  # 1.1 GiB: less than the runtime alone needs
    assert done.returncode != 0
    needs, free = _needs_and_free(done.stderr + done.stdout)
    assert "calibration of this model" in done.stderr + done.stdout and needs > free
    assert not out.exists()


def test_the_plans_parameter_count_is_transformers(hf_checkpoint):
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config())  # gpt2-124m is GPT-2 small
    assert source_parameters("gpt2-124m") == gpt2.num_parameters()
    directory = hf_checkpoint("llama")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    assert source_parameters(directory) == model.num_parameters()


@pytest.mark.parametrize("source", ["not-a-model", "/nonexistent/dir"])
def test_an_unknown_source_is_named_by_the_plan(source):
    from kvforge.errors import KvforgeError

    with pytest.raises(KvforgeError, match="unknown model source"):
        source_parameters(source)


def test_a_scratch_file_the_disk_cannot_hold_is_refused_before_any_work(tmp_path, monkeypatch):
    """A streamed GGUF export writes the decoded model under TMPDIR (model_defs/weights.ScratchTensors): a plan
    whose scratch file the disk cannot hold, on top of the bundle, is refused naming both; one that fits passes.
    The disk is this machine's, its free space read as the check reads it."""
    import shutil

    from kvforge import resources
    from kvforge.errors import KvforgeError

    monkeypatch.delenv("KVFORGE_SKIP_RESOURCE_CHECK", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    free = shutil.disk_usage(tmp_path).free
    out = tmp_path / "bundle"
    resources.check(resources.Plan("export", 10, 0, 1 << 20, 1 << 20), out)  # fits
    with pytest.raises(KvforgeError, match=r"disk for the bundle and its scratch file \(TMPDIR is on the same disk\)"):
        resources.check(resources.Plan("export", 10, 0, free // 2, free // 2 + (1 << 30)), out)
    assert not out.exists()
