"""A study's runs in worker processes (`studies.run_pool`, `launch.compare --jobs`): the same
records, choices and numbers as in this process; a stop checkpoints every running run."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from fl_helpers import tiny_config

from fedjax_pfedes.errors import ConfigError, RunInterrupted
from fedjax_pfedes.studies import experiments, lr_tuning
from fedjax_pfedes.studies.run_pool import RunPool, StopRequested, run_in

VARIANTS = {"fedavg": {"algorithm": "fedavg"}, "standalone": {"algorithm": "standalone"}}


def _numbers(results: dict) -> dict:
    """Every figure of every record but the wall-clock ones."""
    keep = {}
    for name, records in results.items():
        keep[name] = [({k: v for k, v in r["final"].items() if not k.endswith("_s")},
                       r["seed"], r["rounds"], r["personalized_accuracy"], r["curves"])
                      for r in records]
    return keep


def test_jobs_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="--jobs"):
            RunPool(bad)


@pytest.mark.slow
def test_workers_write_the_records_and_numbers_of_this_process(tmp_path):
    config = tiny_config(rounds=3)
    alone = experiments.run_grid(config, VARIANTS, 2, str(tmp_path / "alone"), False)
    with RunPool(2, show_progress=False) as pool:
        pooled = experiments.run_grid(config, VARIANTS, 2, str(tmp_path / "pooled"), False,
                                      pool=pool)
        # the same run handed over twice runs once
        again = config.copy_and_resolve_references()
        again.algorithm = "fedavg"
        first = pool.submit(again, str(tmp_path / "twice"))
        assert pool.submit(again, str(tmp_path / "twice")).future is first.future
        assert first.result()["final"]["round"] == 3
    assert [r["seed"] for r in pooled["fedavg"]] == [0, 1]
    assert _numbers(pooled) == _numbers(alone)  # bit for bit, in run_grid's order


@pytest.mark.slow
def test_tuning_with_workers_chooses_and_tabulates_as_in_this_process(tmp_path):
    config = tiny_config(rounds=2)
    methods, grid = ["fedavg", "standalone"], [0.05, 0.2]
    alone = lr_tuning.tune_learning_rates(config, methods, grid, str(tmp_path / "a"),
                                          show_progress=False)
    with RunPool(2, show_progress=False) as pool:
        pooled = lr_tuning.tune_learning_rates(config, methods, grid, str(tmp_path / "b"),
                                               show_progress=False, pool=pool)
    assert pooled == alone


@pytest.mark.slow
def test_a_worker_error_reaches_the_study_in_one_line(tmp_path):
    config = tiny_config(rounds=2)
    with pytest.raises(ConfigError, match="lr_local"):
        with RunPool(2, show_progress=False) as pool:
            experiments.run_grid(config, {"bad": {"train.lr_local": -1.0}}, 1, str(tmp_path),
                                 False, pool=pool)


@pytest.mark.slow
def test_a_stop_request_checkpoints_the_round_and_the_run_resumes_to_the_same_end(tmp_path):
    config = tiny_config(rounds=4)
    config.checkpoint.every = 3  # the stop's round (1) is off the schedule: saved anyway
    unbroken = run_in(config, str(tmp_path / "unbroken"), False)
    stop = threading.Event()
    stop.set()
    with pytest.raises(RunInterrupted, match="round 1"):
        run_in(config, str(tmp_path / "stopped"), False, [StopRequested(stop)])
    assert not os.path.exists(tmp_path / "stopped" / "summary.json")
    resumed = run_in(config, str(tmp_path / "stopped"), False)
    assert resumed["resumed_from_round"] == 1
    assert {k: v for k, v in resumed["final"].items() if not k.endswith("_s")} == \
        {k: v for k, v in unbroken["final"].items() if not k.endswith("_s")}


def _last_round(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    lines = open(path).read().splitlines()
    return json.loads(lines[-1])["round"] if lines else 0


@pytest.mark.slow
def test_ctrl_c_in_the_study_stops_the_workers_runs_with_a_checkpoint_each(tmp_path):
    config = tiny_config(rounds=400)
    config.checkpoint.every = 1000  # only the stop's round is saved
    config.eval.every = 1
    dirs = [str(tmp_path / name / "seed0") for name in VARIANTS]
    with pytest.raises(RunInterrupted, match="same command resumes"):
        with RunPool(2, show_progress=False) as pool:
            experiments.submit_grid(config, VARIANTS, 1, str(tmp_path), pool)
            deadline = time.time() + 300
            while min(_last_round(d) for d in dirs) < 2 and time.time() < deadline:
                time.sleep(0.2)
            raise KeyboardInterrupt  # what Ctrl-C raises in the study's process
    for d in dirs:
        assert not os.path.exists(os.path.join(d, "summary.json")), d
        steps = os.listdir(os.path.join(d, "checkpoints"))
        assert [int(s) for s in steps if s.isdigit()] == [_last_round(d)], (d, steps)
        assert 2 <= _last_round(d) < 400


@pytest.mark.slow
def test_L33_a_killed_worker_ends_the_study_in_one_line(tmp_path):
    config = tiny_config(rounds=400)
    config.eval.every = 1
    with pytest.raises(ConfigError, match="ended abruptly") as error:
        with RunPool(2, show_progress=False) as pool:
            planned = experiments.submit_grid(config, VARIANTS, 1, str(tmp_path), pool)
            deadline = time.time() + 300
            while _last_round(tmp_path / "fedavg" / "seed0") < 2 and time.time() < deadline:
                time.sleep(0.2)
            for worker in multiprocessing.active_children():
                os.kill(worker.pid, signal.SIGKILL)
                break
            for seed_runs in planned:
                for *_, outcome in seed_runs:
                    outcome.result()
    assert "\n" not in str(error.value) and "seed0" in str(error.value)


LEADER = """
import sys, time
sys.path.insert(0, {tests!r})
from fl_helpers import tiny_config
from fedjax_pfedes.studies import experiments
from fedjax_pfedes.studies.run_pool import RunPool
config = tiny_config(rounds=400)
config.checkpoint.every = 1000
config.eval.every = 1
pool = RunPool(2, show_progress=False)
experiments.submit_grid(config, {variants!r}, 1, {workdir!r}, pool)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_workers_of_a_killed_study_stop_their_runs_with_a_checkpoint_and_end(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    leader = subprocess.Popen([sys.executable, "-c", LEADER.format(
        tests=tests, variants=VARIANTS, workdir=str(tmp_path))])
    dirs = [tmp_path / name / "seed0" for name in VARIANTS]
    deadline = time.time() + 300
    while min(_last_round(d) for d in dirs) < 2 and time.time() < deadline:
        time.sleep(0.2)
    workers = [int(open(d / ".lock").read().split()[1]) for d in dirs]
    leader.kill()  # no Ctrl-C, no clean-up: SIGKILL
    leader.wait()
    deadline = time.time() + 120
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(_alive(w) for w in workers), "a worker outlived its killed study"
    for d in dirs:
        assert not (d / "summary.json").exists()
        steps = [int(s) for s in os.listdir(d / "checkpoints") if s.isdigit()]
        assert steps == [_last_round(d)] and 2 <= steps[0] < 400, (d, steps)
