"""Learning rates tuned on validation data of a seed that is never reported, as `launch.compare`
does: each method runs `tuning_seed` (config.seed + 1000) on its clients' validation splits at
every rate of a grid of effective local steps (`grid_rate` scales it by the method's momentum),
optionally crossed with server rates; the best final mean personalized validation accuracy is
kept, and a rate where a reported seed diverged is dropped (`set_aside_diverged`,
`diverged_seeds`, `choose_rate`) so the next best is chosen."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.studies import experiments
from fedjax_pfedes.studies.run_pool import RunPool


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
    `dropped` (a further seed diverged there); the best of all when every rate is dropped. Of
    equal scores the first in `grid` (in ascending order: the smallest rate)."""
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


def _one_two_five(rate: float) -> tuple[int, int] | None:
    """(index of the mantissa in 1, 2, 5; the decade) when `rate` is on the 1-2-5 series
    (0.002 -> (1, -3)), else None."""
    decade = int(np.floor(np.log10(rate) + 1e-9))
    mantissa = rate / 10.0 ** decade
    for i, m in enumerate((1.0, 2.0, 5.0)):
        if abs(mantissa - m) <= 1e-6 * m:
            return i, decade
    return None


def rate_past_edge(grid: list[float], side: str) -> float:
    """The next rate beyond one edge of a grid of rates.

    Args:
      grid: the rates tried (at least one; any order).
      side: 'smallest' or 'largest': the edge to go past.

    Returns:
      On the 1-2-5 series when every rate of `grid` is on it (0.002 -> 0.001, 0.05 -> 0.1);
      otherwise the edge's ratio to its neighbour continued (0.003, 0.01 -> 0.0009), or a
      factor of 2 for a grid of one rate.
    """
    rates = sorted(grid)
    edge = rates[0] if side == "smallest" else rates[-1]
    step = -1 if side == "smallest" else 1
    if all(_one_two_five(r) is not None for r in rates):
        i, decade = _one_two_five(edge)
        i += step
        decade, i = decade + i // 3, i % 3
        return float(f"{(1.0, 2.0, 5.0)[i] * 10.0 ** decade:.6g}")
    if len(rates) == 1:
        return float(f"{edge * 2.0 ** step:.6g}")
    neighbour = rates[1] if side == "smallest" else rates[-2]
    return float(f"{edge * edge / neighbour:.6g}")


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


@dataclasses.dataclass
class _MethodTuning:
    """One method's tuning: the effective steps it was tried at, its cells' scores, the chosen
    cell (None until every run is finished) and where that lies on its grid's edges."""

    rates: list[float]
    cells: dict[str, dict]
    scores: dict[str, float]
    dropped: dict[str, list[int]]
    best: str | None = None
    edges: list[str] = dataclasses.field(default_factory=list)


def _trials(a: str, cells: dict[str, dict]) -> dict[str, dict]:
    """Method `a`'s tuning runs at its grid `cells`: '<method>/<cell>' -> overrides."""
    return {f"{a}/{cell}": overrides for cell, overrides in cells.items()}


def _tune_method(config, a: str, grid: list[float], server_grid: list, on_validation,
                 tuning_dir: str, extend_edges: int, show_progress: bool, reuse: bool,
                 run_missing: bool, pool: RunPool | None) -> _MethodTuning:
    """`a` tuned over `grid`, then, while its choice lies on an edge of the local rates and
    fewer than `extend_edges` rates were added, over one rate past that edge more
    (`rate_past_edge`; a finished run there is reused like any other)."""
    rates, seed = sorted(grid), tuning_seed(config)
    while True:
        cells = grid_cells(config, a, rates, server_grid)
        out = experiments.run_grid(on_validation, _trials(a, cells), 1, tuning_dir,
                                   show_progress, reuse=reuse, run_missing=run_missing,
                                   pool=pool)
        records = dict(zip(cells, out.values(), strict=True))
        if not all(records.values()):  # only with --report_only: no rate can be chosen yet
            return _MethodTuning(rates, cells, {c: _tuning_score(r[0])
                                                for c, r in records.items() if r}, {})
        scores = {c: _tuning_score(r[0]) for c, r in records.items()}
        names = list(cells)
        dropped = {c: seeds for c in names if (seeds := diverged_seeds(tuning_dir, a, c, seed))}
        best = choose_rate(names, list(scores.values()), dropped)
        edges = grid_edges(names.index(best), len(rates), len(names) // len(rates))
        local = [e for e in edges if e.endswith("local rate")]
        added = len(rates) - len(grid)
        if not local or added >= extend_edges:  # (a single rate has no edge: `grid_edges`)
            return _MethodTuning(rates, cells, scores, dropped, best, edges)
        rates = sorted(rates + [rate_past_edge(rates, local[0].split()[1])])


def _grid_rows(config, a: str, t: _MethodTuning, columns: list[float]) -> list[list[str]]:
    """The grid table's rows of method `a`: one per server rate, a cell per column (an
    effective step; '—' where `a` was not tried)."""
    field, server = lr_field(config, a), server_lr_field(config, a)
    names = list(t.cells)
    per_row = len(names) // len(t.rates)  # server rates per local rate (1 without)
    scaled = ("" if all(grid_rate(config, a, g) == g for g in t.rates)
              else f", momentum {method_momentum(config, a):g}")
    rows = []
    for r in range(per_row):
        row = dict(zip(t.rates, names[r::per_row], strict=True))
        label = (f"{a} (`{field}`{scaled})" if per_row == 1 else
                 f"{a} (`{field}`{scaled}; server lr {t.cells[row[t.rates[0]]][server]:g})")

        def cell(c):
            if t.best is None:
                return grid_cell(t.scores[c], False, []) if c in t.scores else "not run yet"
            return ((f"{t.cells[c][field]:g}: " if scaled else "")
                    + grid_cell(t.scores[c], c == t.best, t.dropped.get(c, [])))
        rows.append([label, *(cell(row[g]) if g in row else "—" for g in columns)])
    return rows


def tune_learning_rates(config, methods: list[str], grid: list[float], workdir: str,
                        server_grid: list[float | str] = (), show_progress: bool = True,
                        reuse: bool = True, run_missing: bool = True, extend_edges: int = 0,
                        pool: RunPool | None = None) -> tuple[dict[str, dict], str]:
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
      extend_edges: for a method whose best local rate is the grid's smallest or largest, try
        one rate past that edge (`rate_past_edge`), up to this many more rates per method.
      pool: where the runs execute (`experiments.run_grid`); with several workers every
        method's grid is handed over at once, so no worker waits for one method's last run.

    Returns:
      The variants at each method's best rate (`choose_rate`: rates where a reported seed
      diverged are dropped) and the grid as a Markdown table (a column per effective step
      any method was tried at), with sentences under it naming the rates tried past an edge
      and the methods still tuned at one (`edge_note`).
    """
    if not grid or any(not lr > 0 for lr in grid):
        raise ConfigError(f"--lr_grid: rates must be > 0, got {grid}")
    tuning_dir = os.path.join(workdir, "lr_tuning")
    on_validation = experiments.with_overrides(config, {"seed": tuning_seed(config),
                                                        "data.validation_split": True})
    if pool is not None and pool.jobs > 1 and run_missing:
        for a in methods:
            cells = grid_cells(config, a, sorted(grid), list(server_grid))
            experiments.submit_grid(on_validation, _trials(a, cells), 1, tuning_dir, pool,
                                    reuse)
    tunings = {a: _tune_method(config, a, grid, list(server_grid), on_validation, tuning_dir,
                               extend_edges, show_progress, reuse, run_missing, pool)
               for a in methods}
    columns = sorted({g for t in tunings.values() for g in t.rates})
    rows = [row for a, t in tunings.items() for row in _grid_rows(config, a, t, columns)]
    table = markdown.table(["method", *(f"effective step {lr:g}" for lr in columns)], rows)
    extended = [f"{a} {', '.join(f'{g:g}' for g in t.rates if g not in grid)}"
                for a, t in tunings.items() if len(t.rates) > len(grid)]
    notes = [edge_note({a: t.edges for a, t in tunings.items()})]
    if extended:
        notes.insert(0, "Tried past an edge of the grid, where the best rate was an edge "
                        f"(--extend_edges={extend_edges}): " + "; ".join(extended) + ".")
    tuned = {a: t.cells[t.best] for a, t in tunings.items() if t.best is not None}
    return tuned, table + "".join(f"\n\n{n}" for n in notes if n)


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
