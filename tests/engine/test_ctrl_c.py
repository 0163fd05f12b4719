"""Ctrl-C during a run (`engine.ctrl_c`, `launch.cli.run`): the first press stops the run after
the round in progress with a checkpoint of it, from which the same command resumes to the same
numbers; a second press stops at once; the command line says it in one line, exit 130."""

import json
import os
import signal
import sys

import pytest
from fl_helpers import tiny_config

from fedjax_pfedes import Callback, RunInterrupted
from fedjax_pfedes.engine.ctrl_c import CtrlC
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS
from fedjax_pfedes.launch import cli


@pytest.fixture(autouse=True)
def python_default_sigint():
    """SIGINT as in a terminal (pytest-xdist's workers ignore it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_the_first_ctrl_c_is_a_request_the_second_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with CtrlC() as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)
        assert ctrl_c.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with CtrlC() as ctrl_c:
        pass
    assert not ctrl_c.requested and signal.getsignal(signal.SIGINT) is before


def test_a_sigint_the_environment_ignores_stays_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nohup, a background job
    with CtrlC() as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)
    assert not ctrl_c.requested and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize("raised, line", [
    (RunInterrupted("its last checkpoint is round 3"),
     "interrupted: its last checkpoint is round 3"),
    (KeyboardInterrupt(), "interrupted"),
])
def test_a_command_interrupted_says_so_in_one_line_with_status_130(raised, line, monkeypatch,
                                                                   capsys):
    def interrupted(argv):
        raise raised

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit) as stopped:
        cli.run(interrupted)
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == line


class _PressCtrlC(Callback):
    """Presses Ctrl-C once, at the end of round `at` (the run sees it in the next round)."""

    def __init__(self, at: int):
        self.at = at

    def on_round_end(self, run, end):
        if end.round == self.at:
            os.kill(os.getpid(), signal.SIGINT)


def _rounds(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path):
    config = tiny_config(rounds=5)
    config.checkpoint.every = 4
    reference = run_experiment(config, str(tmp_path / "reference"), show_progress=False)
    workdir = str(tmp_path / "interrupted")
    with pytest.raises(RunInterrupted, match="its last checkpoint is round 3: the same command "
                                             "resumes from it"):
        run_experiment(config, workdir, callbacks=[_PressCtrlC(at=2)], show_progress=False)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
    assert [r["round"] for r in _rounds(workdir)] == [1, 2, 3]
    assert not os.path.exists(os.path.join(workdir, "summary.json"))  # not a finished run
    resumed = run_experiment(config, workdir, show_progress=False)
    assert [r["round"] for r in _rounds(workdir)] == [1, 2, 3, 4, 5]
    assert ({k: v for k, v in resumed["final"].items() if k not in WALL_CLOCK_FIELDS}
            == {k: v for k, v in reference["final"].items() if k not in WALL_CLOCK_FIELDS})
    assert len(reference["final"]) > len(WALL_CLOCK_FIELDS) + 10
