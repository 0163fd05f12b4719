"""Learning rates tuned on validation data of a seed that is never reported, as `launch.compare`
does: each method runs `tuning_seed` (config.seed + 1000) on its clients' validation splits at
every rate of a grid of effective local steps (`grid_rate` scales it by the method's momentum),
optionally crossed with server rates; the best final mean personalized validation accuracy is
kept, and a rate where a reported seed diverged is dropped (`set_aside_diverged`,
`diverged_seeds`, `choose_rate`) so the next best is chosen."""

from __future__ import annotations

import os
import shutil

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.studies import experiments


def lr_field(config, algorithm: str) -> str:
    """The dotted config field of `algorithm`'s local learning rate."""
    section = config.get(algorithm)
    return f"{algorithm}.lr_local" if section is not None and "lr_local" in section \
        else "train.lr_local"


def method_momentum(config, algorithm: str) -> float:
    """The local heavy-ball momentum `algorithm` trains with: its section's `local_momentum`
    when set (>= 0), else `config.train.local_momentum`."""
    section = config.get(algorithm)
    m = section.get("local_momentum", -1) if section is not None else -1
    return float(m) if m >= 0 else float(config.train.local_momentum)


def grid_rate(config, algorithm: str, lr: float) -> float:
    """The learning rate of `algorithm` at grid point `lr` (an effective step at
    `config.train.local_momentum`): lr x (1 - its momentum) / (1 - train momentum)."""
    scale = (1.0 - method_momentum(config, algorithm)) / (1.0 - config.train.local_momentum)
    return float(f"{lr * scale:.6g}")


TUNING_SEED_OFFSET = 1000  # --seeds must stay below it


def tuning_seed(config) -> int:
    """The seed learning rates are tuned on, config.seed + 1000: never a reported seed
    (config.seed .. config.seed + --seeds - 1), and the same whatever --seeds is, so a
    comparison extended to more seeds reuses its tuning."""
    return config.seed + TUNING_SEED_OFFSET


def server_lr_field(config, algorithm: str) -> str | None:
    """`<algorithm>.server_lr` when the method's section has one, else None."""
    section = config.get(algorithm)
    return f"{algorithm}.server_lr" if section is not None and "server_lr" in section else None


def server_rate(config, algorithm: str, value: float | str) -> float:
    """A `--server_lr_grid` entry as `algorithm`'s server learning rate: a number as it is, or
    'Fx' as F times the rate the method's config section sets (server rates differ by orders
    of magnitude between methods: FedAdam's 0.01, FedAvgM's 0.1, SCAFFOLD's 1)."""
    if isinstance(value, str) and value.endswith("x"):
        return float(value[:-1]) * float(config[algorithm].server_lr)
    return float(value)


def grid_cells(config, algorithm: str, grid: list[float], server_grid: list[float | str]
               ) -> dict[str, dict]:
    """The tuning grid of `algorithm`: {cell name: overrides}, e.g. 'lr0.1' ->
    {'train.lr_local': 0.1}, and with a server grid for a method with a server_lr,
    'lr0.1_slr0.5' -> {..., 'fedavgm.server_lr': 0.5}. Local rates are `grid_rate`s, server
    rates `server_rate`s."""
    field, server = lr_field(config, algorithm), server_lr_field(config, algorithm)
    cells = {}
    for g in grid:
        lr = grid_rate(config, algorithm, g)
        if server is None or not server_grid:
            cells[f"lr{lr:g}"] = {"algorithm": algorithm, field: lr}
            continue
        for v in server_grid:
            slr = server_rate(config, algorithm, v)
            cells[f"lr{lr:g}_slr{slr:g}"] = {"algorithm": algorithm, field: lr, server: slr}
    return cells


def cell_of(config, algorithm: str, overrides: dict) -> str:
    """The cell name (`grid_cells`) of a tuned method's overrides."""
    name = f"lr{overrides[lr_field(config, algorithm)]:g}"
    server = server_lr_field(config, algorithm)
    return name + (f"_slr{overrides[server]:g}" if server in overrides else "")


def diverged_seeds(tuning_dir: str, method: str, cell, seed: int) -> list[int]:
    """Further seeds (not `seed`, the tuning seed) of `method` that diverged at grid `cell` (a
    cell name, or a learning rate for 'lr<rate>'): the runs `set_aside_diverged` kept under
    <tuning_dir>/<method>/<cell>/seed<k>."""
    folder = os.path.join(tuning_dir, method, cell if isinstance(cell, str) else f"lr{cell:g}")
    found = []
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        run_dir = os.path.join(folder, entry)
        if (entry.startswith("seed") and entry[len("seed"):].isdigit()  # not .replaced<n>
                and entry != f"seed{seed}"
                and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
                and experiments.training_diverged(experiments.read_rounds(run_dir))):
            found.append(int(entry[len("seed"):]))
    return found


def choose_rate(grid: list[float], scores: list[float], dropped: dict[float, list[int]]
                ) -> float:
    """The rate of `grid` with the best tuning-seed score (-inf: diverged) among those not
    `dropped` (a further seed diverged there); the best of all when every rate is dropped."""
    kept = [s if lr not in dropped else -np.inf for lr, s in zip(grid, scores, strict=True)]
    return grid[int(np.argmax(kept if np.isfinite(max(kept)) else scores))]


def set_aside_diverged(config, results: dict[str, list[dict]], tuned: dict[str, dict],
                       workdir: str, tuning: int | None = None) -> list[str]:
    """Moves each tuned method's diverged reported runs at its chosen rate (`tuning` is the
    tuning seed, never reported; default `tuning_seed`) to
    <workdir>/lr_tuning/<method>/lr<rate>/seed<k>, which drops that rate
    at the next `tune_learning_rates` (`diverged_seeds` reads them with the same
    `experiments.training_diverged` as the records). Returns what moved ('scaffold lr 0.05
    seed 1'), empty when nothing diverged or the rate was dropped already (every rate diverges:
    nothing better to choose). The method's other reported runs at that rate move beside them
    (kept as runs at the dropped rate: their folders, checkpoints included, would otherwise
    refuse the re-run at the next rate)."""
    moved = []
    tuning_dir = os.path.join(workdir, "lr_tuning")
    for method, records in results.items():
        if method not in tuned:
            continue
        cell = cell_of(config, method, tuned[method])
        seed = tuning_seed(config) if tuning is None else tuning
        if diverged_seeds(tuning_dir, method, cell, seed):
            continue  # chosen although dropped: every rate of the grid was dropped
        reported = [r for r in records if r["seed"] != seed]
        if not any(r["diverged"] for r in reported):
            continue
        for record in reported:
            dst = os.path.join(tuning_dir, method, cell, f"seed{record['seed']}")
            shutil.rmtree(dst, ignore_errors=True)
            shutil.move(record["run_dir"], dst)
            if record["diverged"]:
                moved.append(f"{method} {cell.replace('lr', 'lr ', 1)} seed {record['seed']}")
    return moved


def grid_edges(chosen: int, local_rates: int, server_rates: int = 1) -> list[str]:
    """Where a chosen cell lies on an edge of the grid, beyond which no rate was tried.

    Args:
      chosen: the cell's index, local rate major (`grid_cells`' order: local rate i, server
        rate j at i x server_rates + j).
      local_rates: how many local rates the grid has.
      server_rates: how many server rates each local rate was tried with (1: none).

    Returns:
      'the smallest local rate', 'the largest server rate', ...: empty inside the grid (an axis
      of one rate has no edge to report).
    """
    out = []
    for axis, position, count in (("local", chosen // server_rates, local_rates),
                                  ("server", chosen % server_rates, server_rates)):
        if count > 1 and position in (0, count - 1):
            out.append(f"the {'smallest' if position == 0 else 'largest'} {axis} rate")
    return out


def edge_note(edges: dict[str, list[str]]) -> str:
    """The sentence under the grid's table naming the methods tuned at an edge of it ('' when
    none): a rate beyond the edge may score better, and `--lr_grid` / `--server_lr_grid` can
    extend it (finished runs are reused)."""
    at_edge = [f"{method} ({' and '.join(where)})" for method, where in edges.items() if where]
    if not at_edge:
        return ""
    return ("Chosen at an edge of the grid, beyond which no rate was tried (extend the grid to "
            "see whether a rate past it scores better): " + ", ".join(at_edge) + ".")


def grid_cell(score: float, chosen: bool, diverged_on: list[int]) -> str:
    """One rate's cell of the grid table: the tuning seed's score (bold when chosen), and the
    further seeds that diverged at it (the rate was dropped)."""
    text = (f"**{score:.4f}**" if chosen else f"{score:.4f}") if np.isfinite(score) \
        else "diverged"
    if diverged_on:
        text += f" (diverged on seed {', '.join(map(str, diverged_on))})"
    return text


def _tuning_score(record: dict) -> float:
    """A tuning run's final mean personalized accuracy; -inf when it diverged (null: not
    finite)."""
    score = record["final"]["personalized_accuracy_mean"]
    return -np.inf if record.get("diverged") or not np.isfinite(np.float64(score)) else score


def tune_learning_rates(config, methods: list[str], grid: list[float], workdir: str,
                        server_grid: list[float | str] = (), show_progress: bool = True,
                        reuse: bool = True, run_missing: bool = True
                        ) -> tuple[dict[str, dict], str]:
    """Runs `tuning_seed` of every method on validation data at every rate of `grid`.

    Args:
      config: the comparison's base config.
      methods: the `config.algorithm`s to tune.
      grid: effective local steps (each method's own rate is its `grid_rate`).
      workdir: the comparison's; the runs go to <workdir>/lr_tuning/<method>/lr<rate>.
      server_grid: server rates (`server_rate`) for the methods that have one.
      show_progress: progress bars.
      reuse: take a finished run made with the same config (`experiments.run_grid`).
      run_missing: False: start no run (a report on what is finished).

    Returns:
      The variants at each method's best rate (`choose_rate`: rates where a reported seed
      diverged are dropped) and the grid as a Markdown table, with `edge_note`'s sentence
      under it when a method was tuned at an edge of the grid.
    """
    if not grid or any(not lr > 0 for lr in grid):
        raise ConfigError(f"--lr_grid: rates must be > 0, got {grid}")
    tuned, rows, edges = {}, [], {}
    tuning_dir = os.path.join(workdir, "lr_tuning")
    seed = tuning_seed(config)
    on_validation = experiments.with_overrides(config, {"seed": seed,
                                                        "data.validation_split": True})
    for a in methods:
        field = lr_field(config, a)
        cells = grid_cells(config, a, grid, list(server_grid))
        trials = {f"{a}/{cell}": overrides for cell, overrides in cells.items()}
        out = experiments.run_grid(on_validation, trials, 1, tuning_dir, show_progress,
                                   reuse=reuse, run_missing=run_missing)
        if not all(out.values()):  # only with --report_only: no rate can be chosen yet
            rows.append([f"{a} (`{field}`)", *(
                "not run yet" if not r else f"{r[0]['final']['personalized_accuracy_mean']:.4f}"
                for r in out.values())])
            continue
        scores = [_tuning_score(r[0]) for r in out.values()]
        names = list(cells)
        dropped = {c: seeds for c in names if (seeds := diverged_seeds(tuning_dir, a, c, seed))}
        best = choose_rate(names, scores, dropped)
        tuned[a] = cells[best]
        scaled = ("" if all(grid_rate(config, a, g) == g for g in grid)
                  else f", momentum {method_momentum(config, a):g}")
        per_row = len(names) // len(grid)  # server rates per local rate (1 without)
        edges[a] = grid_edges(names.index(best), len(grid), per_row)
        for r in range(per_row):
            row = names[r::per_row]
            server = server_lr_field(config, a)
            label = (f"{a} (`{field}`{scaled})" if per_row == 1 else
                     f"{a} (`{field}`{scaled}; server lr {cells[row[0]][server]:g})")
            rows.append([label, *((f"{cells[c][field]:g}: " if scaled else "")
                                  + grid_cell(scores[names.index(c)], c == best,
                                              dropped.get(c, [])) for c in row)])
    table = markdown.table(["method", *(f"effective step {lr:g}" for lr in grid)], rows)
    note = edge_note(edges)
    return tuned, table + (f"\n\n{note}" if note else "")


def check_unseen_seeds(config, first: int, seeds: int) -> None:
    """ConfigError unless `first` is -1 (none) or starts a range of `seeds` seeds that overlaps
    neither the reported seeds (config.seed ..) nor the tuning seed."""
    if first == -1:
        return
    unseen = set(range(first, first + seeds))
    if first < 0 or unseen & set(range(config.seed, config.seed + seeds)) \
            or tuning_seed(config) in unseen:
        raise ConfigError(
            f"--unseen_seeds={first}: the range {first}..{first + seeds - 1} must be >= 0 and "
            f"overlap neither the reported seeds {config.seed}..{config.seed + seeds - 1} nor "
            f"the tuning seed {tuning_seed(config)}")
