"""kvforge's benchmarks, by group: peers/ (kvforge against other runtimes), features/ (kvforge's own capabilities),
kernels/ (one-off kernel and engine studies behind a design choice); harness.py, the helpers they share. Each script
runs from the repository root as `python3 -m benchmarks.GROUP.NAME` (README.md lists them)."""
