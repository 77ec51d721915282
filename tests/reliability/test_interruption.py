"""Writers killed mid-write (SIGKILL, at chosen points) and two writers racing for one output.

After a kill the output is absent, or whole and valid; a bundle being replaced with --force is the previous
bundle or the new one, never neither; the next write to the same place clears what the killed one left.
Of two processes writing one output, one wins and the other fails with a clear message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvforge.bundle import Bundle
from kvforge.export import export

# The child runs a kvforge command with one function wrapped so that the process SIGKILLs itself at that point.
CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    point, argv = sys.argv[1], sys.argv[2:]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def after(fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            die()
            return result
        return wrapped

    import kvforge.outputs as outputs
    import kvforge.export.api as export_api
    import kvforge.derived as derived  # calibrate's writer (kvforge/derived.py write_derived)
    if point == "graph-written":  # export: the graph is in the staging directory, the manifest is not
        import kvforge.export.kinds as export_kinds
        decoder = export_kinds.EXPORTS["decoder"]
        export_kinds.EXPORTS["decoder"] = decoder._replace(write=after(decoder.write))
    elif point == "before-manifest":
        export_api.write_manifest = derived.write_manifest = lambda *a, **k: die()
    elif point == "staged-whole":  # the staging directory is complete, not yet renamed into place
        export_api.write_manifest = after(export_api.write_manifest)
        derived.write_manifest = after(derived.write_manifest)
    elif point == "at-swap":  # --force: right before the new bundle takes the old one's place
        outputs._exchange = lambda *a, **k: die()
    elif point == "after-swap":  # --force: swapped, the previous bundle not yet deleted
        outputs._exchange = after(outputs._exchange)
    elif point == "calibrate-graph-written":  # calibrate: the quantized graph saved, nothing else
        import importlib
        importlib.import_module("kvforge.export.lint").lint = lambda *a, **k: die()
    from kvforge.cli import main
    sys.argv = ["kvforge", *argv]
    main()
""")


def _killed_at(point: str, *argv) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", CHILD, point, *map(str, argv)], capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, (point, done.returncode, done.stderr[-2000:])  # it really died at that point
    return done


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["graph-written", "before-manifest", "staged-whole"])
def test_an_export_killed_mid_write_leaves_no_output(tmp_path, point):
    out = tmp_path / "b"
    _killed_at(point, "export", "gpt2-micro", "-o", out, "--quiet")
    assert not out.exists()
    assert _leftovers(out)  # its staging directory: a SIGKILL runs no cleanup ...
    bundle = export("gpt2-micro", out)  # ... the next write there clears it
    bundle.verify_files()
    assert _leftovers(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("point", ["graph-written", "staged-whole", "at-swap", "after-swap"])
def test_a_bundle_replaced_with_force_survives_a_kill(micro_bundle, tmp_path, point):
    out = tmp_path / "b"
    first = Bundle(shutil.copytree(micro_bundle("reglu-micro").path, out))  # the run's one export of it, as written
    _killed_at(point, "export", "gpt2-micro", "-o", out, "--force", "--quiet")
    survivor = Bundle(out)
    survivor.verify_files()
    family = survivor.model_config["family"]
    if point == "after-swap":  # swapped before the kill: the new bundle, whole
        assert family == "gpt2"
    else:
        assert survivor.manifest["files"] == first.manifest["files"]
    export("gpt2-micro", out, force=True).verify_files()
    assert _leftovers(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("point", ["calibrate-graph-written", "staged-whole"])
def test_a_calibration_killed_mid_write_leaves_no_output(micro_bundle, tmp_path, point):
    out = tmp_path / "q"
    _killed_at(point, "calibrate", micro_bundle("gpt2-micro").path, "-o", out, "--precision", "int8", "--random-data",
               "--samples", "4", "--seq-len", "16", "--quiet")
    assert not out.exists()
    micro_bundle("gpt2-micro").verify_files()  # the input untouched


@pytest.mark.slow
def test_two_writers_of_one_output_one_wins_the_other_fails_clearly(tmp_path):
    out = tmp_path / "b"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(["kvforge", "export", "gpt2-micro", "-o", str(out), "--quiet"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1)
    assert loser.strip().splitlines()[-1].startswith("error: ") and (
        "was written by another process while this one ran" in loser or "already exists" in loser), loser
    assert "Traceback" not in loser
    Bundle(out).verify_files()
    assert _leftovers(out) == []
