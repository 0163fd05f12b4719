"""Host-loop callbacks (`fedjax_pfedes.engine.callbacks`): a user's callback sees each round
after its evaluation, what it adds is written with the round, it can stop a run early, and a
stopped run resumes to the same numbers as one that never stopped."""

import json

import pytest

import fedjax_pfedes
from configs import tabular_hetero


def _config(rounds=4, every_checkpoint=0):
    config = tabular_hetero.get_config()
    config.train.rounds = rounds
    config.eval.every = 2
    config.checkpoint.every = every_checkpoint
    config.monitor.tensorboard = False
    return config


def _rows(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


class Recorder(fedjax_pfedes.Callback):
    """Counts the hooks, adds a metric every round and stops at `stop_at` (if given)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.calls, self.seen = stop_at, [], []

    def on_run_start(self, run):
        self.calls.append(("start", run.first_round, run.rounds))

    def on_round_end(self, run, end):
        self.seen.append((end.round, end.evaluated, "personalized_accuracy_mean" in end.record))
        end.record["user_metric"] = 10.0 * end.round
        if end.round == self.stop_at:
            end.stop, end.stop_reason = True, "user asked"

    def on_run_end(self, run, summary):
        self.calls.append(("end", summary["final"]["round"]))
        summary["user_note"] = "seen"

    def close(self):
        self.calls.append(("close",))


@pytest.mark.slow
def test_a_callback_sees_evaluated_rounds_and_its_metrics_are_written(tmp_path):
    recorder = Recorder()
    summary = fedjax_pfedes.run(_config(), str(tmp_path), progress=False,
                                callbacks=[recorder])
    # evaluated every 2 rounds; the callback runs after the evaluation
    assert recorder.seen == [(1, False, False), (2, True, True), (3, False, False),
                             (4, True, True)]
    assert recorder.calls == [("start", 0, 4), ("end", 4), ("close",)]
    assert [r["user_metric"] for r in _rows(tmp_path)] == [10.0, 20.0, 30.0, 40.0]
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["user_note"] == summary["user_note"] == "seen"
    assert "stopped_early" not in written and summary["final"]["user_metric"] == 40.0


@pytest.mark.slow
def test_a_callback_stops_the_run_and_the_run_resumes_to_the_same_numbers(tmp_path):
    whole = fedjax_pfedes.run(_config(every_checkpoint=2), str(tmp_path / "whole"),
                              progress=False)
    stopped_dir = tmp_path / "stopped"
    summary = fedjax_pfedes.run(_config(every_checkpoint=2), str(stopped_dir), progress=False,
                                callbacks=[Recorder(stop_at=2)])
    assert summary["stopped_early"] == {"round": 2, "reason": "user asked"}
    assert summary["final"]["round"] == 2 and len(_rows(stopped_dir)) == 2
    first_process_s = _rows(stopped_dir)[-1]["elapsed_s"]
    assert summary["resumed_wall_time_s"] == 0.0
    resumed = fedjax_pfedes.run(_config(every_checkpoint=2), str(stopped_dir), progress=False)
    assert resumed["resumed_from_round"] == 2 and "stopped_early" not in resumed
    # the wall time carries on from the rounds the first process made
    assert resumed["resumed_wall_time_s"] == first_process_s
    elapsed = [r["elapsed_s"] for r in _rows(stopped_dir)]
    assert elapsed == sorted(elapsed) and elapsed[2] > first_process_s
    assert resumed["wall_time_s"] > elapsed[-1] > first_process_s
    for key in ("personalized_accuracy_mean", "global_accuracy_mean"):
        assert resumed["final"][key] == whole["final"][key]


class Boom(fedjax_pfedes.Callback):
    def on_round_end(self, run, end):
        raise RuntimeError(f"boom in round {end.round}")


@pytest.mark.slow
def test_every_callback_is_closed_when_a_round_raises(tmp_path):
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom in round 1"):
        fedjax_pfedes.run(_config(), str(tmp_path), progress=False,
                          callbacks=[Boom(), recorder])
    assert recorder.calls == [("start", 0, 4), ("close",)]
