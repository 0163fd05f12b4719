"""`launch.compare --jobs=N` (N runs at a time in worker processes) against `--jobs=1`.

  python -m benchmarks.compare_jobs --jobs=1,2 --rounds=5

Each side runs the same comparison (default: FedAvg and pFedES on the quick start, a two-rate
grid, two seeds: 8 runs) in a fresh workdir with the compilation cache off, in fresh processes
one after the other, and prints wall times, the speed-up against the first, and whether every
table figure but wall time equals the first side's (it must: tests/studies/test_run_pool.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/quickstart.py", "Config file.")
_JOBS = flags.DEFINE_list("jobs", ["1", "2"], "The --jobs values, the first the reference.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds per run.")
_ALGORITHMS = flags.DEFINE_string("algorithms", "fedavg,pfedes", "Methods.")
_LR_GRID = flags.DEFINE_string("lr_grid", "0.01,0.05", "The tuning grid.")
_SEEDS = flags.DEFINE_integer("seeds", 2, "Reported seeds per method.")


def _figures(value):
    """comparison.json without wall-clock figures and run folders."""
    if isinstance(value, dict):
        return {k: _figures(v) for k, v in value.items()
                if not k.endswith("_s") and k != "run_dir"}
    if isinstance(value, list):
        return [_figures(v) for v in value]
    return value


def main(argv):
    del argv
    root = tempfile.mkdtemp(prefix="compare_jobs_")
    walls, tables = {}, {}
    for jobs in _JOBS.value:
        workdir = os.path.join(root, f"jobs{jobs}")
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "launch.compare", f"--config={_CONFIG.value}",
             f"--config.train.rounds={_ROUNDS.value}", "--config.execution.compilation_cache_dir=",
             "--config.monitor.tensorboard=false", f"--algorithms={_ALGORITHMS.value}",
             f"--lr_grid={_LR_GRID.value}", f"--seeds={_SEEDS.value}", f"--workdir={workdir}",
             "--progress=false", f"--jobs={jobs}"], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        walls[jobs] = time.perf_counter() - t0
        print(f"--jobs={jobs}: {walls[jobs]:.1f} s", file=sys.stderr, flush=True)
        tables[jobs] = _figures(json.load(open(os.path.join(workdir, "comparison.json"))))
    first = _JOBS.value[0]
    runs = len(_ALGORITHMS.value.split(",")) * (len(_LR_GRID.value.split(",")) + _SEEDS.value)
    print(f"{_CONFIG.value}, {_ROUNDS.value} rounds, {runs} runs ({_ALGORITHMS.value}; grid "
          f"{_LR_GRID.value}; {_SEEDS.value} seeds), {os.cpu_count()} CPUs, compilation cache off")
    print(f"| launch.compare | wall s | speed-up vs --jobs={first} | tables equal |")
    print("|---|---|---|---|")
    for jobs, t in walls.items():
        print(f"| --jobs={jobs} | {t:.1f} | {walls[first] / t:.2f}x | "
              f"{'yes' if tables[jobs] == tables[first] else 'NO'} |")


if __name__ == "__main__":
    app.run(main)
