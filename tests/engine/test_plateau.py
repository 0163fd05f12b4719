"""Stopping at a plateau (`config.train.stop_at_plateau`, engine/plateau.py): the rule on hand-made
curves, the callback on a hand-made history, and a run that stops, resumes and stops at the
same round; comparisons count the runs that reached `train.rounds` first."""

import json
import types

import numpy as np
import pytest
from fl_helpers import tiny_config

from fedjax_pfedes.engine.callbacks import RoundEnd
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.plateau import PlateauStop, plateau_reached
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS
from fedjax_pfedes.studies import experiments

RISING = [0.1 * i for i in range(1, 11)]  # 0.1 .. 1.0
FLAT = [0.5, 0.7, 0.8, 0.85, 0.87, 0.871, 0.872, 0.872, 0.873, 0.873]


def _by_hand(curve, window=0.2, tolerance=0.005):
    """The rule written out: k = round(window n), mean of the last k vs the k before."""
    k = max(1, round(window * len(curve)))
    last, before = curve[len(curve) - k:], curve[len(curve) - 2 * k:len(curve) - k]
    return len(curve) >= 2 * k and abs(sum(last) / k - sum(before) / k) < tolerance


@pytest.mark.parametrize("curve,expected", [
    (RISING, False),
    (FLAT, True),
    (FLAT[:6], False),  # 0.85 0.87 | 0.87 0.871: k = 1 at n = 6 -> 0.001 apart, but n < 10
    (FLAT[:-2] + [0.80, 0.873], False),  # a dip in the last window
    (FLAT[:-2] + [0.80, 0.80], False),  # a fall
    (FLAT[:-1] + [float("nan")], False),
])
def test_the_rule_on_hand_made_curves(curve, expected):
    assert plateau_reached(curve, 0.2, 0.005, min_evaluations=10) is expected
    if len(curve) >= 10 and np.all(np.isfinite(curve)):
        assert _by_hand(curve) is expected


def test_a_flat_stretch_in_a_rising_curve_is_not_a_plateau():
    # a flat stretch early (0.40, 0.401), then the rise goes on
    curve = [0.1, 0.2, 0.3, 0.4, 0.40, 0.401, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    assert not any(plateau_reached(curve[:n], 0.2, 0.005, 10) for n in range(1, 13))
    assert plateau_reached(curve[:6], 0.2, 0.005, 2)  # why a minimum count of evaluations


def _end(history, accuracy, evaluated=True):
    state = types.SimpleNamespace(history=tuple(
        {"round": i + 1, "personalized_accuracy_mean": a} for i, a in enumerate(history)))
    return RoundEnd(len(history) + 1, state, {"personalized_accuracy_mean": accuracy}, [], [],
                    0.0, evaluated=evaluated)


def test_the_callback_stops_on_the_checkpointed_history_and_says_why():
    stop = PlateauStop(0.2, 0.005, 10)
    end = _end(FLAT[:-1], FLAT[-1])
    stop.on_round_end(None, end)
    assert end.stop and end.record["stopped_at_plateau"]
    assert end.stop_reason.startswith("plateau: mean personalized accuracy of the last 2 "
                                      "evaluations 0.8730, of the 2 before 0.8720")
    for end in (_end(RISING[:-1], RISING[-1]), _end(FLAT[:-1], FLAT[-1], evaluated=False)):
        stop.on_round_end(None, end)
        assert not end.stop and "stopped_at_plateau" not in end.record


def _config(rounds):
    config = tiny_config(rounds=rounds)
    config.train.stop_at_plateau = True
    config.train.plateau_min_evaluations = 6
    config.train.plateau_tolerance = 0.02
    config.eval.every = 1
    config.checkpoint.every = 2
    config.monitor.tensorboard = False
    return config


def _rows(workdir):
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_FIELDS}
            for line in open(workdir / "metrics.jsonl")]


@pytest.mark.slow
def test_a_run_stops_at_its_plateau_and_a_resumed_one_stops_at_the_same_round(tmp_path):
    unbroken = tmp_path / "unbroken"
    summary = run_experiment(_config(40), str(unbroken), show_progress=False)
    stopped = summary["stopped_early"]["round"]
    assert summary["stopped_at_plateau"] and not summary["hit_max_rounds"]
    assert 6 <= stopped < 40 and summary["stopped_early"]["reason"].startswith("plateau")
    rows = _rows(unbroken)
    assert len(rows) == stopped and rows[-1]["stopped_at_plateau"]
    curve = [r["personalized_accuracy_mean"] for r in rows]
    assert plateau_reached(curve, 0.2, 0.02, 6)
    assert not any(plateau_reached(curve[:n], 0.2, 0.02, 6) for n in range(1, stopped))

    resumed = tmp_path / "resumed"
    first = run_experiment(_config(stopped - 2), str(resumed), show_progress=False)
    assert first["hit_max_rounds"] and not first["stopped_at_plateau"]
    again = run_experiment(_config(40), str(resumed), show_progress=False)
    assert again["resumed_from_round"] == stopped - 2
    assert again["stopped_early"]["round"] == stopped
    assert _rows(resumed) == rows


def _run(seed, stopped_at, accuracy):
    return {"seed": seed, "final": {"personalized_accuracy_mean": accuracy,
                                    "global_accuracy_mean": accuracy},
            "stopped_at_round": stopped_at, "max_rounds": 100}


def test_comparisons_report_stopping_rounds_and_call_unfinished_pairs_inconclusive():
    results = {"a": [_run(s, 40 + s, 0.9 + 0.01 * s) for s in range(3)],
               "b": [_run(0, 50, 0.5), _run(1, None, 0.5), _run(2, 60, 0.5)]}
    assert experiments.stopping_rounds(results["a"]) == "40/41/42"
    assert experiments.stopping_rounds(results["b"]) == "50/max/60"
    assert experiments.hit_max_rounds(results["b"]) == 1
    table = experiments.paired_table(results, {"a": "b"})
    assert "(excludes 0) (inconclusive: 1 run(s) reached train.rounds before a plateau)" in table
    assert experiments.stopping_rounds([{"seed": 0}]) == ""
    # a diverged run is named as such, not as one that ran out of rounds
    results["b"][2] = {**_run(2, None, 0.5), "diverged": True}
    assert experiments.stopping_rounds(results["b"]) == "50/max/diverged"
    assert experiments.hit_max_rounds(results["b"]) == 1
    assert ("(inconclusive: 1 run(s) reached train.rounds and 1 run(s) diverged before a "
            "plateau)") in experiments.paired_table(results, {"a": "b"})
