"""`config.eval.global_every`: the global test set is scored at every k-th evaluation and always
at the evaluation that ends the run; nothing else a run computes changes."""

import json

import pytest

import fedjax_pfedes
from configs import tabular_hetero
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS

GLOBAL = "global_accuracy_mean"
UNCOMPARED = (*WALL_CLOCK_FIELDS, GLOBAL)


def _config(global_every, rounds=6):
    config = tabular_hetero.get_config()
    config.train.rounds = rounds
    config.eval.every = 2
    config.eval.global_every = global_every
    config.checkpoint.every = 0
    config.monitor.tensorboard = False
    return config


def _rows(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def _without(row, keys):
    return {k: v for k, v in row.items() if k not in keys}


@pytest.mark.slow
def test_the_global_test_set_is_scored_every_kth_evaluation_and_at_the_end(tmp_path):
    runs = {k: fedjax_pfedes.run(_config(k), str(tmp_path / f"k{k}"), progress=False)
            for k in (1, 2, 0)}
    rows = {k: _rows(tmp_path / f"k{k}") for k in runs}
    scored = {k: [r["round"] for r in rows[k] if GLOBAL in r] for k in runs}
    # evaluated at rounds 2, 4, 6: each / every 2nd (round 4) and the last / only the last
    assert scored == {1: [2, 4, 6], 2: [4, 6], 0: [6]}
    for k in (2, 0):
        assert len(rows[k]) == len(rows[1]) == 6
        for a, b in zip(rows[k], rows[1], strict=True):
            # every other figure of every round is the default run's, bit for bit
            assert _without(a, UNCOMPARED) == _without(b, UNCOMPARED)
            if GLOBAL in a:
                assert a[GLOBAL] == b[GLOBAL]
        assert runs[k]["final"][GLOBAL] == runs[1]["final"][GLOBAL]
    for summary in runs.values():  # the seconds spent evaluating, within the run's wall time
        assert 0 < summary["evaluation_time_s"] < summary["wall_time_s"]


class StopAt(fedjax_pfedes.Callback):
    def __init__(self, at):
        self.at = at

    def on_round_end(self, run, end):
        if end.round == self.at:
            end.stop, end.stop_reason = True, "user asked"


@pytest.mark.slow
def test_a_run_stopped_between_evaluations_ends_with_a_global_score(tmp_path):
    """A callback stops the run at round 3, which `eval.every=2` does not evaluate: with the
    global test set scored only at the end, that round is evaluated, so the final record holds
    every figure a report reads."""
    summary = fedjax_pfedes.run(_config(0), str(tmp_path), progress=False,
                                callbacks=[StopAt(3)])
    assert summary["stopped_early"]["round"] == 3
    assert summary["final"]["round"] == 3 and GLOBAL in summary["final"]
    assert [r["round"] for r in _rows(tmp_path) if GLOBAL in r] == [3]
    assert [r["round"] for r in _rows(tmp_path) if "personalized_accuracy_mean" in r] == [2, 3]


@pytest.mark.parametrize("evaluating_s, resumed_s, line", [
    (6.0, 0.0, "evaluation took 60% of this process's wall time: config.eval.every, "
               "eval.global_every"),
    (4.0, 0.0, ""),
    (4.0, 4.0, "evaluation took 67% of this process's wall time"),  # 4 of this process's 6 s
])
def test_launch_main_names_the_eval_fields_when_evaluation_takes_most_of_a_run(
        evaluating_s, resumed_s, line):
    from fedjax_pfedes.engine.evaluation import evaluation_note

    note = evaluation_note({"wall_time_s": 10.0, "resumed_wall_time_s": resumed_s,
                            "evaluation_time_s": evaluating_s})
    assert note.startswith(line) and (note == "") == (line == "")
