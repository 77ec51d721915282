"""kvforge.calibration (not built yet)."""
