"""Plots and a Markdown summary of a run directory.

  python -m launch.report runs/quickstart

Writes <workdir>/report/{accuracy,losses,aggregation_loss,update_norms,participation,
participants,privacy}.png (privacy only when DP is on) and <workdir>/report.md linking them.
Works on finished, running and resumed runs (it reads metrics.jsonl, clients.jsonl, summary.json).
"""

from __future__ import annotations

import os
import sys

from fedjax_pfedes.io.run_report import write_report
from fedjax_pfedes.launch import cli


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        print("usage: python -m launch.report WORKDIR", file=sys.stderr)
        sys.exit(2)
    try:
        plots = write_report(argv[1])
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not os.path.exists(os.path.join(argv[1], "summary.json")):
        print(f"note: {argv[1]} has no summary.json yet (a run in progress): the report covers "
              "the complete rounds written so far")
    for name, path in plots.items():
        print(f"{name:18s} {path}")
    print(f"summary            {argv[1].rstrip('/')}/report.md")


def console() -> None:
    """`python -m launch.report` from a checkout; `fedjax-pfedes-report` installed."""
    cli.run(main, takes_words=True)


if __name__ == "__main__":
    console()
