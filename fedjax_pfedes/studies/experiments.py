"""Running several experiments under identical data and sampling seeds, and tabulating them.

`launch.compare` (methods side by side) and `launch.sweep_heterogeneity` (findings F1/F2 of
docs/design.md) are thin wrappers around `run_grid`. Every run is a fresh
`engine.loop.run_experiment`, in this process or in a worker process of a `run_pool.RunPool`:
algorithms are rebuilt from the config each time, so no state carries over.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.config.defaults import TrainSection
from fedjax_pfedes.engine.plateau import plateau_reached
from fedjax_pfedes.io import metrics
from fedjax_pfedes.studies.run_pool import Later, RunPool
from fedjax_pfedes.studies.run_reuse import finished_run


def heterogeneous_architectures(num_clients: int, ratio: float, majority: str,
                                others: Sequence[str]) -> str:
    """A `config.clients.architectures` string where round(ratio * N) clients differ from the
    majority architecture (the heterogeneity ratio of docs/design.md), spread over `others` in
    turn."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"heterogeneity ratio must be in [0, 1], got {ratio}")
    minority = int(round(ratio * num_clients))
    counts = {majority: num_clients - minority}
    for k in range(minority):
        counts[others[k % len(others)]] = counts.get(others[k % len(others)], 0) + 1
    if max(counts.values()) > counts[majority]:
        need = -(-minority // max(counts[majority], 1))  # ceil: others at most the majority's
        raise ValueError(f"heterogeneity ratio {ratio:g} of {num_clients} clients: with "
                         f"{len(others)} other architecture(s) one of them outnumbers "
                         f"'{majority}', so the share differing from the majority would be "
                         f"{1 - max(counts.values()) / num_clients:g}; it needs >= {need} "
                         "other architectures")
    return ",".join(f"{arch}:{n}" for arch, n in counts.items() if n > 0)


# Per-round metrics kept in a grid's records (the findings read them).
CURVES = ("train_ce_loss_mean", "train_align_loss_mean", "train_proxy_align_loss_mean",
          "loss_before_aggregation", "loss_after_aggregation", "align_loss_before_aggregation",
          "align_loss_after_aggregation", "proxy_update_norm_mean")


def read_rounds(run_dir: str) -> list[dict]:
    """Every round's record of the run in `run_dir` (its metrics.jsonl)."""
    return metrics.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def run_wall_time_s(summary: dict, every_round: list[dict]) -> float:
    """A run's wall time with every process that made its rounds: summary.json's
    `wall_time_s`, which counts a resumed run's earlier processes since `resumed_wall_time_s`
    was written beside it; in an older summary only the last process's, to which the earlier
    processes' shares of its metrics.jsonl are added (`io.metrics.process_wall_times`)."""
    if "resumed_wall_time_s" in summary:
        return summary["wall_time_s"]
    return summary["wall_time_s"] + sum(metrics.process_wall_times(every_round)[:-1])


def training_diverged(every_round: list[dict]) -> bool:
    """Non-finite training losses in any round (written as null in the records): the run
    diverged (its accuracy is then that of NaN logits, not of a model)."""
    return any(v is None or not np.isfinite(v) for r in every_round for k, v in r.items()
               if k.startswith("train_") and k.endswith("_loss_mean"))


def run_record(config: ml_collections.ConfigDict, summary: dict, run_dir: str) -> dict:
    """What tables and figures read of a finished run: its final metrics, the evaluated
    accuracy curve, every round's losses, upload size, wall time, divergence."""
    every_round = read_rounds(run_dir)
    rows = [r for r in every_round if "personalized_accuracy_mean" in r]  # evaluated rounds
    return {
        "seed": config.seed, "final": summary["final"], "run_dir": run_dir,
        "rounds": [r["round"] for r in rows],
        "personalized_accuracy": [r["personalized_accuracy_mean"] for r in rows],
        # None at an evaluation that skipped the global test set (`eval.global_every`).
        "global_accuracy": [r.get("global_accuracy_mean") for r in rows],
        "upload_params_per_client": summary["final"]["upload_params_per_client"],
        "wall_time_s": run_wall_time_s(summary, every_round),
        "majority_class_accuracy_mean": summary["majority_class_accuracy_mean"],
        # Every round's training and monitoring losses (None where a round lacks one).
        "curves": {k: [r.get(k) for r in every_round] for k in CURVES},
        "diverged": training_diverged(every_round),
        "uploads_rejected_total": summary["final"].get("uploads_rejected_total"),
        # With config.train.stop_at_plateau: the round it stopped at, or None when it ran to
        # train.rounds without reaching the plateau (absent without the rule).
        **({"stopped_at_round": summary["stopped_early"]["round"]
            if summary.get("stopped_at_plateau") else None, "max_rounds": config.train.rounds}
           if "stopped_at_plateau" in summary else {}),
    }


def stopping_rounds(runs: list[dict]) -> str:
    """The rounds each seed's run stopped at under `config.train.stop_at_plateau` ('max' for a
    run that reached `train.rounds` instead, 'diverged' for one that diverged: either makes
    its comparison inconclusive), or '' when the runs did not use the rule."""
    if not runs or not all("stopped_at_round" in r for r in runs):
        return ""
    return "/".join("diverged" if r.get("diverged") else "max" if r["stopped_at_round"] is None
                    else str(r["stopped_at_round"]) for r in runs)


def hit_max_rounds(runs: list[dict]) -> int:
    """How many of `runs` stopped at `train.rounds` before a plateau, without diverging (0
    without the rule)."""
    return sum(1 for r in runs if "stopped_at_round" in r and r["stopped_at_round"] is None
               and not r.get("diverged"))


def diverged_before_plateau(runs: list[dict]) -> int:
    """How many of `runs` diverged under the plateau rule (0 without the rule)."""
    return sum(1 for r in runs if "stopped_at_round" in r and r.get("diverged"))


def unknown_fields(base: ml_collections.ConfigDict, overrides: dict[str, Any]) -> list[str]:
    """The dotted fields of `overrides` that `base` does not have (an override would add them
    silently and run the base config)."""
    out = []
    for dotted in overrides:
        node = base
        for part in dotted.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                out.append(dotted)
                break
            node = node[part]
    return out


def with_overrides(base: ml_collections.ConfigDict, overrides: dict[str, Any],
                   type_safe: bool = True) -> ml_collections.ConfigDict:
    """A copy of `base` with dotted overrides applied ({"train.lr_local": 0.1, ...}).
    `type_safe=False` accepts values of another type (a JAX tracer: `sweep`)."""
    config = ml_collections.ConfigDict(base.to_dict(), type_safe=type_safe)
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def run_grid(base: ml_collections.ConfigDict, variants: dict[str, dict[str, Any]],
             seeds: int, workdir: str, show_progress: bool = True, reuse: bool = False,
             on_seed_done: Callable[[dict[str, list[dict]]], None] | None = None,
             run_missing: bool = True, pool: RunPool | None = None) -> dict[str, list[dict]]:
    """Runs every variant (name -> dotted config overrides) for seeds base.seed .. +seeds-1.

    Seeds are the outer loop, so after the first seed every variant has one result.

    Args:
      reuse: take a run whose <workdir>/<name>/seed<k>/summary.json was written with exactly
        the same config instead of running it again (resuming an interrupted grid).
      on_seed_done: called with the results so far after each seed (e.g. to write the table).
      run_missing: False = start no run: only finished runs (reuse) are collected, so a variant
        may have fewer records than `seeds` (a report on an unfinished grid).
      pool: where the runs execute (`run_pool.RunPool`: several at a time in worker
        processes); default: in this process, one after another. The results are the same.

    Returns:
      name -> one record per seed: the summary's final metrics, the personalized/global accuracy
      curve, upload size and wall time. Each run's files go to <workdir>/<name>/seed<k>.
    """
    planned = submit_grid(base, variants, seeds, workdir, pool or RunPool(1, show_progress),
                          reuse, run_missing)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for seed_runs in planned:
        for name, config, run_dir, outcome in seed_runs:
            if outcome is not None:
                results[name].append(run_record(config, outcome.result(), run_dir))
        if on_seed_done is not None:
            on_seed_done(results)
    return results


def submit_grid(base: ml_collections.ConfigDict, variants: dict[str, dict[str, Any]],
                seeds: int, workdir: str, pool: RunPool, reuse: bool = False,
                run_missing: bool = True) -> list[list[tuple]]:
    """`run_grid`'s runs handed to `pool` (a finished run reused instead, with `reuse`; none
    started without `run_missing`), without waiting for them.

    Returns:
      Per seed, (name, config, run folder, outcome) per variant: `outcome.result()` is the
      run's summary; the outcome is None for a run neither finished nor started.
    """
    planned = []
    for s in range(seeds):
        seed_runs = []
        for name, overrides in variants.items():
            config = with_overrides(base, overrides)
            config.seed = base.seed + s
            run_dir = os.path.join(workdir, name, f"seed{config.seed}")
            summary = finished_run(config, run_dir) if reuse or not run_missing else None
            outcome = (Later(lambda s=summary: s) if summary is not None
                       else pool.submit(config, run_dir) if run_missing else None)
            seed_runs.append((name, config, run_dir, outcome))
        planned.append(seed_runs)
    return planned


def mean_std(values: Sequence[float], digits: int = 4) -> str:
    """'mean ± std' over seeds; seeds with a non-finite value are counted as diverged and left
    out of the mean (said in the cell)."""
    v = np.asarray(values, np.float64)
    finite = v[np.isfinite(v)]
    if len(finite) == 0:
        return f"diverged ({len(v)}/{len(v)} seeds)"
    cell = f"{finite.mean():.{digits}f}"
    if len(finite) > 1:
        cell += f" ± {finite.std():.{digits}f}"
    if len(finite) < len(v):
        cell += f" (diverged in {len(v) - len(finite)}/{len(v)} seeds)"
    return cell


# The rule of `config.train.stop_at_plateau`, at its defaults (one declaration).
PLATEAU_WINDOW, PLATEAU_TOLERANCE = TrainSection.plateau_window, TrainSection.plateau_tolerance


def at_plateau(record: dict) -> bool:
    """Whether a run's personalized-accuracy curve has flattened: with k = the last 20 % of its
    evaluated rounds (at least 1), the mean over the last k differs from the mean over the k
    before by less than 0.5 points. A diverged run, or one with fewer than 2 evaluations, is
    not at a plateau."""
    if record.get("diverged"):
        return False
    return plateau_reached(record.get("personalized_accuracy", []), PLATEAU_WINDOW,
                           PLATEAU_TOLERANCE)


def plateau_note(records: dict[str, list[dict]]) -> str:
    """One sentence: how many runs reached a plateau (`at_plateau`), naming the variants with
    runs that did not."""
    runs = [(name, at_plateau(r)) for name, rs in records.items() for r in rs]
    short = sorted({name for name, ok in runs if not ok})
    text = (f"Runs at a plateau (last 20 % of evaluated rounds within 0.5 points of the 20 % "
            f"before): {sum(ok for _, ok in runs)} of {len(runs)}")
    return text + (f"; still moving in {', '.join(short)}" if short else "") + "."


def rejected_per_seed(runs: list[dict]) -> str:
    """Uploads the server rejected over a whole run, per seed ('0' when none in any; '?' for
    runs recorded before the count was kept): a comparison must show when a method's honest
    uploads are filtered (the norm rule is on by default)."""
    counts = [r.get("uploads_rejected_total") for r in runs]
    if any(c is None for c in counts):
        return "?"
    return "0" if not any(counts) else "/".join(str(int(c)) for c in counts)


def markdown_table(results: dict[str, list[dict]], seeds: int | None = None) -> str:
    """Method | personalized acc (mean ± std over seeds) | global acc | upload | uploads
    rejected per seed | runs at a plateau (`at_plateau`) | wall time.
    With `seeds`, a method with fewer finished seeds says so in its row. Runs made with
    `config.train.stop_at_plateau` add the round each seed stopped at ('max': it reached
    `train.rounds` first, and comparisons with it are inconclusive)."""
    stopping = any(stopping_rounds(runs) for runs in results.values())
    header = ["method", "mean personalized accuracy", "mean global accuracy",
              "upload params / client / round", "uploads rejected", "at a plateau",
              *(["stopped at round"] if stopping else []), "wall time s"]
    rows = []
    for name, runs in results.items():
        diverged = sum(bool(r.get("diverged")) for r in runs)
        note = f" (diverged: non-finite training loss in {diverged}/{len(runs)} seeds)" \
            if diverged else ""
        if seeds is not None and len(runs) < seeds:
            note += f" ({len(runs)} of {seeds} seeds)"
        rows.append([
            name, mean_std([r["final"]["personalized_accuracy_mean"] for r in runs]) + note,
            mean_std([r["final"]["global_accuracy_mean"] for r in runs]),
            f"{int(np.mean([r['upload_params_per_client'] for r in runs])):,}",
            rejected_per_seed(runs), f"{sum(at_plateau(r) for r in runs)}/{len(runs)}",
            *([stopping_rounds(runs) or "-"] if stopping else []),
            f"{np.mean([r['wall_time_s'] for r in runs]):.0f}"])
    return markdown.table(header, rows)


def paired_difference(runs: list[dict], reference: list[dict], metric: str,
                      confidence: float = 0.95) -> dict[str, float]:
    """Mean of the per-seed differences runs - reference of `final[metric]`, paired by seed
    (same seed: same data split, clients and sampling), with a Student-t confidence interval.

    Args:
      runs: one arm's results (`run_grid` rows), matched on their `seed`.
      reference: the other arm's.
      metric: a key of each run's `final` record, e.g. 'personalized_accuracy_mean'.
      confidence: the interval's coverage.

    Returns:
      {'n', 'mean', 'low', 'high'}: seeds paired and the interval; a diverged seed counts
      (its metric as recorded), it is never dropped. With one pair the interval is unbounded.
    """
    ref = {r["seed"]: r["final"][metric] for r in reference}
    d = np.array([r["final"][metric] - ref[r["seed"]] for r in runs if r["seed"] in ref],
                 np.float64)
    if len(d) == 0:
        return {"n": 0, "mean": float("nan"), "low": float("nan"), "high": float("nan")}
    mean, low, high = student_t_interval(d, confidence)
    return {"n": int(len(d)), "mean": mean, "low": low, "high": high}


def student_t_interval(diffs: Sequence[float],
                       confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean of `diffs`. A NaN in `diffs` (a
    seed without a value), fewer than 2 values or values without any spread leave it
    unbounded (-inf, inf): a zero sample deviation (two seeds that happen to give the same
    difference, common when accuracies are counts over one test set) says nothing about the
    noise, and the Student-t interval would collapse onto the mean and "exclude 0".

    Args:
      diffs: per-seed paired differences.
      confidence: the interval's coverage.

    Returns:
      The mean (NaN when a value is: a seed without a value is never left out of it) and the
      interval's ends.
    """
    from scipy import stats
    d = np.asarray(diffs, np.float64)
    mean = float(d.mean()) if len(d) else float("nan")
    if not np.all(np.isfinite(d)) or len(d) < 2 or np.all(d == d[0]):
        return mean, -float("inf"), float("inf")
    half = float(stats.t.ppf(0.5 + confidence / 2, len(d) - 1) * d.std(ddof=1)
                 / np.sqrt(len(d)))
    return mean, mean - half, mean + half


def paired_table(results: dict[str, list[dict]], pairs: dict[str, str]) -> str:
    """Markdown: per arm, its paired difference from its reference arm (`pairs`: arm ->
    reference) in personalized and global accuracy, mean [95% CI] over the paired seeds, and
    whether the interval excludes 0. A run that reached `train.rounds` or diverged before its
    plateau (under `config.train.stop_at_plateau`) makes its pair inconclusive whatever the
    interval."""
    rows = []
    for arm, ref in pairs.items():
        cells = []
        for metric in ("personalized_accuracy_mean", "global_accuracy_mean"):
            p = paired_difference(results[arm], results[ref], metric)
            verdict = "" if p["low"] <= 0 <= p["high"] else " (excludes 0)"
            unfinished = hit_max_rounds(results[arm]) + hit_max_rounds(results[ref])
            diverged = diverged_before_plateau(results[arm]) + diverged_before_plateau(
                results[ref])
            if unfinished or diverged:
                why = [f"{unfinished} run(s) reached train.rounds" if unfinished else "",
                       f"{diverged} run(s) diverged" if diverged else ""]
                verdict += (f" (inconclusive: {' and '.join(w for w in why if w)} before a "
                            "plateau)")
            cells.append(f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]{verdict}")
        n = paired_difference(results[arm], results[ref], "personalized_accuracy_mean")["n"]
        rows.append([arm, ref, n, *cells])
    return markdown.table(["arm", "against", "seeds", "Δ personalized accuracy [95% CI]",
                           "Δ global accuracy [95% CI]"], rows)


def curve_over_seeds(runs: list[dict], key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(rounds, mean, std) of `key` over seeds, per round; a seed that stopped early (a diverged
    run ends at the round it diverged) counts only for the rounds it reached."""
    rounds = sorted({t for r in runs for t in r["rounds"]})
    curves = np.full((len(runs), len(rounds)), np.nan)
    for i, r in enumerate(runs):
        at = dict(zip(r["rounds"], r[key], strict=True))
        curves[i] = [at.get(t, np.nan) for t in rounds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a round every seed lacks: NaN
        return rounds, np.nanmean(curves, 0), np.nanstd(curves, 0)


def accuracy_curves(results: dict[str, list[dict]], path: str, title: str) -> str:
    """PNG: personalized and global accuracy vs round, mean ± std over seeds
    (`curve_over_seeds`)."""
    from fedjax_pfedes.io.plotting import plt, save

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colors = plt.get_cmap("tab20")
    for k, (name, runs) in enumerate(results.items()):
        for ax, key in zip(axes, ("personalized_accuracy", "global_accuracy"), strict=True):
            rounds, mean, std = curve_over_seeds(runs, key)
            ax.plot(rounds, mean, "-o", ms=3, color=colors(k % 20), label=name)
            ax.fill_between(rounds, mean - std, mean + std, color=colors(k % 20), alpha=0.15)
    for ax, what in zip(axes, ("personalized (local test split)", "global (global test set)"),
                        strict=True):
        ax.set_xlabel("round")
        ax.set_title(what, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean accuracy over clients")
    fig.suptitle(title, fontsize=10)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save(fig, path)
