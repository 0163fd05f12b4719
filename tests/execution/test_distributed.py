"""A run over several processes (`config.distributed`, `jax.distributed`) gives the numbers of
the same run in one process, only process 0 writes, and it resumes from its checkpoints.

Two CPU processes on 127.0.0.1 with gloo collectives (one device each, so the 'shard' mesh has
two devices across two processes) against one process with two simulated CPU devices (the same
mesh in one process): every round's metrics must agree."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest
from fl_helpers import CHILD_PATH, ROOT, small_config

from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import distributed

CONFIG = """
from fl_helpers import small_config


def get_config():
    c = small_config("shard")
    c.data.num_clients = 8  # 4 per cohort: each process holds 2 clients' states and samples
    c.train.rounds = 3
    c.checkpoint.every = 1
    c.monitor.tensorboard = False
    c.execution.compilation_cache_dir = ""
    return c
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(config: pathlib.Path, workdir: pathlib.Path, extra_env: dict, *flags: str
          ) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=CHILD_PATH)
    env.pop("XLA_FLAGS", None)
    env.update(extra_env)
    return subprocess.Popen([sys.executable, "-m", "launch.main", f"--config={config}",
                             f"--workdir={workdir}", "--progress=false", *flags],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def _rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def _two_processes(config: pathlib.Path, workdir: pathlib.Path, *flags: str) -> list[str]:
    common = [f"--config.distributed.coordinator_address=127.0.0.1:{_free_port()}",
              "--config.distributed.num_processes=2", *flags]
    procs = [_main(config, workdir, {}, *common, f"--config.distributed.process_id={i}")
             for i in (0, 1)]
    return [_finish(p) for p in procs]


@pytest.mark.slow  # five runs of a 2-3-round config, four of them two at once: ~2.5 min
def test_two_processes_give_the_one_process_numbers_only_process_0_writes_and_resume(tmp_path):
    config = tmp_path / "config.py"
    config.write_text(textwrap.dedent(CONFIG))
    multi = tmp_path / "multi"
    # Two rounds, then the same command for three: both processes resume from process 0's
    # checkpoint of round 2 and continue as the unbroken one-process run does.
    _two_processes(config, multi, "--config.train.rounds=2")
    outs = _two_processes(config, multi)
    assert "round 3: mean personalized accuracy" in outs[0]
    assert "resumed from the checkpoint of round 2" in outs[0]
    assert "process 1 of 2: done; process 0 wrote the results" in outs[1]
    single = tmp_path / "single"
    _finish(_main(config, single, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))

    many, one = _rows(multi), _rows(single)
    assert [r["round"] for r in many] == [1, 2, 3]  # written once, by process 0 alone
    for a, b in zip(many, one, strict=True):
        for key, value in b.items():
            if isinstance(value, float) and not key.endswith("_s"):
                assert abs(a[key] - value) <= 1e-5 * max(1.0, abs(value)), (a["round"], key)
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["resumed_from_round"] == 2
    assert summary["execution_strategy"] == "shard"
    assert summary["final"]["personalized_accuracy_mean"] > 0.3  # it did train
    # Nothing but process 0's files: no per-process leftovers in the shared workdir.
    assert sorted(p.name for p in multi.iterdir()) == sorted(p.name for p in single.iterdir())


def _distributed(**fields):
    config = small_config("shard")
    for key, value in fields.items():
        setattr(config.distributed, key, value)
    return config


@pytest.mark.parametrize("fields, match", [
    (dict(num_processes=2, process_id=2, coordinator_address="127.0.0.1:1234"),
     r"config\.distributed\.process_id=2 is out of range for "
     r"config\.distributed\.num_processes=2 \(0\.\.1\)"),
    (dict(num_processes=2, process_id=-1, coordinator_address="127.0.0.1:1234"),
     r"config\.distributed\.process_id must be >= 0, got -1"),
    (dict(num_processes=0), r"config\.distributed\.num_processes must be >= 1, got 0"),
    (dict(num_processes=2, process_id=1), r"config\.distributed\.coordinator_address: several "
     r"processes need process 0's 'host:port'"),
    (dict(num_processes=2, coordinator_address="h:1", cpu_collectives="nccl"),
     r"config\.distributed\.cpu_collectives must be one of"),
])
def test_bad_distributed_settings_are_refused_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(_distributed(**fields))


@pytest.mark.parametrize("field, value, match", [
    ("execution.strategy", "vmap", r"config\.execution\.strategy must be 'shard' \(or 'auto'"),
    ("execution.client_states", "offload", r"config\.execution\.client_states='offload' is "
     r"not supported across processes"),
    ("asynchronous.enabled", True, r"config\.asynchronous\.enabled: asynchronous rounds"),
])
def test_what_does_not_run_across_processes_yet_is_refused(field, value, match):
    config = _distributed(num_processes=2, coordinator_address="127.0.0.1:1234")
    section, name = field.split(".")
    setattr(config[section], name, value)
    with pytest.raises(ConfigError, match=match):
        validate_config(config)


def test_auto_execution_is_accepted_across_processes():
    """The defaults run across processes: 'auto' means 'shard' with XLA's kernels there (every
    process must compile the same programs; `engine.build._candidate_runners`)."""
    config = _distributed(num_processes=2, coordinator_address="127.0.0.1:1234")
    config.execution.strategy, config.execution.cpu_kernels = "auto", "auto"
    validate_config(config)


def test_one_process_is_the_default_and_a_config_without_the_section_is_one_process():
    assert not distributed.settings(small_config().distributed).multi_process
    config = small_config()
    del config["distributed"]
    assert distributed.settings(config.get("distributed")) == distributed.Settings()
    assert distributed.settings(
        _distributed(coordinator_address="auto").distributed).multi_process
