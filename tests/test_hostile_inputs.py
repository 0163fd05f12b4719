"""Bad inputs a second hostile test found silent, crashing or misleading (rows C33-C42, D23-D30,
L10-L16, R12-R14 of docs/threat_model.md): each gets a one-line error naming the field, file or
value (exit 2 from the command line), or the correct behaviour."""

import errno
import os
import re
import sys

import numpy as np
import pytest
from fl_helpers import launch_error_line, tiny_config

from fedjax_pfedes.data.arrays import load_npz
from fedjax_pfedes.data.sources import LoadOptions
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DataError, NothingTrainedError
from fedjax_pfedes.io.workdir import RunLockedError, WorkdirLock
from fedjax_pfedes.launch import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- D: data files ---------------------------------------------------------------------------

def _arrays(**changes):
    rng = np.random.default_rng(0)
    a = dict(x_train=rng.random((60, 8, 8, 1)).astype(np.float32), y_train=np.arange(60) % 4,
             x_test=rng.random((20, 8, 8, 1)).astype(np.float32), y_test=np.arange(20) % 4)
    a.update(changes)
    return a


X = _arrays()["x_train"]
DATA_CASES = {
    "D23": (_arrays(x_train=X.astype(np.complex64) + 1j), r"x_train must hold real numbers, "
            r"got dtype complex64"),
    "D24": (_arrays(x_train=np.full((60, 8, 8, 1), "a")), r"x_train must hold real numbers"),
    "D25": (_arrays(x_train=X[..., None], x_test=_arrays()["x_test"][..., None]),  # 5-D
            r"tabular x_train must have shape \[N, F\] features, got \(60, 8, 8, 1, 1\)"),
    "D26": (_arrays(x_train=np.where(np.arange(60)[:, None, None, None] == 4, 1e300,
                                     X.astype(np.float64))),
            r"x_train\[4\] holds values beyond float32's range"),
    "D27": (_arrays(x_test=np.zeros((0, 8, 8, 1), np.float32), y_test=np.zeros(0, int),
                    num_classes=np.array(4)), r"x_test is empty"),
    "D28": (_arrays(num_classes=np.array(10.9)), r"num_classes must be one integer, got 10.9"),
    "D29": (_arrays(y_train=np.where(np.arange(60) == 2, 2 ** 40, np.arange(60) % 4)),
            r"y_train\[2\] = 1099511627776 would make .* classes \(at most 100000\)"),
    "D30": (_arrays(num_classes=np.array(2 ** 40)), r"num_classes must be in \[2, 100000\]"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_arrays_are_refused_in_one_line_naming_the_file(case, tmp_path):
    arrays, message = DATA_CASES[case]
    path = tmp_path / f"{case}.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message) as e:
        load_npz(LoadOptions(path=str(path)))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# --- C: config fields ------------------------------------------------------------------------

CONFIG_CASES = {
    "C33": ({"eval.global_test_samples": -5}, r"config.eval.global_test_samples must be >= 0"),
    "C34": ({"seed": -1}, r"config.seed must be an integer in \[0, 2\*\*32\), got -1"),
    "C35": ({"seed": 2 ** 64}, r"config.seed must be an integer in \[0, 2\*\*32\)"),
    "C36": ({"proxy_dim": 2 ** 31}, r"config.proxy_dim must be in \[1, 65536\]"),
    "C37": ({"system.time_jitter": 1000.0}, r"config.system.time_jitter must be in \[0, 5\]"),
    "C38": ({"system.speed_classes": "1,inf"}, r"config.system.speed_classes: values must be "
            "finite"),
    "C42": ({"data.partition": "pathological", "data.class_share_low": 0.7},
            r"config.data.class_share_low \(0.7\) must be <= config.data.class_share_high "
            r"\(0.6\)"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_values_are_refused_naming_the_field(case):
    changes, message = CONFIG_CASES[case]
    config = tiny_config()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    with pytest.raises(ConfigError, match=message) as e:
        validate_config(config)
    assert "\n" not in str(e.value)


def _secagg_config(**secagg):
    config = tiny_config(rounds=2, num_clients=8)
    config.secagg.enabled = True
    for k, v in secagg.items():
        config.secagg[k] = v
    return config


@pytest.mark.slow
def test_C39_a_32_bit_ring_trains_with_sample_count_weights(tmp_path):
    """Weights are sent relative to the round's mean: sample counts of ~100 no longer exceed
    the 32-bit ring's range (every upload was rejected before)."""
    summary = run_experiment(_secagg_config(ring_bits=32), str(tmp_path), show_progress=False)
    assert summary["final"]["uploads_rejected_total"] == 0
    assert summary["final"]["secagg_senders"] == 4


@pytest.mark.parametrize("field, value, message", [
    ("fraction_bits", 61, r"config.secagg.ring_bits=64 with fraction_bits=61 .* the largest "
                          r"that works is fraction_bits=\d+"),
    ("min_senders", 1000, r"config.secagg.min_senders=1000 exceeds the 4 senders"),
])
@pytest.mark.slow
def test_C40_C41_secure_aggregation_settings_that_could_never_sum_are_refused(
        tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment(_secagg_config(**{field: value}), str(tmp_path), show_progress=False)


# --- R: runs -----------------------------------------------------------------------------------

def test_R12_a_lock_being_created_is_never_taken_over(tmp_path):
    """An empty lock file that is fresh belongs to a run creating it (an older version wrote the
    holder after creating the file): refused, not deleted under that run."""
    (tmp_path / ".lock").write_text("")
    with pytest.raises(RunLockedError, match="being locked by another run"):
        WorkdirLock(str(tmp_path)).acquire()
    assert (tmp_path / ".lock").exists()
    old = os.path.getmtime(tmp_path / ".lock") - 3600
    os.utime(tmp_path / ".lock", (old, old))  # an hour-old unreadable lock: stale
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    assert (tmp_path / ".lock").read_text().split()[1] == str(os.getpid())
    lock.release()
    assert not os.listdir(tmp_path)  # no private or set-aside files left


def test_R13_an_unwritable_workdir_is_one_line(tmp_path, monkeypatch):
    """(Root ignores file modes, so the refusal is simulated where the lock file is made.)"""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "link", refuse)
    with pytest.raises(RunLockedError, match=r"workdir .* is not writable \(Permission denied\)"):
        WorkdirLock(str(tmp_path)).acquire()


@pytest.mark.slow
def test_R14_a_run_in_which_nobody_ever_trained_stops_with_an_error(tmp_path):
    config = tiny_config(rounds=2, num_clients=6)
    config.system.dropout = 0.99
    config.system.availability = "0.000000001"
    with pytest.raises(NothingTrainedError, match="no participant's update reached the server"):
        run_experiment(config, str(tmp_path / "a"), show_progress=False)
    config.train.allow_untrained = True
    summary = run_experiment(config, str(tmp_path / "b"), show_progress=False)
    assert summary["clients_trained"] == 0


# --- L: the comparison command line ------------------------------------------------------------

COMPARE_CASES = {
    "L10": (["--config=configs/quickstart.py", "--variant=v:nosuch=1"],
            r"--variant=v: unknown config field\(s\) \['nosuch'\]"),
    "L11": (["--config=configs/quickstart.py", "stray"], r"unexpected arguments \['stray'\]"),
    "L12": (["--config=configs/quickstart.py", "--lr_grid=abc"],
            r"--lr_grid: 'abc' is not a comma-separated list of numbers"),
    "L13": ([], r"--config is required"),
    "L14": (["--config=configs/quickstart.py", "--workdir={file}"], r"is a file, not a directory"),
    "L15": (["--config=configs/quickstart.py", "--algorithms="], r"--algorithms is empty"),
    "L18": (["--config=configs/quickstart.py", "--server_lr_grid=0.1"],
            r"--server_lr_grid needs --lr_grid"),
    "L24": (["--config=configs/quickstart.py", "--extend_edges=1"],
            r"--extend_edges needs --lr_grid"),
    "L25": (["--config=configs/quickstart.py", "--lr_grid=0.01,0.1", "--extend_edges=-1"],
            r"flag --extend_edges=-1: -1 is not a non-negative integer"),
    "L32": (["--config=configs/quickstart.py", "--jobs=0"],
            r"flag --jobs=0: 0 is not a positive integer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(COMPARE_CASES))
def test_compare_command_line_errors_are_one_line_with_exit_status_2(case, tmp_path):
    args, message = COMPARE_CASES[case]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    args = [a.format(file=a_file) for a in args]
    if not any(a.startswith("--workdir") for a in args):
        args.append(f"--workdir={tmp_path / 'cmp'}")
    error = launch_error_line("compare", [*args, "--progress=false", "--seeds=1"])
    assert re.search(message, error), error
    assert "report_only" not in error


def test_L26_a_stray_word_is_refused_before_the_program_runs(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(sys, "argv", ["prog", "stray"])
    with pytest.raises(SystemExit) as refused:
        cli.run(ran.append)
    assert refused.value.code == 2 and ran == []
    assert capsys.readouterr().err.strip() == (
        "error: unexpected arguments ['stray']: flags are --name=value")
    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit):
        cli.run(ran.append)
    assert ran == [["prog"]]


# Every launch program but launch.report (whose one word is the run directory).
FLAG_PROGRAMS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "launch"))
                       if name.endswith(".py") and name not in ("__init__.py", "report.py"))


@pytest.mark.slow
@pytest.mark.parametrize("program", FLAG_PROGRAMS)
def test_L26_every_launch_program_refuses_a_stray_word(program, tmp_path):
    args = {"methods": [], "stop_audit": [f"--runs={tmp_path}"]}.get(
        program, [f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}"])
    error = launch_error_line(program, [*args, "stray"], cwd=tmp_path)
    assert error == "error: unexpected arguments ['stray']: flags are --name=value"
    assert os.listdir(tmp_path) == []  # nothing ran, nothing written


PROGRAM_CASES = {  # (program, flags beside --config=configs/quickstart.py, the error)
    "L27a": ("leakage", ["--victims=0"], r"flag --victims=0: 0 is not a positive integer"),
    "L27b": ("leakage", ["--steps=-5"], r"flag --steps=-5: -5 is not a positive integer"),
    "L27c": ("leakage", ["--noise_multiplier=-1"],
             r"flag --noise_multiplier=-1: -1.0 is not a non-negative number"),
    "L27d": ("leakage", ["--victims=100000"],
             r"--victims=100000 and --secagg_clients=2 need 100001 training images; mnist5k "
             r"has 4000"),
    "L28a": ("sweep_heterogeneity", ["--ratios=abc"],
             r"--ratios: 'abc' is not a comma-separated list of numbers"),
    "L28b": ("sweep_heterogeneity", ["--seeds=0"], r"flag --seeds=0: 0 is not a positive integer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PROGRAM_CASES))
def test_study_program_flags_out_of_range_are_one_line(case, tmp_path):
    program, args, message = PROGRAM_CASES[case]
    error = launch_error_line(program, ["--config=configs/quickstart.py", *args,
                                        f"--workdir={tmp_path / 'out'}"])
    assert re.search(message, error), error
    assert not (tmp_path / "out").exists()


def test_L29_a_full_disk_under_any_program_is_one_line(monkeypatch, capsys):
    def writes_on_a_full_disk(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/out/comparison.md")

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit) as refused:
        cli.run(writes_on_a_full_disk)
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: writing /out/comparison.md failed: no space left on the device (errno 28)")

    def has_a_bug(argv):
        raise OSError(errno.ENOENT, "No such file or directory", "/in/data.npz")

    with pytest.raises(FileNotFoundError):  # not the disk's fault: not hidden
        cli.run(has_a_bug)


def test_L30_an_output_folder_is_checked_before_any_work(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, message in [(a_file, f"--workdir={a_file} is a file, not a directory"),
                          (a_file / "sub", f"--workdir={a_file / 'sub'} cannot be created "
                                           "(Not a directory)")]:
        with pytest.raises(SystemExit) as refused:
            cli.output_folder("workdir", str(path))
        assert refused.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root passes chmod
    with pytest.raises(SystemExit):
        cli.output_folder("figures", str(tmp_path / "new"), "the folder of --output=x/y.md")
    assert capsys.readouterr().err.strip() == (
        "error: the folder of --output=x/y.md cannot be written (permission denied)")
    monkeypatch.undo()
    assert cli.output_folder("workdir", str(tmp_path / "new")) == str(tmp_path / "new")


OUTPUT_CASES = {  # (program, its flags; {file} is a plain file, so {file}/sub cannot be made)
    "L30a": ("leakage", ["--workdir={file}/sub"]),
    "L30b": ("profile_data", ["--workdir={file}/sub"]),
    "L30c": ("sweep_heterogeneity", ["--workdir={file}/sub"]),
    "L30d": ("sweep", ["--sweep.lam=0.5,1", "--workdir={file}/sub"]),
    "L30e": ("compare", ["--workdir={file}/sub"]),
    "L30f": ("findings", ["--finding=F1", "--workdir={file}/sub"]),
    "L30g": ("findings", ["--finding=F1", "--workdir={tmp}/w", "--figures={file}/sub"]),
    "L30h": ("pretrain_proxy", ["--output={file}/sub/proxy.msgpack",
                                "--config.data.public_fraction=0.1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_L30_an_output_folder_that_cannot_be_made_stops_every_program_first(case, tmp_path):
    program, args = OUTPUT_CASES[case]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    args = [a.format(file=a_file, tmp=tmp_path) for a in args]
    error = launch_error_line(
        program, [f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}", *args],
        cwd=tmp_path)
    assert re.search(r"(--(workdir|figures)=|the folder of --output=).*a_file/sub"
                     r"(/proxy.msgpack)? cannot be created \(Not a directory\)", error), error
    written = [name for _, _, names in os.walk(tmp_path) for name in names]
    assert written == ["a_file"]  # no run started (at most an empty folder made)


@pytest.mark.slow
def test_L16_an_absurd_target_epsilon_is_one_line_from_launch_main(tmp_path):
    error = launch_error_line("main", [
        "--config=configs/private_quickstart.py", "--config.dp.target_epsilon=1e9",
        "--config.train.rounds=1", f"--workdir={tmp_path / 'run'}", "--progress=false"],
        absent=("math domain",))
    assert "config.dp.target_epsilon=1e+09" in error and "protects nothing" in error
