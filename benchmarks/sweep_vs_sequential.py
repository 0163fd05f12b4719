"""`launch.sweep` (members trained in one vmapped program) against one `launch.main` per value.

  python -m benchmarks.sweep_vs_sequential --field=lam --values=0.1,0.5,1.0,2.0 --rounds=5

Both sides run the same config (default: the quick start) with the compilation cache off, in
fresh processes one after the other, and print wall times, the ratio, and the largest difference
of the members' final accuracies from the separate runs'.
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
_FIELD = flags.DEFINE_string("field", "lam", "The swept float field.")
_VALUES = flags.DEFINE_list("values", ["0.1", "0.5", "1.0", "2.0"], "Its values.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds per run.")


def _timed(args: list[str], label: str) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    seconds = time.perf_counter() - t0
    # Each run's time as it finishes: a benchmark cut short still leaves what it measured.
    print(f"{label}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return seconds


def main(argv):
    del argv
    root = tempfile.mkdtemp(prefix="sweep_bench_")
    common = [f"--config={_CONFIG.value}", f"--config.train.rounds={_ROUNDS.value}",
              "--config.execution.compilation_cache_dir=", "--config.checkpoint.every=0",
              "--progress=false", "--config.monitor.tensorboard=false"]
    sweep_s = {axis: _timed(["launch.sweep", *common, f"--workdir={root}/sweep_{axis}",
                             f"--member_axis={axis}",
                             f"--sweep.{_FIELD.value}={','.join(_VALUES.value)}"],
                            f"launch.sweep --member_axis={axis}")
               for axis in ("vmap", "map")}
    sequential_s, gaps = 0.0, []
    for v in _VALUES.value:
        run_dir = f"{root}/main_{v}"
        sequential_s += _timed(["launch.main", *common, f"--workdir={run_dir}",
                                f"--config.{_FIELD.value}={v}"],
                                f"launch.main --config.{_FIELD.value}={v}")
        alone = json.load(open(os.path.join(run_dir, "summary.json")))["final"]
        for axis in sweep_s:
            member = json.load(open(os.path.join(root, f"sweep_{axis}",
                                                 f"{_FIELD.value}={float(v):g}",
                                                 "summary.json")))["final"]
            gaps.append(abs(alone["personalized_accuracy_mean"]
                            - member["personalized_accuracy_mean"]))
    print(f"{_CONFIG.value}, {_ROUNDS.value} rounds, {_FIELD.value} in {_VALUES.value}, "
          f"{os.cpu_count()} CPUs, compilation cache off")
    print("| runs | wall s | speed-up vs sequential |\n|---|---|---|")
    print(f"| {len(_VALUES.value)} x launch.main | {sequential_s:.1f} | 1.00 |")
    for axis, t in sweep_s.items():
        print(f"| launch.sweep --member_axis={axis} | {t:.1f} | {sequential_s / t:.2f}x |")
    print(f"largest |personalized accuracy difference| member vs separate run: {max(gaps):.2e}")


if __name__ == "__main__":
    app.run(main)
