"""kvforge.export (not built yet)."""
