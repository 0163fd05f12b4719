"""`--jobs`, the flag of every program that makes a study's runs (`launch.compare`,
`launch.findings`, `launch.sweep_heterogeneity`): how many runs at a time
(`studies.run_pool`)."""

from __future__ import annotations

from absl import flags

from fedjax_pfedes.studies.run_pool import RunPool

JOBS = flags.DEFINE_integer(
    "jobs", 1, "Runs at a time, each in a worker process (the same runs, numbers and tables as "
    "one at a time; docs/performance.md).", lower_bound=1)


def run_pool(show_progress: bool) -> RunPool:
    """The pool `--jobs` asks for; use it as a context manager around the study's runs."""
    return RunPool(JOBS.value, show_progress)
