"""Real English prose shipped with kvforge (public domain; kvforge/assets/text/SOURCES.md says where each is from).

Real checkpoints are calibrated and evaluated on it by default: calibration on two works, evaluation on a
third, so the figures a user sees are measured on text the calibration never read. The automatic recipe measures
its candidates on a fourth, of another register (1992 conference proceedings: expository prose with names and
figures), so the estimate it prints is made on neither the text it calibrated on nor the one it is judged on.
The trained `tiny` model
keeps its own corpus and held-out text (Python source), which its tokenizer was built for.
"""

from __future__ import annotations

from pathlib import Path

TEXT_DIR = Path(__file__).parent / "assets" / "text"
CALIBRATION = ("botchan.txt", "us_constitution.txt")
EVALUATION = ("alice_in_wonderland.txt",)
HELD_OUT = ("loc_workshop_on_electronic_texts.txt",)


def builtin_prose(role: str) -> tuple[list[str], str]:
    """(the texts, their name for reports) for role "calibration", "evaluation" or "held-out" (the automatic
    recipe's measurements)."""
    files = {"calibration": CALIBRATION, "evaluation": EVALUATION, "held-out": HELD_OUT}[role]
    texts = [(TEXT_DIR / name).read_text(encoding="utf-8") for name in files]
    return texts, f"built-in English prose ({', '.join(files)})"
