"""Checkpoint and exact resume: a run killed with SIGKILL part-way and resumed writes the same
metrics as an unbroken run; a resume with a config that would corrupt the run is refused."""

import json
import os
import signal
import subprocess
import sys
import time

import fl_helpers
import jax
import pytest

from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.schema import default_values
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.io.checkpoints import ConfigChangedError, check_finished_run, config_changes
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS

ROUNDS = 30
OVERRIDES = [
    "--config.data.name=digits", "--config.data.num_clients=8",
    "--config.data.min_samples_per_client=30", "--config.clients.architectures=mlp",
    "--config.proxy_arch=proxy_mlp", "--config.proxy_dim=16", f"--config.train.rounds={ROUNDS}",
    "--config.train.local_epochs=1", "--config.train.lr_local=0.1",
    "--config.train.sampling=stratified", "--config.system.dropout=0.3",
    "--config.system.speed_classes=1,3", "--config.upload.topk_fraction=0.3",
    "--config.eval.every=5", "--config.checkpoint.every=2", "--config.monitor.tensorboard=false",
    "--config.execution.strategy=loop",
]


def _main(workdir) -> list[str]:
    return [sys.executable, "-m", "launch.main", "--config=configs/quickstart.py",
            f"--workdir={workdir}", "--progress=false", *OVERRIDES]


def _rows(path):
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_FIELDS}
            for line in open(path)]


def _saved_rounds(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    unbroken, killed = tmp_path / "unbroken", tmp_path / "killed"
    subprocess.run(_main(unbroken), cwd=repo, check=True, capture_output=True)

    proc = subprocess.Popen(_main(killed), cwd=repo, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not [r for r in _saved_rounds(killed) if r >= 2] and time.time() < deadline:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = _saved_rounds(killed)
    assert saved and max(saved) < ROUNDS, saved  # really stopped part-way
    rows_at_kill = len(_rows(killed / "metrics.jsonl"))
    assert rows_at_kill < ROUNDS

    subprocess.run(_main(killed), cwd=repo, check=True, capture_output=True)
    summary = json.load(open(killed / "summary.json"))
    assert 2 <= summary["resumed_from_round"] < ROUNDS
    assert _rows(killed / "metrics.jsonl") == _rows(unbroken / "metrics.jsonl")
    assert (open(killed / "clients.jsonl").read() == open(unbroken / "clients.jsonl").read())
    assert (open(killed / "metrics.csv").readline() == open(unbroken / "metrics.csv").readline())
    assert summary["participation"] == json.load(open(unbroken / "summary.json"))["participation"]


def _small(rounds=3):
    config = fl_helpers.tiny_config(rounds, num_clients=6)
    config.checkpoint.every = 1
    config.monitor.tensorboard = False
    return config


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("checkpointed")
    run_experiment(_small(), str(workdir), show_progress=False)
    return workdir


@pytest.mark.parametrize("field,value,expect", [
    ("data.num_clients", 7, "config.data.num_clients: 6 in the checkpoint, 7 now"),
    ("clients.architectures", "mlp,convnet3", "config.clients.architectures"),
    ("algorithm", "fedavg", "config.algorithm: 'pfedes' in the checkpoint, 'fedavg' now"),
])
@pytest.mark.slow
def test_resume_with_a_corrupting_config_change_is_refused(checkpointed, field, value, expect):
    changed = _small(rounds=4)
    section, _, name = field.rpartition(".")
    (changed[section] if section else changed)[name] = value
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(")) as e:
        run_experiment(changed, str(checkpointed), show_progress=False)
    assert "--config.checkpoint.resume=False" in str(e.value)


@pytest.mark.slow
def test_resume_false_starts_the_workdir_over(checkpointed):
    changed = _small(rounds=2)
    changed.algorithm = "fedavg"
    changed.checkpoint.resume = False
    summary = run_experiment(changed, str(checkpointed), show_progress=False)
    assert summary["resumed_from_round"] == 0 and summary["final"]["round"] == 2
    rows = [json.loads(line) for line in open(checkpointed / "metrics.jsonl")]
    assert [r["round"] for r in rows] == [1, 2]


def test_a_finished_run_of_another_config_without_checkpoints_is_not_written_over(tmp_path):
    """An unpacked archive keeps summary.json, not the checkpoints: a run of another config
    started in its folder is refused (a comparison moves the folder aside), one of the same
    config, or one that may extend it (more rounds), goes ahead; an unreadable summary.json
    is no finished run."""
    made = _small(rounds=3).to_dict()
    (tmp_path / "summary.json").write_text(json.dumps({"config": made}))
    changed = _small(rounds=3)
    changed.train.lr_local = changed.train.lr_local * 2
    with pytest.raises(ConfigChangedError, match=r"summary\.json, no checkpoint to resume"
                       r"\):\n  config\.train\.lr_local: .* in summary\.json") as e:
        check_finished_run(str(tmp_path), changed.to_dict(), default_values())
    assert "--config.checkpoint.resume=False" in str(e.value)
    check_finished_run(str(tmp_path), made, default_values())
    check_finished_run(str(tmp_path), _small(rounds=6).to_dict(), default_values())
    (tmp_path / "summary.json").write_text("{not json")
    check_finished_run(str(tmp_path), changed.to_dict(), default_values())


@pytest.mark.parametrize("strategy,kernels,candidates", [
    ("auto", "xla", {"loop", "vmap", "scan"}),
    ("loop", "auto", {"loop", "loop/eigen"}),  # the CPU kernels, timed like the strategies
])
@pytest.mark.slow
def test_auto_strategy_is_measured_once_and_kept_on_resume(tmp_path, strategy, kernels,
                                                           candidates):
    if kernels == "auto" and jax.default_backend() != "cpu":
        pytest.skip("the kernel choice exists on the CPU backend only")
    config = _small(rounds=2)
    config.execution.strategy = strategy
    config.execution.cpu_kernels = kernels
    config.execution.compilation_cache_dir = str(tmp_path / "cache")
    first = run_experiment(config, str(tmp_path / "run"), show_progress=False)
    choice = first["strategy_choice"]["mlp"]
    # the cost model priced every candidate; what it timed, if anything, decided among those
    assert set(choice["predicted_round_s"]) == candidates and not choice["cached"]
    assert choice["strategy"] in candidates and choice["reason"]
    if choice["expected_round_s"]:
        assert choice["strategy"] == min(choice["expected_round_s"],
                                         key=choice["expected_round_s"].get)
    assert first["execution_strategy_by_arch"] == {"mlp": choice["strategy"]}
    longer = _small(rounds=3)
    longer.execution.strategy = strategy
    longer.execution.cpu_kernels = kernels
    longer.execution.compilation_cache_dir = str(tmp_path / "cache")
    resumed = run_experiment(longer, str(tmp_path / "run"), show_progress=False)
    assert resumed["resumed_from_round"] == 2
    assert resumed["strategy_choice"]["mlp"] == {"strategy": choice["strategy"],
                                                 "from_checkpoint": True}
    fresh = run_experiment(config, str(tmp_path / "fresh"), show_progress=False)
    assert fresh["strategy_choice"]["mlp"]["cached"]  # the decision cache, not a new timing


def test_which_config_changes_are_resumable():
    base = {"seed": 0, "algorithm": "pfedes", "train": {"rounds": 10, "lr_local": 0.1},
            "eval": {"every": 5}, "dp": {"enabled": False, "target_epsilon": 0.0}}
    longer = json.loads(json.dumps(base))
    longer["train"]["rounds"] = 20
    longer["eval"]["every"] = 1
    assert config_changes(base, longer, default_values()) == []
    lr = json.loads(json.dumps(base))
    lr["train"]["lr_local"] = 0.2
    assert config_changes(base, lr, default_values()) == [
        "config.train.lr_local: 0.1 in the checkpoint, 0.2 now"]
    # A noise multiplier calibrated to a target epsilon depends on the total rounds.
    calibrated = json.loads(json.dumps(base))
    calibrated["dp"] = {"enabled": True, "target_epsilon": 8.0}
    more = json.loads(json.dumps(calibrated))
    more["train"]["rounds"] = 20
    assert config_changes(calibrated, more, default_values()) == [
        "config.train.rounds: 10 in the checkpoint, 20 now"]


def test_a_field_added_after_the_checkpoint_resumes_only_at_its_shipped_default():
    """A checkpoint written before `distributed` existed resumes when the new fields are at
    their defaults (they keep the old behaviour), and not when one of them is set otherwise."""
    from configs import quickstart
    current = json.loads(json.dumps(quickstart.get_config().to_dict()))
    saved = json.loads(json.dumps(current))
    del saved["distributed"]
    del saved["data"]["shifted_samples"]
    assert config_changes(saved, current, default_values()) == []
    current["data"]["shifted_samples"] = 1000
    assert config_changes(saved, current, default_values()) == [
        "config.data.shifted_samples: '<missing>' in the checkpoint, 1000 now"]
