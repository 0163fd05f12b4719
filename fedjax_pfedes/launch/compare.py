"""Compares federated methods under identical data, clients and sampling seeds.

  python -m launch.compare --config=configs/quickstart.py \
      --algorithms=pfedes,standalone,fedavg,fedprox --seeds=3 --workdir=runs/compare

Runs every method for each seed (config.seed, +1, ...), then writes <workdir>/comparison.md
(mean personalized accuracy ± std over seeds, global accuracy, upload parameters per client per
round, wall time), comparison.json and accuracy_curves.png.

With `--lr_grid=0.01,0.02,0.05,0.1` (and `--server_lr_grid=0.3x,1x,3x` for the methods with a
server learning rate: FedAvgM, FedAdam, SCAFFOLD, FedNova, FedGH; 'Fx' is F times the method's
configured rate, a plain number the rate itself) each method is first tuned on
**validation data of a seed that is not reported**: seed config.seed + 1000 runs at every rate
of the grid with `data.validation_split=True` (each client's local test split set aside unseen,
the client evaluated on a validation split held out of its training rows), the rate with the
best final mean personalized validation accuracy is kept (a diverged run counts as the worst),
and the reported seeds (config.seed, ...) run at that rate on their test splits. The grid is in
units of the *effective* step of `config.train.local_momentum`: a method whose own local
momentum m differs (SCAFFOLD and FedMRL run plain SGD) runs at grid x (1 - m) / (1 - train
momentum), so every method moves its parameters by the same effective step per unit gradient. A
rate must train on every seed: when a reported seed diverges at the chosen rate, that rate is
dropped for the method (its diverged runs are kept as evidence under
<workdir>/lr_tuning/<method>/lr<rate>/seed<k>), the next best rate of the grid is chosen and the
method's seeds run at it. The grid's table goes into comparison.md too, with the rates dropped
and the seeds that diverged.

`--extend_edges=1` tries, for a method whose best local rate is the grid's smallest or largest,
the next rate past that edge (on the 1-2-5 series when the grid is: 0.002 -> 0.001, 0.05 ->
0.1), and keeps it when it scores better (then, with a larger value, the next one): a rate
chosen at an edge of the grid says nothing about the rates beyond it.

`--unseen_seeds=100` also runs every method, at its chosen rate, on a second seed range (100 ..
100 + --seeds - 1) that neither the tuning nor the first range saw, and reports it in its own
table and paired differences below the first: a comparison a reader can check on seeds it was
not chosen on. A diverged run there is kept and marked (no rate is re-chosen on it).

`--jobs=2` runs two runs at a time, each in a worker process (`studies.run_pool`): the same
runs, numbers (bit for bit) and tables as one at a time, in less time where one run does not
keep every core busy (docs/performance.md). Ctrl-C stops every running
run after its round in progress with a checkpoint; the same command resumes them.

`--report_only` starts no run: it writes the table (and the grid) from the runs already finished
in --workdir, saying for each method how many seeds it has; a method whose grid is unfinished is
left out and named. For looking at a comparison that is still running or was interrupted.
"""

from __future__ import annotations

import ast
import json
import os

from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.engine.build import load_options
from fedjax_pfedes.engine.validate import check_against_data, validate_config
from fedjax_pfedes.errors import ConfigError, DataError, DatasetUnavailableError, StorageError
from fedjax_pfedes.io.workdir import RunLockedError
from fedjax_pfedes.launch import cli, jobs_flag
from fedjax_pfedes.launch.cli import fail, loaded_config
from fedjax_pfedes.studies import experiments, lr_tuning
from fedjax_pfedes.studies.run_pool import RunPool

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["pfedes", "standalone", "fedavg"],
                                "Methods to compare (config.algorithm names).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per method (config.seed, config.seed+1, ...).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where runs and the table go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")
_VARIANT = flags.DEFINE_multi_string(
    "variant", [], "NAME:FIELD=VALUE;FIELD=VALUE (repeatable): compare config variants of "
    "config.algorithm instead of --algorithms, e.g. --variant=kept: "
    "--variant=reset:train.reset_local_optimizer=True")
_LR_GRID = flags.DEFINE_list("lr_grid", [], "Local learning rates to tune each method over "
                             "(seed config.seed); empty = no tuning.")
_SERVER_LR_GRID = flags.DEFINE_list(
    "server_lr_grid", [], "With --lr_grid: server learning rates (or multiples of each method's "
    "own, e.g. 0.3x,1x,3x) to tune too, for every method "
    "whose config section has a server_lr (fedavgm, fedadam, scaffold, fednova, fedgh): each "
    "such method runs every (lr, server_lr) pair; empty = its section's value.")
_EXTEND_EDGES = flags.DEFINE_integer(
    "extend_edges", 0, "With --lr_grid: for a method whose best local rate is the grid's "
    "smallest or largest, try one rate past that edge (the 1-2-5 series' next, e.g. 0.002 -> "
    "0.001, when the grid is on it), up to this many more rates per method.", lower_bound=0)
_REUSE = flags.DEFINE_bool("reuse", True, "Reuse finished runs in the workdir made with the same "
                           "config (resume an interrupted comparison).")
_PAIRED = flags.DEFINE_list(
    "paired_with", [], "ARM=REFERENCE,... : add to comparison.md each arm's paired difference "
    "(same seeds) from its reference arm, mean and 95% CI, e.g. --paired_with=fedavg=standalone")
_UNSEEN = flags.DEFINE_integer(
    "unseen_seeds", -1, "Also run and report the seeds START .. START + --seeds - 1 at the "
    "chosen rates, a range no tuning or earlier table used (-1 = none).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Start no run: write the table from the "
                                 "runs already finished in the workdir.")


def parse_variants(specs: list[str]) -> dict[str, dict]:
    """'name:field=value;field=value' -> {name: {field: value}}; values are numbers or
    True/False where they parse as such, else strings. ConfigError naming the flag for a
    malformed one."""
    out = {}
    for spec in specs:
        name, sep, body = spec.partition(":")
        if not sep or not name:
            raise ConfigError(f"--variant={spec}: expected NAME:FIELD=VALUE;... (NAME: alone "
                              "for the config as it is)")
        overrides = {}
        for item in filter(None, body.split(";")):
            field, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"--variant={spec}: '{item}' is not FIELD=VALUE")
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            overrides[field] = parsed if isinstance(parsed, (bool, int, float)) else value
        out[name] = overrides
    return out


def seed_range_tables(done: dict[str, list[dict]], paired: dict[str, str], seeds: int) -> str:
    """One seed range's method table and, for the `paired` arms finished in it, the paired
    differences."""
    table = experiments.markdown_table(done, seeds)
    pairs = {a: b for a, b in paired.items() if a in done and b in done}
    if pairs:
        table += ("\n\nPaired differences (same seed: same data, clients and "
                  "sampling; Student-t 95% CI over the seeds, diverged seeds kept):\n\n"
                  + experiments.paired_table(done, pairs))
    return table


def _check_flags(argv: list[str]) -> tuple[list[float], list[float | str]]:
    """One line and exit 2 for what the flags alone get wrong; returns the --lr_grid and
    --server_lr_grid rates."""
    del argv
    if not _ALGORITHMS.value and not _VARIANT.value:
        fail("--algorithms is empty: name the methods to compare, e.g. "
             "--algorithms=pfedes,fedavg")
    try:
        grid = [float(v) for v in _LR_GRID.value]
    except ValueError:
        fail(f"--lr_grid: '{','.join(_LR_GRID.value)}' is not a comma-separated list of numbers")
    try:  # 'F' a rate, 'Fx' F times each method's configured rate (`server_rate`)
        factors = [float(v[:-1] if v.endswith("x") else v) for v in _SERVER_LR_GRID.value]
    except ValueError:
        fail(f"--server_lr_grid: '{','.join(_SERVER_LR_GRID.value)}' is not a comma-separated "
             "list of numbers or of multiples like 0.3x")
    if _EXTEND_EDGES.value and not grid:
        fail("--extend_edges needs --lr_grid (it extends the learning-rate grid)")
    if factors and not grid:
        fail("--server_lr_grid needs --lr_grid (it adds an axis to the learning-rate grid)")
    if any(not v > 0 for v in factors):
        fail(f"--server_lr_grid: rates must be > 0, got {_SERVER_LR_GRID.value}")
    if len({v.endswith("x") for v in _SERVER_LR_GRID.value}) > 1:
        fail("--server_lr_grid: give all rates or all multiples (e.g. 0.3x,1x,3x), not both")
    server_grid = [v if v.endswith("x") else float(v) for v in _SERVER_LR_GRID.value]
    if _REPORT_ONLY.value:
        if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
            fail(f"--workdir={_WORKDIR.value} is a file, not a directory")
    else:
        cli.output_folder("workdir", _WORKDIR.value)
    return grid, server_grid


def _checked_methods(config, central) -> None:
    """The flags that name methods and seeds, and every method's config against the data,
    checked before the first run starts (ConfigError naming the flag or field)."""
    known = algorithm_registry.names()
    unknown = [a for a in _ALGORITHMS.value if a not in known]
    if unknown:
        raise ConfigError(f"--algorithms: unknown {unknown}; known: {list(known)}")
    if not 1 <= _SEEDS.value < lr_tuning.TUNING_SEED_OFFSET:
        raise ConfigError(f"--seeds must be in [1, {lr_tuning.TUNING_SEED_OFFSET}), got "
                          f"{_SEEDS.value}")
    lr_tuning.check_unseen_seeds(config, _UNSEEN.value, _SEEDS.value)
    if _VARIANT.value and _LR_GRID.value:
        raise ConfigError("--lr_grid tunes --algorithms; it does not combine with --variant")
    chosen = config.algorithm
    for name in [config.algorithm] if _VARIANT.value else _ALGORITHMS.value:
        config.algorithm = name
        validate_config(config)
        check_against_data(config, central)
    config.algorithm = chosen


def _header(config, server_grid) -> str:
    """The comparison's first line: population, rounds, seeds and how rates were tuned."""
    header = (f"{config.data.name}, {config.data.num_clients} clients "
              f"({config.clients.architectures}), partition {config.data.partition}, "
              f"{config.train.rounds} rounds, {_SEEDS.value} seed(s); accuracy at the last "
              "round.")
    if _LR_GRID.value:
        header += (f" Learning rate per method tuned over {_LR_GRID.value} (effective "
                   f"steps at momentum {config.train.local_momentum:g}) on validation "
                   f"splits of seed {lr_tuning.tuning_seed(config)}, which is not "
                   "reported; a rate that diverges on a reported seed is dropped."
                   + (f" A best rate at an edge of the local rates is tried past it, up to "
                      f"{_EXTEND_EDGES.value} more rate(s) per method." if _EXTEND_EDGES.value
                      else "")
                   + (f" Server learning rates over {server_grid} for the methods that "
                      "have one." if server_grid else ""))
    return header


def _variants_and_pairs(config) -> tuple[dict[str, dict], dict[str, str]]:
    """The arms (--algorithms or --variant, each config checked) and --paired_with's pairs."""
    variants = ({a: {"algorithm": a} for a in _ALGORITHMS.value} if not _VARIANT.value
                else parse_variants(_VARIANT.value))
    for name, overrides in variants.items():
        unknown = experiments.unknown_fields(config, overrides)
        if unknown:
            raise ConfigError(f"--variant={name}: unknown config field(s) {unknown}")
        validate_config(experiments.with_overrides(config, overrides))
    paired = {}
    for item in _PAIRED.value:
        arm, eq, ref = item.partition("=")
        if not eq or arm not in variants or ref not in variants:
            raise ConfigError(f"--paired_with: '{item}' must be ARM=REFERENCE with both "
                              f"among {list(variants)}")
        paired[arm] = ref
    return variants, paired


class _Report:
    """comparison.md / .json / accuracy_curves.png in the workdir, rewritten after every seed
    so an interrupted comparison leaves a table."""

    def __init__(self, header: str, paired: dict[str, str], names: list[str]):
        self.header, self.paired, self.names = header, paired, names
        self.unseen: dict[str, list[dict]] = {}

    def write(self, results: dict[str, list[dict]]) -> str:
        done = {k: v for k, v in results.items() if v}
        if not done:
            raise ConfigError(f"--report_only: no finished run in {_WORKDIR.value} for these "
                              "methods and this config")
        seeds_done = min(len(v) for v in done.values())
        table = seed_range_tables(done, self.paired, _SEEDS.value)
        unseen = {k: v for k, v in self.unseen.items() if v}
        if unseen:
            first = _UNSEEN.value
            table += (f"\n\n**Seeds {first}-{first + _SEEDS.value - 1}**, which neither "
                      "the tuning nor the table above used (same rates):\n\n"
                      + seed_range_tables(unseen, self.paired, _SEEDS.value))
        absent = [k for k in self.names if k not in done]
        note = "" if seeds_done == _SEEDS.value and not absent else (
            f" (partial: {seeds_done} of {_SEEDS.value} seeds so far"
            + (f"; not finished yet: {', '.join(absent)}" if absent else "") + ")")
        with open(os.path.join(_WORKDIR.value, "comparison.md"), "w") as f:
            f.write(self.header + note + "\n\n" + table + "\n")
        with open(os.path.join(_WORKDIR.value, "comparison.json"), "w") as f:
            json.dump(done, f, indent=1)
        if unseen:
            with open(os.path.join(_WORKDIR.value, "comparison_unseen.json"), "w") as f:
                json.dump(unseen, f, indent=1)
        title = self.header.split(";")[0].replace(f"{_SEEDS.value} seed(s)",
                                                  f"{seeds_done} of {_SEEDS.value} seed(s)")
        experiments.accuracy_curves(done, os.path.join(_WORKDIR.value, "accuracy_curves.png"),
                                    title)
        return table


def _reported_seeds(config, variants, grid, server_grid, report: _Report, pool: RunPool):
    """Tunes the rates (with --lr_grid) and runs the reported seeds until no chosen rate
    diverges on a further seed (each pass sets one aside).

    Returns:
      (results by arm, the arms as run, the learning-rate grid's table or '').
    """
    tuning = ""
    while True:
        if _LR_GRID.value:
            variants, tuning = lr_tuning.tune_learning_rates(
                config, _ALGORITHMS.value, grid, _WORKDIR.value, server_grid,
                _PROGRESS.value, _REUSE.value, not _REPORT_ONLY.value, _EXTEND_EDGES.value, pool)
        results = experiments.run_grid(config, variants, _SEEDS.value, _WORKDIR.value,
                                       _PROGRESS.value, reuse=_REUSE.value,
                                       on_seed_done=report.write,
                                       run_missing=not _REPORT_ONLY.value, pool=pool)
        moved = [] if not _LR_GRID.value or _REPORT_ONLY.value else (
            lr_tuning.set_aside_diverged(config, results, variants, _WORKDIR.value))
        if not moved:
            return results, variants, tuning
        print("diverged at the chosen rate, choosing the next best: " + "; ".join(moved))


def main(argv: list[str]) -> None:
    grid, server_grid = _check_flags(argv)
    config = loaded_config(_CONFIG)
    tuning = ""
    try:
        # A diverging method or learning rate is a result (marked in the table, the worst rate
        # of a grid), not the end of the comparison.
        config.train.allow_divergence = True
        central = load_dataset(config.data.name, load_options(config))
        _checked_methods(config, central)
        variants, paired = _variants_and_pairs(config)
        report = _Report(_header(config, server_grid), paired, list(variants))
        with jobs_flag.run_pool(_PROGRESS.value) as pool:
            results, variants, tuning = _reported_seeds(config, variants, grid, server_grid,
                                                        report, pool)
            if _UNSEEN.value >= 0:
                def write_unseen(partial):
                    report.unseen.update(partial)
                    report.write(results)

                report.unseen.update(experiments.run_grid(
                    experiments.with_overrides(config, {"seed": _UNSEEN.value}), variants,
                    _SEEDS.value, _WORKDIR.value, _PROGRESS.value, reuse=_REUSE.value,
                    on_seed_done=write_unseen, run_missing=not _REPORT_ONLY.value, pool=pool))
        table = report.write(results)
    except (ConfigError, DatasetUnavailableError, DataError, RunLockedError, KeyError,
            TypeError, StorageError) as e:
        fail(str(e))
    if tuning:
        with open(os.path.join(_WORKDIR.value, "comparison.md"), "a") as f:
            f.write("\nLearning-rate grid (seed " + str(lr_tuning.tuning_seed(config))
                    + ", final mean personalized accuracy on the clients' validation splits; "
                    "the chosen rate in bold):\n\n" + tuning + "\n")
    print(report.header + "\n\n" + table + ("\n\n" + tuning if tuning else ""))
    print(f"\nwrote {_WORKDIR.value}/comparison.md, comparison.json, accuracy_curves.png")


def console() -> None:
    """`python -m launch.compare` from a checkout; `fedjax-pfedes-compare` installed."""
    cli.run(main)


if __name__ == "__main__":
    console()
