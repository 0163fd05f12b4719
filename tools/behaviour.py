"""Records what a refactor must not change, and compares two records.

  python -m tools.behaviour record --out=/tmp/before    # on the old code
  python -m tools.behaviour record --out=/tmp/after     # on the new code
  python -m tools.behaviour compare /tmp/before /tmp/after
  python -m tools.behaviour record --out=/tmp/some --only=quickstart,method_fml
  python -m tools.behaviour record --out=/tmp/loop --flags=--config.execution.strategy=loop

`record` runs, through the command line (`python -m launch.main`, so it does not depend on the
package's module layout), the quick start, the private and the unreliable quick starts and 3
rounds of every registered method, and keeps each run's metrics.jsonl. `compare` reports, per run
and metric, the largest relative difference between the two records; wall-clock fields are
ignored. Exit status 1 when a run is missing or a metric differs by more than `--rtol`.
`--flags` adds `launch.main` flags to every run: under the default `execution.strategy='auto'`
two records may differ because a timed decision went another way (float reassociation,
amplified over rounds), so a refactor of one strategy is checked with it forced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

QUICK_STARTS = ("quickstart", "private_quickstart", "unreliable_quickstart")
METHOD_ROUNDS = 3
# Fields that measure the machine, not the simulation.
TIMING_WORDS = ("time", "_s", "seconds", "compile", "wall")


def methods() -> list[str]:
    """Every registered `config.algorithm`, read from `launch.methods`' table."""
    out = subprocess.run([sys.executable, "-m", "launch.methods"], check=True,
                         capture_output=True, text=True).stdout
    return [line.split("`")[1] for line in out.splitlines() if line.startswith("| `")]


def runs() -> dict[str, list[str]]:
    """Run name → the `launch.main` flags that produce it."""
    table = {q: [f"--config=configs/{q}.py"] for q in QUICK_STARTS}
    for m in methods():
        table[f"method_{m}"] = ["--config=configs/quickstart.py", f"--config.algorithm={m}",
                                f"--config.train.rounds={METHOD_ROUNDS}"]
    return table


def record(out: str, only: list[str] | None = None, extra: list[str] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    for name, flags in runs().items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as work:
            cmd = [sys.executable, "-m", "launch.main", *flags, *(extra or []),
                   f"--workdir={work}", "--noprogress"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
                continue
            shutil.copy(os.path.join(work, "metrics.jsonl"),
                        os.path.join(out, f"{name}.jsonl"))
            print(f"{name}: recorded", flush=True)


def _timing(key: str) -> bool:
    return any(w in key for w in TIMING_WORDS)


def _numbers(record_: dict, prefix: str = "") -> dict[str, float]:
    flat = {}
    for k, v in record_.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_numbers(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and not _timing(key):
            flat[key] = float(v)
    return flat


def compare(before: str, after: str, rtol: float, partial: bool = False) -> int:
    worst_all, failed = 0.0, False
    for name in sorted(set(os.listdir(before)) & set(os.listdir(after)) if partial
                       else os.listdir(before)):
        b_path, a_path = os.path.join(before, name), os.path.join(after, name)
        if not os.path.exists(a_path):
            print(f"{name}: missing in {after}")
            failed = True
            continue
        b_rows = [json.loads(x) for x in open(b_path)]
        a_rows = [json.loads(x) for x in open(a_path)]
        if len(b_rows) != len(a_rows):
            print(f"{name}: {len(b_rows)} rounds before, {len(a_rows)} after")
            failed = True
            continue
        worst, where = 0.0, ""
        for rb, ra in zip(b_rows, a_rows, strict=True):
            nb, na = _numbers(rb), _numbers(ra)
            if set(nb) != set(na):
                print(f"{name}: fields differ: {sorted(set(nb) ^ set(na))}")
                failed = True
            for k in set(nb) & set(na):
                x, y = nb[k], na[k]
                if math.isnan(x) and math.isnan(y):
                    continue
                d = abs(x - y) / max(abs(x), abs(y), 1e-12)
                if d > worst:
                    worst, where = d, f"{k} (round {rb.get('round')}: {x!r} vs {y!r})"
        status = "same" if worst == 0 else f"max rel. diff {worst:.2e} at {where}"
        print(f"{name}: {len(b_rows)} rounds, {status}")
        worst_all = max(worst_all, worst)
        failed |= worst > rtol
    print(f"largest relative difference {worst_all:.2e} (rtol {rtol:g})")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--only", default="", help="comma-separated run names (default: all)")
    rec.add_argument("--flags", default="", help="space-separated launch.main flags added to "
                     "every run, e.g. --config.execution.strategy=scan")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before")
    cmp_.add_argument("after")
    cmp_.add_argument("--rtol", type=float, default=1e-5)
    cmp_.add_argument("--partial", action="store_true",
                      help="compare only the runs both records hold")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, [n for n in args.only.split(",") if n], args.flags.split())
    else:
        sys.exit(compare(args.before, args.after, args.rtol, args.partial))


if __name__ == "__main__":
    main()
