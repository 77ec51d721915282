"""What the test suite costs on this machine, and the part of it no schedule or sharing can remove: the fresh
torch.onnx traces of the distinct structures the tests export (issue 47's 8- and 15-minute targets).

Runs the README's two test commands (the default tier, then the slow tier) in this environment, as `.ci/run` does:
one fresh kvforge cache for both, so a structure is traced once per run whichever tier meets it first. A plugin
loaded into every xdist worker (`-p benchmarks.kernels.suite_floor`: this module) logs each fresh trace
(kvforge.export.traces._fresh: torch.onnx capture, decompositions, translation, optimizer) with its duration and
test. With `--install`, it also times the README's test install (`bash scripts/install.sh --test`) in a new virtual
environment, with pip's cache as it is.

The floor: a structure's first export must be traced (a trace is what an export is; the cache already shares
every later one), so the fresh traces' seconds, spread over the workers, are wall time that remains whatever is
moved between tiers or reordered; add the install, which `.ci/run` pays first. Written beside the measured walls
and CPU seconds (user + system of the workers and every process they start), which say how much of two cores the
suite gets; their sum over the cores, + the install, is the work floor: the least wall time of the tests as they
are, whatever the schedule, the tiers or the sharing of traces.

    python3 -m benchmarks.kernels.suite_floor [--install] [--workers 2] [--out benchmarks/results/suite_floor.json]

KVFORGE_RECORD_COSTS is passed on when set (tests/schedule.py: the per-file costs the schedule reads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, load_average, machine, utc_time, write_result

LOG_ENV = "KVFORGE_SUITE_TRACE_LOG"


# --- the plugin half: imported by pytest in each worker (`-p benchmarks.kernels.suite_floor`, the repository on
# PYTHONPATH) ---
def pytest_configure(config):
    directory = os.environ.get(LOG_ENV)
    if not directory:
        return
    from kvforge.export import traces

    fresh = traces._fresh

    def logged(trace, tensors):
        start = time.perf_counter()
        program = fresh(trace, tensors)
        record = {"seconds": round(time.perf_counter() - start, 3), "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
        with open(Path(directory) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return program

    traces._fresh = logged


# --- the benchmark half ---
def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(cmd: list[str], env: dict, cwd: Path) -> dict:
    cpu, start = _cpu_of_children(), time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    return {"command": " ".join(cmd), "returncode": done.returncode, "wall_s": round(wall, 1),
            "cpu_s": round(_cpu_of_children() - cpu, 1), "summary": tail[0] if tail else done.stderr[-500:]}


def _traces(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="also time the README's test install in a new venv")
    ap.add_argument("--workers", type=int, default=2, help="the xdist workers the suite runs on (2 on 2 cores)")
    ap.add_argument("--out", default=str(RESULTS / "suite_floor.json"))
    args = ap.parse_args()
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="kvforge-suite-floor-"))
    result: dict = {"machine": machine(), "load_before": load_before, "time": utc_time(), "tiers": {}}
    if args.install:
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
        result["install"] = _timed(["bash", "scripts/install.sh", "--test"], env, ROOT)
    cache = work / "cache"
    cache.mkdir()
    floor = 0.0
    for tier, marker in (("default", []), ("slow", ["-m", "slow"])):
        logs = work / f"traces-{tier}"
        logs.mkdir()
        env = dict(os.environ, KVFORGE_CACHE=str(cache), CI="true", **{LOG_ENV: str(logs)},
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        run = _timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "-p", "benchmarks.kernels.suite_floor", "-n", str(args.workers), *marker], env, ROOT)
        traced = _traces(logs)
        run["fresh_traces"] = len(traced)
        run["fresh_trace_s"] = round(sum(t["seconds"] for t in traced), 1)
        run["slowest_traces"] = sorted(traced, key=lambda t: -t["seconds"])[:15]
        result["tiers"][tier] = run
        floor += run["fresh_trace_s"] / args.workers
        print(f"{tier}: {run['summary']}; wall {run['wall_s']} s, cpu {run['cpu_s']} s, "
              f"{len(traced)} fresh traces {run['fresh_trace_s']} s", flush=True)
    install_s = result.get("install", {}).get("wall_s", 0.0)
    work_s = sum(t["cpu_s"] for t in result["tiers"].values())
    result["floor"] = {
        "fresh_traces_wall_s": round(floor, 1), "install_s": install_s,
        "ci_floor_min": round((floor + install_s) / 60, 2),
        "default_tier_traces_min": round(result["tiers"]["default"]["fresh_trace_s"] / args.workers / 60, 2),
        "note": "fresh traces spread over the workers (+ the install): wall no schedule or tier removes",
        # the work itself: every CPU-second the two tiers' processes spent (workers, servers, CLI subprocesses),
        # spread over all the cores with none idle; only smaller work (fewer or cheaper tests, a faster kvforge
        # or torch) goes below it
        "work_cpu_s": round(work_s, 1),
        "work_floor_min": round((work_s / (os.cpu_count() or 1) + install_s) / 60, 2),
        "work_note": "both tiers' CPU-seconds over this machine's cores, + the install"}
    result["suite_wall_min"] = round(sum(t["wall_s"] for t in result["tiers"].values()) / 60, 2)
    write_result("suite_floor", result, args.out, indent=1)
    print(json.dumps(result["floor"]), f"suite {result['suite_wall_min']} min", flush=True)


if __name__ == "__main__":
    main()
