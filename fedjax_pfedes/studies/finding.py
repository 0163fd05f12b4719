"""What a finding of docs/design.md is as an experiment (`Finding`: claim, rule, variants,
analysis), what its analysis returns (`Verdict`), and the figures the analyses share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_collections
import numpy as np

from fedjax_pfedes.studies.paired_verdicts import (
    curve,
)

Records = dict[str, list[dict]]  # variant name -> one record per seed (experiments.run_grid)

@dataclasses.dataclass(frozen=True)
class Verdict:
    verdict: str
    table: str            # Markdown
    reason: str           # one sentence with the numbers the rule compared
    figure: str = ""      # path of the PNG ('' = none)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding: its claim, the rule deciding it, its variants and its analysis."""

    id: str
    claim: str
    rule: str
    variants: Callable[[ml_collections.ConfigDict], dict[str, dict]]
    analyse: Callable[[Records, ml_collections.ConfigDict, dict[str, dict], str], Verdict]


# ---------------------------------------------------------------------------- helpers


def nanmean(values) -> float:
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else float("nan")


def plot_figure(path: str, title: str, draw: Callable) -> str:
    from fedjax_pfedes.io.plotting import plt, save

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    draw(ax)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path, dpi=100)


def curves_plot(records: Records, names: dict[str, str], key: str, ylabel: str, path: str,
                 title: str) -> str:
    def draw(ax):
        for name, label in names.items():
            c = curve(records[name], key)
            rounds = np.arange(1, c.shape[1] + 1)
            mean = np.nanmean(np.where(np.isfinite(c), c, np.nan), axis=0)
            ax.plot(rounds, mean, "-o", ms=2.5, label=label)
            if c.shape[0] > 1:
                std = np.nanstd(c, axis=0)
                ax.fill_between(rounds, mean - std, mean + std, alpha=0.15)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)

    return plot_figure(path, title, draw)


DEFAULT = "pfedes_default"  # the base config's pFedES run, shared by F3-F7
