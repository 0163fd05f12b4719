"""What a plateau stop would have done to runs that went to a fixed round count.

`config.train.stop_at_plateau` ends a run at the first evaluation where `engine.plateau`'s rule
holds. Whether that is where learning has ended depends on the population: a rule whose earliest
stop comes before the clients have trained often enough stops runs that keep climbing slowly.
This replays the rule, as the callback applies it, on the evaluated curves of finished
fixed-round runs (their metrics.jsonl) and measures, per candidate rule, where each run would have
stopped and how much it gained between that stop and its last round. Runs that were themselves
stopped early are left out: after their stop there is nothing to measure.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from fedjax_pfedes.engine.plateau import METRIC, plateau_reached
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.io.metrics import read_jsonl_lines


@dataclasses.dataclass(frozen=True)
class StopRule:
    """One setting of the stop rule (`config.train.plateau_window`, `plateau_tolerance`,
    `plateau_min_evaluations`)."""

    window: float
    tolerance: float
    min_evaluations: int

    def label(self) -> str:
        return (f"window {self.window:g}, tolerance {self.tolerance:g}, "
                f"min {self.min_evaluations} evaluations")


@dataclasses.dataclass(frozen=True)
class Replay:
    """One run under one rule: the round it would have stopped at (None: never before its last
    evaluation) and its evaluated accuracy there and at its last evaluation."""

    run: str
    stop_round: int | None
    at_stop: float | None
    at_end: float
    end_round: int

    @property
    def gain(self) -> float | None:
        """Accuracy points gained after the stop (None when it never stopped)."""
        return None if self.at_stop is None else 100.0 * (self.at_end - self.at_stop)


def evaluated_curve(run_dir: str) -> tuple[list[int], list[float]]:
    """A run's evaluated rounds, from its metrics.jsonl.

    Args:
      run_dir: the run's folder.

    Returns:
      (rounds, mean personalized accuracy at each).
    """
    try:
        records, _ = read_jsonl_lines(os.path.join(run_dir, "metrics.jsonl"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    evaluated = [r for r in records if METRIC in r]
    return [int(r["round"]) for r in evaluated], [float(r[METRIC]) for r in evaluated]


def first_stop(accuracy: list[float], rule: StopRule) -> int | None:
    """Where `rule` first holds, tested after each evaluation as the callback does.

    Args:
      accuracy: the evaluated accuracies in round order.
      rule: the stop's settings.

    Returns:
      The number of evaluations at the stop, or None when it never holds.
    """
    for n in range(1, len(accuracy) + 1):
        if plateau_reached(accuracy[:n], rule.window, rule.tolerance, rule.min_evaluations):
            return n
    return None


def fixed_round_runs(root: str) -> tuple[list[str], int]:
    """The run folders under `root` that ran to their last round.

    Args:
      root: a folder holding run folders (each with a metrics.jsonl).

    Returns:
      (their paths relative to `root`, sorted; how many were left out because their
      summary.json says they stopped early).
    """
    if not os.path.isdir(root):
        raise ConfigError(f"--runs: {root} is not a folder")
    runs, stopped = [], 0
    for folder, _, files in os.walk(root):
        if "metrics.jsonl" not in files:
            continue
        summary_path = os.path.join(folder, "summary.json")
        if os.path.exists(summary_path):
            with open(summary_path) as f:
                try:
                    summary = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{summary_path}: not JSON ({e.msg})") from None
            if summary.get("stopped_early"):
                stopped += 1
                continue
        runs.append(os.path.relpath(folder, root))
    return sorted(runs), stopped


def replay(root: str, rules: list[StopRule]) -> tuple[dict[StopRule, list[Replay]], int]:
    """Each rule replayed on every fixed-round run under `root`.

    Args:
      root: a folder holding run folders (e.g. a `launch.compare` workdir).
      rules: the settings to replay.

    Returns:
      ({rule: one Replay per run}, the number of runs left out for having stopped early).
    """
    runs, stopped = fixed_round_runs(root)
    if not runs:
        raise ConfigError(f"--runs: no run ran to its last round under {root} (metrics.jsonl "
                          f"with evaluations; {stopped} stopped early)")
    curves = {run: evaluated_curve(os.path.join(root, run)) for run in runs}
    out = {}
    for rule in rules:
        rows = []
        for run, (rounds, accuracy) in curves.items():
            if not accuracy:
                continue
            n = first_stop(accuracy, rule)
            rows.append(Replay(run, None if n is None else rounds[n - 1],
                               None if n is None else accuracy[n - 1], accuracy[-1], rounds[-1]))
        out[rule] = rows
    return out, stopped


def summary_table(replays: dict[StopRule, list[Replay]]) -> str:
    """One line per rule: runs it stops, its stop rounds, and the points they gained after.

    Args:
      replays: `replay`'s first result.

    Returns:
      A Markdown table.
    """
    lines = ["| rule | runs stopped | stop round: mean [range] | gain after the stop, pp: "
             "mean ± sd | runs gaining > 1 pp | > 2 pp |", "|---|---|---|---|---|---|"]
    for rule, rows in replays.items():
        stops = [r.stop_round for r in rows if r.stop_round is not None]
        gains = np.array([r.gain for r in rows if r.gain is not None])
        if not len(gains):
            lines.append(f"| {rule.label()} | 0 / {len(rows)} | - | - | - | - |")
            continue
        spread = f" ± {gains.std(ddof=1):.2f}" if len(gains) > 1 else ""
        lines.append(
            f"| {rule.label()} | {len(stops)} / {len(rows)} | {np.mean(stops):.0f} "
            f"[{min(stops)}-{max(stops)}] | {gains.mean():+.2f}{spread} | "
            f"{int((gains > 1).sum())} | {int((gains > 2).sum())} |")
    return "\n".join(lines)


def per_run_table(replays: dict[StopRule, list[Replay]]) -> str:
    """Each run's stop round under each rule ('-': not before its last evaluation), with the
    points gained after it.

    Args:
      replays: `replay`'s first result.

    Returns:
      A Markdown table, one row per run.
    """
    rules = list(replays)
    header = "| run | last round | " + " | ".join(r.label() for r in rules) + " |"
    lines = [header, "|---|---|" + "---|" * len(rules)]
    for i, first in enumerate(replays[rules[0]]):
        cells = []
        for rule in rules:
            r = replays[rule][i]
            cells.append("-" if r.stop_round is None else f"{r.stop_round} ({r.gain:+.2f})")
        lines.append(f"| {first.run} | {first.end_round} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
