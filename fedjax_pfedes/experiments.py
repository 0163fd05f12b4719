"""Running several experiments under identical data and sampling seeds, and tabulating them.

`launch.compare` (methods side by side) and `launch.sweep_heterogeneity` (the seed's findings F1/F2)
are thin wrappers around `run_grid`. Every run is a fresh `simulation.run_experiment` in the same
process: algorithms are rebuilt from the config each time, so no state carries over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from fedjax_pfedes.simulation import run_experiment


def heterogeneous_architectures(num_clients: int, ratio: float, majority: str,
                                others: Sequence[str]) -> str:
    """A `config.clients.architectures` string where round(ratio * N) clients differ from the
    majority architecture (the seed's heterogeneity ratio), spread over `others` in turn."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"heterogeneity ratio must be in [0, 1], got {ratio}")
    minority = int(round(ratio * num_clients))
    counts = {majority: num_clients - minority}
    for k in range(minority):
        counts[others[k % len(others)]] = counts.get(others[k % len(others)], 0) + 1
    return ",".join(f"{arch}:{n}" for arch, n in counts.items() if n > 0)


def run_grid(base: ml_collections.ConfigDict, variants: dict[str, dict[str, Any]],
             seeds: int, workdir: str, show_progress: bool = True) -> dict[str, list[dict]]:
    """Runs every variant (name -> dotted config overrides) for seeds base.seed .. +seeds-1.

    Returns:
      name -> one record per seed: the summary's final metrics, the personalized/global accuracy
      curve, upload size and wall time. Each run's files go to <workdir>/<name>/seed<k>.
    """
    results: dict[str, list[dict]] = {}
    for name, overrides in variants.items():
        for s in range(seeds):
            config = ml_collections.ConfigDict(base.to_dict())
            for dotted, value in overrides.items():
                node = config
                *parents, leaf = dotted.split(".")
                for p in parents:
                    node = node[p]
                node[leaf] = value
            config.seed = base.seed + s
            run_dir = os.path.join(workdir, name, f"seed{config.seed}")
            summary = run_experiment(config, run_dir, show_progress=show_progress)
            rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            results.setdefault(name, []).append({
                "seed": config.seed, "final": summary["final"],
                "rounds": [r["round"] for r in rows],
                "personalized_accuracy": [r["personalized_accuracy_mean"] for r in rows],
                "global_accuracy": [r["global_accuracy_mean"] for r in rows],
                "upload_params_per_client": summary["final"]["upload_params_per_client"],
                "wall_time_s": summary["wall_time_s"],
                "majority_class_accuracy_mean": summary["majority_class_accuracy_mean"],
            })
    return results


def _mean_std(values: Sequence[float]) -> str:
    v = np.asarray(values, np.float64)
    return f"{v.mean():.4f} ± {v.std():.4f}" if len(v) > 1 else f"{v.mean():.4f}"


def markdown_table(results: dict[str, list[dict]]) -> str:
    """Method | personalized acc (mean ± std over seeds) | global acc | upload | wall time."""
    lines = ["| method | mean personalized accuracy | mean global accuracy | "
             "upload params / client / round | wall time s |", "|---|---|---|---|---|"]
    for name, runs in results.items():
        lines.append(
            f"| {name} | {_mean_std([r['final']['personalized_accuracy_mean'] for r in runs])} | "
            f"{_mean_std([r['final']['global_accuracy_mean'] for r in runs])} | "
            f"{int(np.mean([r['upload_params_per_client'] for r in runs])):,} | "
            f"{np.mean([r['wall_time_s'] for r in runs]):.0f} |")
    return "\n".join(lines)


def accuracy_curves(results: dict[str, list[dict]], path: str, title: str) -> str:
    """PNG: personalized (solid) and global (dashed) accuracy vs round, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, (name, runs) in enumerate(results.items()):
        color = f"C{k}"
        rounds = runs[0]["rounds"]
        for key, style in (("personalized_accuracy", "-"), ("global_accuracy", "--")):
            curves = np.array([r[key] for r in runs])
            mean, std = curves.mean(0), curves.std(0)
            ax.plot(rounds, mean, style, color=color,
                    label=f"{name} ({'personalized' if style == '-' else 'global'})")
            ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("mean accuracy over clients")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
