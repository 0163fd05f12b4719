"""Fault soak: runs killed with SIGKILL at random points (during training, evaluation, a
checkpoint write or the metrics write) and resumed, under `loop` and `scan`, end with every file
equal to an unbroken run's; a run whose disk fills up ends in one line, keeps its last good
checkpoint and resumes (docs/threat_model.md, R15-R18).

In CI a few kill points per strategy run (about a minute each). The full soak, 12 points per
strategy, runs when FEDJAX_PFEDES_SOAK=1:

  FEDJAX_PFEDES_SOAK=1 python -m pytest tests/io/test_fault_soak.py -m slow -s
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from fl_helpers import CHILD_PATH, ROOT

from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.errors import StorageError
from fedjax_pfedes.io import checkpoints
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS

FULL = os.environ.get("FEDJAX_PFEDES_SOAK") == "1"
POINTS = 12 if FULL else 3
ROUNDS = 10
OVERRIDES = [
    "--config.data.name=digits", "--config.data.num_clients=6",
    "--config.data.min_samples_per_client=30", "--config.clients.architectures=mlp",
    "--config.proxy_arch=proxy_mlp", "--config.proxy_dim=16", f"--config.train.rounds={ROUNDS}",
    "--config.train.local_epochs=1", "--config.eval.every=2", "--config.checkpoint.every=1",
    "--config.monitor.tensorboard=false",
]


def _command(workdir, strategy: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.main", "--config=configs/quickstart.py",
            f"--workdir={workdir}", "--progress=false", *OVERRIDES,
            f"--config.execution.strategy={strategy}", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": CHILD_PATH}


def _files(workdir) -> dict:
    """What must equal an unbroken run's: every record less its wall-clock fields."""
    def rows(name):
        path = os.path.join(workdir, name)
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_FIELDS}
                for line in open(path)] if os.path.exists(path) else []

    summary = json.load(open(os.path.join(workdir, "summary.json")))
    final = {k: v for k, v in summary["final"].items() if k not in WALL_CLOCK_FIELDS}
    return {"metrics": rows("metrics.jsonl"), "clients": rows("clients.jsonl"),
            "rejections": rows("rejections.jsonl"), "final": final,
            "participation": summary["participation"],
            "csv_header": open(os.path.join(workdir, "metrics.csv")).readline()}


def _rows_written(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    return open(path).read().count("\n") if os.path.exists(path) else 0


def _phase(workdir) -> str:
    """Where the kill landed, read from what it left on disk."""
    ck = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ck) and any(".orbax-checkpoint-tmp" in n for n in os.listdir(ck)):
        return "checkpoint write"
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path) and os.path.getsize(path) and not open(path).read().endswith("\n"):
        return "metrics write"
    return "training or evaluation"


def _kill_chain(workdir, strategy: str, points: int, seed: int) -> list[str]:
    """Starts the run, kills it with SIGKILL at a random moment after a random number of its
    rounds, starts it again (it resumes), `points` times; then lets it finish."""
    rng = random.Random(seed)
    phases = []
    for _ in range(points):
        proc = subprocess.Popen(_command(workdir, strategy), cwd=ROOT, env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = min(ROUNDS - 1, _rows_written(workdir) + rng.randint(0, 2))
        deadline = time.time() + 300
        while _rows_written(workdir) < target and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is not None:  # finished before the kill: the chain is over early
            phases.append("finished first")
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        phases.append(_phase(workdir))
    subprocess.run(_command(workdir, strategy), cwd=ROOT, env=_env(), check=True,
                   capture_output=True)
    return phases


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["loop", "scan"])
def test_runs_killed_at_random_points_resume_to_an_unbroken_runs_files(strategy, tmp_path):
    unbroken = tmp_path / "unbroken"
    subprocess.run(_command(unbroken, strategy), cwd=ROOT, env=_env(), check=True,
                   capture_output=True)
    killed = tmp_path / "killed"
    phases = _kill_chain(killed, strategy, POINTS, seed=hash(strategy) % 1000)
    print(f"{strategy}: {len(phases)} kills: "
          + ", ".join(f"{p} x{phases.count(p)}" for p in sorted(set(phases))))
    assert _files(killed) == _files(unbroken)
    assert not [n for n in os.listdir(killed / "checkpoints") if "tmp" in n]


def _tiny(rounds: int = 4):
    from fl_helpers import tiny_config
    config = tiny_config(rounds, num_clients=6)
    config.checkpoint.every = 1
    config.checkpoint.max_to_keep = 2
    config.monitor.tensorboard = False
    return config


@pytest.mark.slow
def test_R15_a_failed_save_is_one_line_keeps_the_last_checkpoint_and_resumes(tmp_path,
                                                                             monkeypatch):
    """A file-system error injected into the checkpoint library's write of round 3 (as a full
    disk raises it: ENOSPC from its writer threads)."""
    unbroken = tmp_path / "unbroken"
    run_experiment(_tiny(), str(unbroken), show_progress=False)
    real = checkpoints.Checkpointer._save

    def failing(self, rounds_done, state, meta):
        if rounds_done == 3:
            os.makedirs(os.path.join(self.directory, "3.orbax-checkpoint-tmp-1"))
            raise OSError(errno.ENOSPC, "No space left on device",
                          os.path.join(self.directory, "3.orbax-checkpoint-tmp-1", "d"))
        return real(self, rounds_done, state, meta)

    monkeypatch.setattr(checkpoints.Checkpointer, "_save", failing)
    broken = tmp_path / "broken"
    with pytest.raises(StorageError, match=r"checkpoint of round 3 failed: no space left on "
                                           r"the device \(errno 28\).*last good checkpoint "
                                           r"\(round 2\) is kept") as e:
        run_experiment(_tiny(), str(broken), show_progress=False)
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(broken / "checkpoints")) == ["1", "2"]  # no temporary step left
    monkeypatch.setattr(checkpoints.Checkpointer, "_save", real)
    summary = run_experiment(_tiny(), str(broken), show_progress=False)
    assert summary["resumed_from_round"] == 2
    assert _files(broken) == _files(unbroken)


def _small_tmpfs(path, mib: float) -> bool:
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(mib * 1024)}k", "tmpfs",
                           str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow
def test_R16_a_disk_that_fills_up_mid_run_ends_in_one_line_and_the_run_resumes(tmp_path):
    """On a real full disk (a 12 MiB tmpfs: the first checkpoints fit, a later one does not);
    skipped where tmpfs cannot be mounted (no root or no CAP_SYS_ADMIN)."""
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, 12):
        pytest.skip("cannot mount a tmpfs here")
    try:
        workdir = disk / "run"
        done = subprocess.run(_command(workdir, "loop", "--config.checkpoint.max_to_keep=20"),
                              cwd=ROOT, env=_env(), capture_output=True, text=True)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert lines[-1].startswith("error: ") and "no space left on the device" in lines[-1]
        steps = os.listdir(workdir / "checkpoints")
        assert steps and all(s.isdigit() for s in steps), steps  # no temporary step left
        moved = tmp_path / "moved"
        shutil.copytree(workdir, moved)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    subprocess.run(_command(moved, "loop", "--config.checkpoint.max_to_keep=20"), cwd=ROOT,
                   env=_env(), check=True, capture_output=True)
    unbroken = tmp_path / "unbroken"
    subprocess.run(_command(unbroken, "loop", "--config.checkpoint.max_to_keep=20"), cwd=ROOT,
                   env=_env(), check=True, capture_output=True)
    assert _files(moved) == _files(unbroken)


@pytest.mark.slow
def test_R17_a_disk_too_small_for_one_checkpoint_is_refused_before_training(tmp_path):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, 3):
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = subprocess.run(_command(disk / "run", "loop"), cwd=ROOT, env=_env(),
                              capture_output=True, text=True)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: --workdir=")
    assert "MiB free, but one checkpoint of this run needs about" in done.stderr


@pytest.mark.slow
def test_R18_a_workdir_path_too_long_is_refused_before_training(tmp_path):
    deep = os.path.join(str(tmp_path), *["d" * 200] * 20)
    done = subprocess.run(_command(deep, "loop"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "exceeds the" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_R22_a_disk_full_under_the_metrics_and_tensorboard_writers_is_one_line_no_hang(
        tmp_path):
    """No checkpoints, a 60 KiB tmpfs: the records and TensorBoard's writer thread meet ENOSPC
    (its thread died silently and the next write blocked on its full queue forever; then its
    exit-time close did)."""
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, 0.06):
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = subprocess.run(_command(disk / "run", "loop", "--config.train.rounds=30",
                                       "--config.checkpoint.every=0",
                                       "--config.monitor.tensorboard=true"),
                              cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=300)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: writing ") and "no space left on the device" in last


@pytest.mark.slow
def test_R23_a_kill_in_the_middle_of_the_metrics_write_resumes_to_an_unbroken_run(tmp_path):
    """What SIGKILL leaves mid-write (random kill points rarely land there: the write takes
    microseconds): the last lines of metrics.jsonl and clients.jsonl cut off, no summary.json.
    The resume drops the cut lines and ends with an unbroken run's files."""
    unbroken = tmp_path / "unbroken"
    subprocess.run(_command(unbroken, "loop"), cwd=ROOT, env=_env(), check=True,
                   capture_output=True)
    killed = tmp_path / "killed"
    subprocess.run(_command(killed, "loop", "--config.train.rounds=6"), cwd=ROOT, env=_env(),
                   check=True, capture_output=True)
    os.remove(killed / "summary.json")
    next_rows = {name: open(unbroken / name).read().splitlines()[n]
                 for name, n in (("metrics.jsonl", 6), ("clients.jsonl", 6 * 3))}
    for name, line in next_rows.items():  # round 7's first line, cut in the middle
        with open(killed / name, "a") as f:
            f.write(line[:len(line) // 2])
    subprocess.run(_command(killed, "loop"), cwd=ROOT, env=_env(), check=True,
                   capture_output=True)
    assert json.load(open(killed / "summary.json"))["resumed_from_round"] == 6
    assert _files(killed) == _files(unbroken)
