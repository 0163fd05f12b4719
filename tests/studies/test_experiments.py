"""Comparison runner: identical seeds across methods, no state leaking between runs, tables."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from configs import tabular_hetero
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.studies import experiments, run_reuse


def _tiny():
    config = tabular_hetero.get_config()
    config.train.rounds = 2
    config.eval.every = 1
    config.clients.architectures = "mlp_small"
    return config


def test_heterogeneity_ratio_assigns_the_minority_in_turn():
    assert experiments.heterogeneous_architectures(20, 0.0, "a", ["b", "c"]) == "a:20"
    assert experiments.heterogeneous_architectures(20, 0.4, "a", ["b", "c"]) == "a:12,b:4,c:4"
    assert experiments.heterogeneous_architectures(10, 0.3, "a", ["b", "c"]) == "a:7,b:2,c:1"
    with pytest.raises(ValueError, match="heterogeneity ratio"):
        experiments.heterogeneous_architectures(10, 1.5, "a", ["b"])


@pytest.mark.slow
def test_methods_in_one_process_equal_separate_runs(tmp_path):
    config = _tiny()
    results = experiments.run_grid(config, {"pfedes": {"algorithm": "pfedes"},
                                            "fedavg": {"algorithm": "fedavg"}}, seeds=2,
                                   workdir=str(tmp_path / "grid"), show_progress=False)
    assert [r["seed"] for r in results["fedavg"]] == [0, 1]
    alone = _tiny()
    alone.algorithm, alone.seed = "fedavg", 1
    summary = run_experiment(alone, str(tmp_path / "alone"), show_progress=False)
    assert results["fedavg"][1]["final"]["personalized_accuracy_mean"] == \
        summary["final"]["personalized_accuracy_mean"]
    assert results["fedavg"][1]["personalized_accuracy"][-1] == \
        summary["final"]["personalized_accuracy_mean"]
    table = experiments.markdown_table(results)
    assert table.count("\n") == 3 and "| pfedes | " in table and " ± " in table
    assert "| uploads rejected |" in table  # a method's filtered honest uploads are visible
    assert "| at a plateau |" in table
    png = experiments.accuracy_curves(results, str(tmp_path / "curves.png"), "t")
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_curves_over_seeds_keep_a_seed_that_stopped_early_for_the_rounds_it_reached(tmp_path):
    runs = [{"rounds": [5, 10, 15], "personalized_accuracy": [0.2, 0.4, 0.6],
             "global_accuracy": [0.1, 0.2, 0.3]},
            {"rounds": [5, 10], "personalized_accuracy": [0.4, 0.8],  # diverged at round 10
             "global_accuracy": [0.3, 0.4]}]
    rounds, mean, std = experiments.curve_over_seeds(runs, "personalized_accuracy")
    assert rounds == [5, 10, 15]
    np.testing.assert_allclose(mean, [0.3, 0.6, 0.6])
    np.testing.assert_allclose(std, [0.1, 0.2, 0.0])
    png = experiments.accuracy_curves({"m": runs}, str(tmp_path / "c.png"), "t")
    assert open(png, "rb").read(4) == b"\x89PNG"


@pytest.mark.slow
def test_compare_cli_refuses_a_method_that_does_not_fit_before_running(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.compare", "--config=configs/tabular_hetero.py",
         "--algorithms=fedavg,pfedes_paper", f"--workdir={tmp_path}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "config.algorithm='pfedes_paper' runs on ['image'] data" in proc.stderr
    assert not (tmp_path / "fedavg").exists()  # nothing ran


@pytest.mark.slow
def test_compare_tunes_each_methods_learning_rate_on_the_grid(tmp_path):
    cmd = [sys.executable, "-m", "launch.compare", "--config=configs/tabular_hetero.py",
           "--config.train.rounds=2", "--config.eval.every=2", "--config.checkpoint.every=0",
           "--config.clients.architectures=mlp_small", "--algorithms=fedavg,scaffold",
           "--lr_grid=0.001,0.05", "--seeds=2", f"--workdir={tmp_path}", "--progress=False"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    grid = {}
    # The grid is of effective steps at train.local_momentum 0.9: SCAFFOLD's plain SGD runs at
    # 10x the rate. Tuning runs seed 1000 (never reported) on validation splits.
    rates = {"fedavg": ("0.001", "0.05"), "scaffold": ("0.01", "0.5")}
    for method in ("fedavg", "scaffold"):
        for lr in rates[method]:
            summary = json.load(open(tmp_path / "lr_tuning" / method / f"lr{lr}"
                                     / "seed1000" / "summary.json"))
            grid[method, lr] = summary["final"]["personalized_accuracy_mean"]
            assert summary["local_optimizer"]["lr_local"] == float(lr)
            assert summary["config"]["data"]["validation_split"] is True
        best = max(rates[method], key=lambda lr, m=method: grid[m, lr])
        for seed in (0, 1):  # both reported seeds ran at the chosen rate, on their test splits
            s = json.load(open(tmp_path / method / f"seed{seed}" / "summary.json"))
            assert s["local_optimizer"]["lr_local"] == float(best)
            assert s["config"]["data"]["validation_split"] is False
    assert not (tmp_path / "fedavg" / "seed1000").exists()  # the tuning seed is not reported
    text = open(tmp_path / "comparison.md").read()
    assert "Learning-rate grid" in text
    assert "| scaffold (`train.lr_local`, momentum 0) | 0.01: " in text
    assert text.count("**") >= 4  # one chosen rate in bold per method
    # a grid of two rates: every choice lies on an edge of it, and the table says so
    assert "Chosen at an edge of the grid" in text and "fedavg (the " in text
    # --report_only on the same workdir asking for more: a table of what finished, nothing run
    report = subprocess.run(
        [c.replace("--algorithms=fedavg,scaffold", "--algorithms=fedavg,scaffold,fedprox")
         .replace("--seeds=2", "--seeds=3") for c in cmd] + ["--report_only"],
        capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    text = open(tmp_path / "comparison.md").read()
    assert "(partial: 2 of 3 seeds so far; not finished yet: fedprox)" in text
    assert text.count("(2 of 3 seeds)") == 2
    assert "| fedprox (`train.lr_local`) | not run yet | not run yet |" in report.stdout
    assert not (tmp_path / "fedavg" / "seed2").exists()
    assert not (tmp_path / "lr_tuning" / "fedprox").exists()
    # --unseen_seeds: a second range at the chosen rates, reported apart; nothing re-tuned
    tuning_runs = sorted(p for p in (tmp_path / "lr_tuning").rglob("summary.json"))
    stamps = [p.stat().st_mtime_ns for p in tuning_runs]
    unseen = subprocess.run(cmd + ["--unseen_seeds=100", "--paired_with=scaffold=fedavg"],
                            capture_output=True, text=True, timeout=600)
    assert unseen.returncode == 0, unseen.stderr[-2000:]
    assert [p.stat().st_mtime_ns for p in tuning_runs] == stamps
    for method in ("fedavg", "scaffold"):
        best = json.load(open(tmp_path / method / "seed0" / "summary.json"))
        for seed in (100, 101):
            s = json.load(open(tmp_path / method / f"seed{seed}" / "summary.json"))
            assert s["local_optimizer"]["lr_local"] == best["local_optimizer"]["lr_local"]
            assert s["config"]["seed"] == seed
    text = open(tmp_path / "comparison.md").read()
    assert "**Seeds 100-101**, which neither the tuning nor the table above used" in text
    assert text.count("Paired differences") == 2
    assert set(json.load(open(tmp_path / "comparison_unseen.json"))) == {"fedavg", "scaffold"}


def test_the_unseen_seed_range_overlaps_neither_reported_nor_tuning_seeds():
    import ml_collections

    from fedjax_pfedes.errors import ConfigError
    from fedjax_pfedes.studies.lr_tuning import check_unseen_seeds

    config = ml_collections.ConfigDict({"seed": 0})
    check_unseen_seeds(config, -1, 5)
    check_unseen_seeds(config, 100, 5)
    for first in (3, 998, -5):  # overlaps 0..4, holds the tuning seed 1000, negative
        with pytest.raises(ConfigError, match="--unseen_seeds"):
            check_unseen_seeds(config, first, 5)


def test_a_finished_run_is_reused_across_fields_added_later_at_their_default():
    default = {"train": {"lr": 0.05, "new_flag": False}, "seed": 0}
    old = {"train": {"lr": 0.05}, "seed": 0}  # made before new_flag existed
    assert run_reuse.same_config(old, {"train": {"lr": 0.05, "new_flag": False}, "seed": 0},
                                   default)
    assert not run_reuse.same_config(old, {"train": {"lr": 0.05, "new_flag": True},
                                             "seed": 0}, default)
    assert not run_reuse.same_config(old, {"train": {"lr": 0.1, "new_flag": False},
                                             "seed": 0}, default)
    assert not run_reuse.same_config({**old, "gone": 1}, {"train": {"lr": 0.05}, "seed": 0},
                                       default)


@pytest.mark.slow
def test_run_grid_without_running_collects_only_finished_runs(tmp_path):
    config = _tiny()
    out = experiments.run_grid(config, {"a": {}, "b": {"train.lr_local": 0.5}}, 2,
                               str(tmp_path), show_progress=False, run_missing=False)
    assert out == {"a": [], "b": []}
    assert list(tmp_path.iterdir()) == []  # no run started, no folder made


@pytest.mark.slow
@pytest.mark.parametrize("source", ["the checkpoint", "summary.json"])
def test_a_run_folder_of_another_config_is_moved_aside_and_run_anew(tmp_path, source):
    """A tuned rate that moves (its grid extended) re-runs the reported seeds in the folders of
    the old choice: their checkpoints hold another config, which the engine refuses to resume,
    or, removed (an unpacked archive has none), summary.json does; the grid moves such a
    folder aside with a warning and runs the new config."""
    config = _tiny()
    config.checkpoint.every = 1
    experiments.run_grid(config, {"a": {"train.lr_local": 0.1}}, 1, str(tmp_path),
                         show_progress=False, reuse=True)
    if source == "summary.json":
        shutil.rmtree(tmp_path / "a" / "seed0" / "checkpoints")
    with pytest.warns(UserWarning, match=r"held a run of another config \(config\.train\."
                                         rf"lr_local: 0\.1 in {re.escape(source)}, 0\.2 now\)"):
        out = experiments.run_grid(config, {"a": {"train.lr_local": 0.2}}, 1, str(tmp_path),
                                   show_progress=False, reuse=True)
    assert len(out["a"]) == 1
    assert run_reuse.finished_run(experiments.with_overrides(config, {"train.lr_local": 0.2}),
                                    str(tmp_path / "a" / "seed0")) is not None
    old = run_reuse.finished_run(experiments.with_overrides(config, {"train.lr_local": 0.1}),
                                   str(tmp_path / "a" / "seed0.replaced1"))
    assert old is not None  # the old run kept, whole


def test_a_finished_run_is_reused_whatever_its_loop_threads_but_not_another_lr(tmp_path):
    """Host threads change how fast a run goes, never its numbers: a comparison started with
    `--config.execution.loop_threads=1` is continued with the default and reuses its runs."""
    import json

    config = _tiny()
    config.execution.loop_threads = 1
    (tmp_path / "summary.json").write_text(json.dumps({"config": config.to_dict()}))
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.execution.loop_threads = 0
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.train.lr_local *= 2
    assert run_reuse.finished_run(config, str(tmp_path)) is None


def test_a_finished_run_is_reused_whatever_its_global_every(tmp_path):
    """`eval.global_every` decides which evaluations score the global test set, never a number
    a comparison reports (the final evaluation always scores it): a run archived before the
    field existed, or made with another value, is reused."""
    import json

    config = _tiny()
    old = config.to_dict()
    del old["eval"]["global_every"]
    (tmp_path / "summary.json").write_text(json.dumps({"config": old}))
    config.eval.global_every = 0
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.eval.every += 1
    assert run_reuse.finished_run(config, str(tmp_path)) is None


def test_the_stop_rules_settings_match_any_run_made_without_the_stop(tmp_path):
    """A run made without `train.stop_at_plateau` never reads `train.plateau_*`: a config that
    sets another minimum (configs/collaboration_mnist.py) still reuses the archived fixed-round
    runs; with the stop on, the minimum is part of the run."""
    import json

    config = _tiny()
    (tmp_path / "summary.json").write_text(json.dumps({"config": config.to_dict()}))
    config.train.plateau_min_evaluations = 20
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.train.stop_at_plateau = True
    assert run_reuse.finished_run(config, str(tmp_path)) is None
    stopped = config.to_dict()
    (tmp_path / "summary.json").write_text(json.dumps({"config": stopped}))
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.train.plateau_min_evaluations = 10
    assert run_reuse.finished_run(config, str(tmp_path)) is None


def test_a_run_archived_with_a_retired_field_is_still_reused(tmp_path):
    """`execution.scan_held_uploads` is gone from the config; the archived runs that carry it
    (docs/results) still match their command's config."""
    import json

    config = _tiny()
    old = config.to_dict()
    old["execution"]["scan_held_uploads"] = 8
    (tmp_path / "summary.json").write_text(json.dumps({"config": old}))
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    old["train"]["lr_local"] *= 2
    (tmp_path / "summary.json").write_text(json.dumps({"config": old}))
    assert run_reuse.finished_run(config, str(tmp_path)) is None


def test_an_auto_execution_config_reuses_a_run_of_any_strategy_but_not_the_reverse(tmp_path):
    """'auto' may pick any strategy and kernel set (same numbers up to float reassociation):
    a run made with `loop`/`xla` (the defaults before 'auto') is reused by the 'auto' default,
    a run asked for with another explicit strategy is not."""
    import json

    config = _tiny()
    config.execution.strategy, config.execution.cpu_kernels = "loop", "xla"
    (tmp_path / "summary.json").write_text(json.dumps({"config": config.to_dict()}))
    config.execution.strategy, config.execution.cpu_kernels = "auto", "auto"
    assert run_reuse.finished_run(config, str(tmp_path)) is not None
    config.execution.strategy = "vmap"
    assert run_reuse.finished_run(config, str(tmp_path)) is None
    config.execution.strategy, config.execution.cpu_kernels = "auto", "eigen"
    assert run_reuse.finished_run(config, str(tmp_path)) is None
    config.execution.cpu_kernels = "auto"
    config.train.lr_local *= 2
    assert run_reuse.finished_run(config, str(tmp_path)) is None


def test_compare_variants_parse_fields_and_types():
    from fedjax_pfedes.errors import ConfigError
    from fedjax_pfedes.launch.compare import parse_variants

    variants = parse_variants(["kept:", "reset:train.reset_local_optimizer=True",
                               "two:proxy_scales=1.0,0.5;train.coverage_candidates=12;lam=0.5"])
    assert variants == {"kept": {}, "reset": {"train.reset_local_optimizer": True},
                        "two": {"proxy_scales": "1.0,0.5", "train.coverage_candidates": 12,
                                "lam": 0.5}}
    config = experiments.with_overrides(_tiny(), variants["two"])
    assert config.proxy_scales == "1.0,0.5" and config.train.coverage_candidates == 12
    with pytest.raises(ConfigError, match="--variant=broken: expected NAME:FIELD=VALUE"):
        parse_variants(["broken"])
    with pytest.raises(ConfigError, match="'lam' is not FIELD=VALUE"):
        parse_variants(["x:lam"])


def test_a_rate_that_diverges_on_a_further_seed_is_dropped_for_the_next_best(tmp_path):
    """SCAFFOLD at its seed-0 best rate diverged on seeds 1 and 2 of the quick-start comparison:
    such a rate must not stand for the method."""
    import json

    from fedjax_pfedes.studies.lr_tuning import choose_rate, diverged_seeds, set_aside_diverged

    grid, scores = [0.01, 0.02, 0.05], [0.70, 0.74, 0.82]
    assert choose_rate(grid, scores, {}) == 0.05
    assert choose_rate(grid, scores, {0.05: [1, 2]}) == 0.02
    assert choose_rate(grid, [0.70, -np.inf, 0.82], {0.05: [1]}) == 0.01  # diverged on seed 0
    every = {0.01: [1], 0.02: [1], 0.05: [2]}
    assert choose_rate(grid, scores, every) == 0.05  # all dropped: the best of the tuning seed
    assert choose_rate(grid, [0.82, 0.70, 0.82], {}) == 0.01  # a tie: the smallest rate

    def run(folder, diverged):
        folder.mkdir(parents=True)
        rounds = [{"round": 1, "train_ce_loss_mean": 0.9},
                  {"round": 2, "train_ce_loss_mean": float("nan") if diverged else 0.7}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
        assert experiments.training_diverged(experiments.read_rounds(str(folder))) == diverged
        return str(folder)

    records = [{"seed": s, "diverged": d, "run_dir": run(tmp_path / "scaffold" / f"seed{s}", d)}
               for s, d in ((0, False), (1, True), (2, False))]
    kept = [{"seed": 0, "diverged": False, "run_dir": run(tmp_path / "fedavg" / "seed0", False)}]
    tuned = {"scaffold": {"algorithm": "scaffold", "train.lr_local": 0.05},
             "fedavg": {"algorithm": "fedavg", "train.lr_local": 0.02}}
    config = _tiny()  # seed 0 tunes; train.lr_local is both methods' rate field
    moved = set_aside_diverged(config, {"scaffold": records, "fedavg": kept}, tuned,
                               str(tmp_path), tuning=0)
    assert moved == ["scaffold lr 0.05 seed 1"]
    # every reported run at the dropped rate is set aside (a folder left in place would hold
    # checkpoints of the dropped rate, which the re-run at the next rate refuses to resume)
    assert not (tmp_path / "scaffold" / "seed1").exists()
    assert not (tmp_path / "scaffold" / "seed2").exists()
    assert (tmp_path / "fedavg" / "seed0").exists()  # no divergence: stays
    tuning = str(tmp_path / "lr_tuning")
    run(tmp_path / "lr_tuning" / "scaffold" / "lr0.05" / "seed3.replaced1", True)  # run_grid's
    assert diverged_seeds(tuning, "scaffold", 0.05, 0) == [1]
    assert diverged_seeds(tuning, "scaffold", 0.02, 0) == []
    # A rate chosen although dropped (every rate was): nothing better to move to, no loop.
    run(tmp_path / "scaffold" / "seed1", True)
    again = [{"seed": 1, "diverged": True, "run_dir": str(tmp_path / "scaffold" / "seed1")}]
    assert set_aside_diverged(config, {"scaffold": again}, tuned, str(tmp_path), tuning=0) == []


def test_the_tuning_grid_scales_by_momentum_and_crosses_server_rates():
    from configs import quickstart
    from fedjax_pfedes.studies.lr_tuning import cell_of, grid_cells

    config = quickstart.get_config()  # train momentum 0.9; scaffold runs plain SGD
    assert grid_cells(config, "fedavg", [0.01, 0.05], []) == {
        "lr0.01": {"algorithm": "fedavg", "train.lr_local": 0.01},
        "lr0.05": {"algorithm": "fedavg", "train.lr_local": 0.05}}
    cells = grid_cells(config, "scaffold", [0.01], [0.5, 1.0])
    assert cells == {  # the same effective step: 0.01 / (1 - 0.9) with no momentum
        "lr0.1_slr0.5": {"algorithm": "scaffold", "train.lr_local": 0.1,
                         "scaffold.server_lr": 0.5},
        "lr0.1_slr1": {"algorithm": "scaffold", "train.lr_local": 0.1,
                       "scaffold.server_lr": 1.0}}
    assert cell_of(config, "scaffold", cells["lr0.1_slr1"]) == "lr0.1_slr1"
    assert list(grid_cells(config, "pfedes", [0.01], [0.5])) == ["lr0.01"]  # no server lr
    # Multiples of each method's own server rate (FedAdam 0.01, FedAvgM 0.1 in the config).
    config.fedadam.server_lr, config.fedavgm.server_lr = 0.01, 0.1
    assert [c["fedadam.server_lr"] for c in grid_cells(
        config, "fedadam", [0.01], ["0.5x", "2x"]).values()] == [0.005, 0.02]
    assert [c["fedavgm.server_lr"] for c in grid_cells(
        config, "fedavgm", [0.01], ["0.5x", "2x"]).values()] == [0.05, 0.2]


def test_paired_difference_pairs_by_seed_with_a_student_t_interval():
    """Hand count: differences 0.1, 0.2, 0.3 (paired by seed, listed out of order): mean 0.2,
    sd 0.1, t(0.975, 2) = 4.302653 -> half-width 0.248414."""
    from fedjax_pfedes.studies import experiments

    def rows(values):
        return [{"seed": s, "final": {"m": v, "personalized_accuracy_mean": v,
                                      "global_accuracy_mean": v}} for s, v in values]

    arm = rows([(2, 0.7), (0, 0.5), (1, 0.6), (9, 1.0)])  # seed 9 has no reference: unpaired
    ref = rows([(0, 0.4), (1, 0.4), (2, 0.4)])
    p = experiments.paired_difference(arm, ref, "m")
    assert p["n"] == 3 and p["mean"] == pytest.approx(0.2)
    assert p["high"] - p["mean"] == pytest.approx(4.302653 * 0.1 / 3 ** 0.5, rel=1e-6)
    table = experiments.paired_table({"a": arm, "r": ref}, {"a": "r"})
    assert "+0.2000 [-0.0484, +0.4484] |" in table and "excludes" not in table  # n = 3 is few
    tight = rows([(0, 0.59), (1, 0.6), (2, 0.61)])
    assert "(excludes 0)" in experiments.paired_table({"a": tight, "r": ref}, {"a": "r"})
    flat = experiments.paired_difference(rows([(0, 0.5), (1, 0.3)]), rows([(0, 0.4), (1, 0.4)]),
                                         "m")
    assert flat["low"] < 0 < flat["high"]


def test_a_difference_without_spread_gets_no_interval():
    """Two seeds that give the same nonzero difference (accuracies are counts over one test
    set, so this happens) have sample deviation 0: the Student-t interval would collapse to
    [-0.008, -0.008] and "exclude 0". It is unbounded instead, and the table calls nothing."""
    from fedjax_pfedes.studies import experiments

    def rows(values):
        return [{"seed": s, "final": {"personalized_accuracy_mean": v,
                                      "global_accuracy_mean": v}} for s, v in values]

    arm, ref = rows([(0, 0.492), (1, 0.512)]), rows([(0, 0.5), (1, 0.52)])
    p = experiments.paired_difference(arm, ref, "personalized_accuracy_mean")
    assert p["mean"] == pytest.approx(-0.008) and (p["low"], p["high"]) == (-np.inf, np.inf)
    assert "excludes" not in experiments.paired_table({"a": arm, "r": ref}, {"a": "r"})
    spread = rows([(0, 0.492), (1, 0.511)])
    assert np.isfinite(experiments.paired_difference(spread, ref, "personalized_accuracy_mean")
                       ["high"])


def test_the_table_counts_the_runs_at_a_plateau():
    def run(curve):
        return {"final": {"personalized_accuracy_mean": curve[-1], "global_accuracy_mean": 0.5},
                "personalized_accuracy": curve, "upload_params_per_client": 10,
                "wall_time_s": 1.0, "uploads_rejected_total": 0}

    flat = run([0.2, 0.5, 0.7, 0.8, 0.80, 0.801, 0.802, 0.80, 0.803, 0.80])
    rising = run([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9])
    table = experiments.markdown_table({"m": [flat, rising], "n": [flat, flat]})
    assert "| 1/2 |" in table.splitlines()[2] and "| 2/2 |" in table.splitlines()[3]


def test_a_run_whose_records_hold_null_losses_is_read_as_diverged():
    """Records are strict JSON: a NaN loss is written as null. Reading them back, a null
    training loss is a divergence (a comparison that met one crashed on `np.isfinite(None)`)."""
    rounds = [{"round": 1, "train_ce_loss_mean": 0.5},
              {"round": 2, "train_ce_loss_mean": None, "personalized_accuracy_mean": 0.1}]
    assert experiments.training_diverged(rounds)
    assert not experiments.training_diverged(rounds[:1])


def test_a_rate_chosen_at_an_edge_of_the_grid_is_named_under_its_table():
    """The grid's edges, by hand: 4 local rates x 3 server rates, local major."""
    from fedjax_pfedes.studies.lr_tuning import edge_note, grid_edges

    assert grid_edges(0, 4) == ["the smallest local rate"]
    assert grid_edges(3, 4) == ["the largest local rate"]
    assert grid_edges(1, 4) == [] and grid_edges(2, 4) == []
    assert grid_edges(0, 1) == []  # a single rate is no grid
    # local 0.01 (index 1 of 4) with server 3x (index 2 of 3): cell 1 * 3 + 2
    assert grid_edges(5, 4, 3) == ["the largest server rate"]
    assert grid_edges(4, 4, 3) == []  # local index 1, server index 1: inside
    assert grid_edges(9, 4, 3) == ["the largest local rate", "the smallest server rate"]
    assert edge_note({"pfedes": [], "fedavgm": grid_edges(9, 4, 3)}) == (
        "Chosen at an edge of the grid, beyond which no rate was tried (extend the grid to see "
        "whether a rate past it scores better): fedavgm (the largest local rate and the "
        "smallest server rate).")
    assert edge_note({"pfedes": []}) == ""


def test_a_resumed_runs_wall_time_counts_every_process():
    rows = lambda *elapsed: [{"round": i + 1, "elapsed_s": e} for i, e in enumerate(elapsed)]  # noqa: E731
    # a summary from before resumes carried the time over: its last process only, plus the
    # earlier processes' shares of metrics.jsonl (elapsed_s restarts where one began)
    assert experiments.run_wall_time_s({"wall_time_s": 5.0}, rows(1.0, 3.0, 0.5, 4.0)) == 8.0
    assert experiments.run_wall_time_s({"wall_time_s": 5.0}, rows(1.0, 2.0, 4.9)) == 5.0
    # a summary that says so counts them already
    assert experiments.run_wall_time_s({"wall_time_s": 9.0, "resumed_wall_time_s": 3.0},
                                       rows(1.0, 3.0, 4.5, 8.9)) == 9.0


def test_rates_past_an_edge_follow_the_one_two_five_series_or_the_grids_own_ratio():
    from fedjax_pfedes.studies.lr_tuning import rate_past_edge

    grid = [0.005, 0.002, 0.01, 0.02, 0.05]  # any order
    assert rate_past_edge(grid, "smallest") == 0.001
    assert rate_past_edge(grid, "largest") == 0.1
    assert rate_past_edge([0.001, 0.002], "smallest") == 0.0005
    assert rate_past_edge([0.5, 1.0], "largest") == 2.0
    assert rate_past_edge([0.005], "largest") == 0.01
    assert rate_past_edge([0.003, 0.01], "smallest") == 0.0009  # off the series: 0.003^2/0.01
    assert rate_past_edge([0.003], "largest") == 0.006


def test_a_best_rate_at_an_edge_is_tried_past_it_up_to_the_limit(monkeypatch, tmp_path):
    """Tuning with a fake run per rate (validation score peaking at 0.001 for fedavg, at 0.01
    for fedprox): --extend_edges=1 adds 0.001 for fedavg alone, which wins and is still an
    edge; 2 adds 0.0005 too, which scores lower, so 0.001 is chosen inside the grid; 0 leaves
    the grid as given."""
    from configs import quickstart
    from fedjax_pfedes.studies import lr_tuning

    peak = {"fedavg": 0.001, "fedprox": 0.01}
    asked = []

    def scored_by_rate(config, trials, seeds, workdir, show_progress, reuse, run_missing,
                       pool=None):
        out = {}
        for name, overrides in trials.items():
            asked.append(name)
            lr = overrides["train.lr_local"]
            score = 0.9 - abs(np.log10(lr) - np.log10(peak[overrides["algorithm"]])) / 10
            out[name] = [{"final": {"personalized_accuracy_mean": score}, "diverged": False,
                          "seed": 1000}]
        return out

    monkeypatch.setattr(experiments, "run_grid", scored_by_rate)
    config = quickstart.get_config()
    grid = [0.002, 0.005, 0.01, 0.02, 0.05]
    tune = lambda n: lr_tuning.tune_learning_rates(  # noqa: E731
        config, ["fedavg", "fedprox"], grid, str(tmp_path), show_progress=False,
        extend_edges=n)
    tuned, table = tune(0)
    assert tuned["fedavg"]["train.lr_local"] == 0.002 and "0.001" not in table
    assert "Chosen at an edge of the grid" in table and "Tried past" not in table
    tuned, table = tune(1)
    assert tuned["fedavg"]["train.lr_local"] == 0.001
    assert tuned["fedprox"]["train.lr_local"] == 0.01
    assert "| effective step 0.001 | effective step 0.002 |" in table
    assert "| fedprox (`train.lr_local`) | — | 0.8301 |" in table  # not tried there
    assert "(--extend_edges=1): fedavg 0.001." in table
    assert "fedavg (the smallest local rate)" in table  # still at the edge: the limit
    asked.clear()
    tuned, table = tune(2)
    assert tuned["fedavg"]["train.lr_local"] == 0.001
    assert "fedavg/lr0.0005" in asked and not any("fedprox/lr0.001" in a for a in asked)
    assert "(--extend_edges=2): fedavg 0.0005, 0.001." in table
    assert "Chosen at an edge" not in table
