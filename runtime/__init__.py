"""kvforge.runtime (not built yet)."""
