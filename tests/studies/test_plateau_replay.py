"""Replaying the plateau stop on fixed-round runs (`studies.plateau_replay`,
`launch.stop_audit`): the stop found on hand-made curves against a hand count, runs that
stopped early left out, and the command line's errors."""

import json
import pathlib
import subprocess
import sys

import pytest

from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.studies import plateau_replay

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

# Evaluated every 10 rounds: a fast climb to 0.70, then 0.2 points an evaluation. Two windows of
# k evaluations differ by k x 0.002: within the tolerance 0.005 for k = 2 (the earliest stop of
# min 10 evaluations), never for k >= 3 (min 16).
SLOW = [0.50 + 0.04 * i for i in range(6)] + [0.70 + 0.002 * i for i in range(1, 14)]


def _write_run(folder: pathlib.Path, accuracies, every=10, stopped_early=None):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for i, acc in enumerate(accuracies, 1):
            f.write(json.dumps({"round": i * every - 1, "train_ce_loss_mean": 1.0}) + "\n")
            f.write(json.dumps({"round": i * every, "personalized_accuracy_mean": acc}) + "\n")
    (folder / "summary.json").write_text(json.dumps({"stopped_early": stopped_early}))


def _first_stop_by_hand(curve, window, tolerance, min_evaluations):
    """The callback's test after each evaluation, written out with plain lists."""
    for n in range(min_evaluations, len(curve) + 1):
        k = max(1, round(window * n))
        if n < 2 * k:
            continue
        last = sum(curve[n - k:n]) / k
        before = sum(curve[n - 2 * k:n - k]) / k
        if abs(last - before) < tolerance:
            return n
    return None


def test_the_replayed_stop_and_the_gain_after_it_match_a_hand_count(tmp_path):
    _write_run(tmp_path / "slow" / "seed0", SLOW)
    rules = [plateau_replay.StopRule(0.2, 0.005, 10), plateau_replay.StopRule(0.2, 0.005, 16)]
    replays, stopped = plateau_replay.replay(str(tmp_path), rules)
    assert stopped == 0
    (short, long) = (replays[rule][0] for rule in rules)
    n = _first_stop_by_hand(SLOW, 0.2, 0.005, 10)
    assert n == 10 and short.run == "slow/seed0" and short.end_round == 190
    assert short.stop_round == 100
    assert short.gain == pytest.approx(100 * (SLOW[-1] - SLOW[n - 1])) == pytest.approx(1.8)
    assert _first_stop_by_hand(SLOW, 0.2, 0.005, 16) is None
    assert long.stop_round is None and long.gain is None
    table = plateau_replay.summary_table(replays)
    assert "| window 0.2, tolerance 0.005, min 10 evaluations | 1 / 1 | 100 [100-100] | +1.80 | " \
        "1 | 0 |" in table
    assert "| window 0.2, tolerance 0.005, min 16 evaluations | 0 / 1 | - |" in table


def test_a_rising_curve_never_stops_and_early_stopped_runs_are_left_out(tmp_path):
    _write_run(tmp_path / "a" / "seed0", [0.1 * i for i in range(1, 21)])
    _write_run(tmp_path / "a" / "seed1", SLOW[:10], stopped_early={"round": 100})
    rule = plateau_replay.StopRule(0.2, 0.005, 10)
    replays, stopped = plateau_replay.replay(str(tmp_path), [rule])
    (rows,) = replays.values()
    assert stopped == 1 and [r.run for r in rows] == ["a/seed0"]
    assert rows[0].stop_round is None and rows[0].gain is None
    assert "| 0 / 1 |" in plateau_replay.summary_table(replays)


def test_no_run_and_a_broken_record_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        plateau_replay.replay(str(tmp_path / "absent"), [plateau_replay.StopRule(0.2, 0.005, 10)])
    with pytest.raises(ConfigError, match="no run ran to its last round"):
        plateau_replay.replay(str(tmp_path), [plateau_replay.StopRule(0.2, 0.005, 10)])
    _write_run(tmp_path / "b" / "seed0", SLOW)
    with open(tmp_path / "b" / "seed0" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 39 is not JSON"):
        plateau_replay.replay(str(tmp_path), [plateau_replay.StopRule(0.2, 0.005, 10)])


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--runs=/nonexistent"], "--runs: /nonexistent is not a folder"),
    (["--window=0.7"], "--window: at most 0.5"),
    (["--min_evaluations=ten"], "--min_evaluations: not a list of ints"),
    (["--tolerance=0"], "--tolerance: every value must be > 0"),
])
def test_command_line_errors_exit_2_with_one_line(flags, message, tmp_path):
    _write_run(tmp_path / "a" / "seed0", SLOW)
    args = flags if flags[0].startswith("--runs") else [f"--runs={tmp_path}", *flags]
    proc = subprocess.run([sys.executable, "-m", "launch.stop_audit", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
    assert "Traceback" not in proc.stderr
