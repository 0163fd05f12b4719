"""Replays the plateau stop on finished fixed-round runs: where it would have stopped them and
what they gained after (`studies.plateau_replay`), to choose `config.train.plateau_*` for a
population before running a comparison to convergence.

  python -m launch.stop_audit --runs=runs/collaboration_mnist_5class_300 \\
      --min_evaluations=10,15,20

Every combination of --window, --tolerance and --min_evaluations is one rule; the first table
has a line per rule, the second (--per_run) each run's stop round under each rule with the
accuracy points it gained after it.
"""

from __future__ import annotations

import itertools
import sys

from absl import flags

from fedjax_pfedes.config.training_sections import TrainSection
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.launch import cli
from fedjax_pfedes.studies import plateau_replay

_RUNS = flags.DEFINE_string("runs", None, "A folder of finished runs (e.g. a launch.compare "
                            "workdir): every folder below it with a metrics.jsonl.")
_WINDOW = flags.DEFINE_list("window", [str(TrainSection.plateau_window)],
                            "config.train.plateau_window values to replay.")
_TOLERANCE = flags.DEFINE_list("tolerance", [str(TrainSection.plateau_tolerance)],
                               "config.train.plateau_tolerance values to replay.")
_MIN_EVALUATIONS = flags.DEFINE_list(
    "min_evaluations", [str(TrainSection.plateau_min_evaluations)],
    "config.train.plateau_min_evaluations values to replay.")
_PER_RUN = flags.DEFINE_bool("per_run", False, "Also print each run's stop round per rule.")


def _numbers(flag: flags.FlagHolder, kind: type) -> list:
    try:
        values = [kind(v) for v in flag.value]
    except ValueError:
        raise ConfigError(f"--{flag.name}: not a list of {kind.__name__}s: "
                          f"{','.join(flag.value)}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--{flag.name}: every value must be > 0")
    return values


def rules_from_flags() -> list[plateau_replay.StopRule]:
    """The rules to replay.

    Returns:
      One rule per combination of --window, --tolerance and --min_evaluations.
    """
    windows = _numbers(_WINDOW, float)
    if any(w > 0.5 for w in windows):
        raise ConfigError("--window: at most 0.5 (two windows of the evaluations so far)")
    return [plateau_replay.StopRule(w, t, m) for w, t, m in itertools.product(
        windows, _numbers(_TOLERANCE, float), _numbers(_MIN_EVALUATIONS, int))]


def main(argv: list[str]) -> None:
    del argv
    try:
        rules = rules_from_flags()
        replays, stopped = plateau_replay.replay(_RUNS.value, rules)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    runs = len(next(iter(replays.values())))
    print(f"{runs} fixed-round runs under {_RUNS.value}"
          + (f" ({stopped} left out: they stopped early)" if stopped else "") + "\n")
    print(plateau_replay.summary_table(replays))
    if _PER_RUN.value:
        print("\n" + plateau_replay.per_run_table(replays))


def console() -> None:
    """`python -m launch.stop_audit` from a checkout; `fedjax-pfedes-stop-audit` installed."""
    cli.run(main, required=("runs",))


if __name__ == "__main__":
    console()
