"""The workdir's disk and file system: faults told in one line naming the file and the cause
(`io.storage`), a report of a run in progress, and damaged files named (docs/threat_model.md,
R15-R21)."""

import errno
import json
import logging
import os

import pytest

from fedjax_pfedes.errors import StorageError
from fedjax_pfedes.io import metrics, run_report, storage


def test_the_cause_of_a_wrapped_os_error_is_read_from_its_code_or_errno():
    wrapped = ValueError('RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database at local file '
                         '"/w/checkpoints/3.orbax-checkpoint-tmp/state/": Failed to write 99 '
                         "bytes to file 9: No space left on device [os_error_code='28']")
    assert storage.cause(wrapped) == "no space left on the device (errno 28)"
    assert storage.file_of(wrapped) == "/w/checkpoints/3.orbax-checkpoint-tmp/state/"
    assert storage.is_storage_fault(wrapped)
    try:
        try:
            raise OSError(errno.EIO, "Input/output error", "/w/metrics.jsonl")
        except OSError as e:
            raise RuntimeError("the writer thread failed") from e
    except RuntimeError as outer:
        assert storage.cause(outer) == "an input/output error (errno 5)"
        assert storage.file_of(outer) == "/w/metrics.jsonl"
        assert storage.is_storage_fault(outer)
    assert not storage.is_storage_fault(ValueError("shapes differ"))
    assert storage.cause(ValueError("shapes differ")) == "ValueError: shapes differ"


def test_unfinished_steps_are_removed_and_finished_ones_kept(tmp_path):
    for name in ("2", "3.orbax-checkpoint-tmp-17", "3.orbax-checkpoint-tmp"):
        os.makedirs(tmp_path / name / "d")
    assert sorted(storage.remove_temporary(str(tmp_path))) == [
        "3.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-17"]
    assert os.listdir(tmp_path) == ["2"]
    assert storage.remove_temporary(str(tmp_path / "none")) == []


def test_a_path_too_long_for_the_file_system_is_refused_naming_the_limit(tmp_path):
    storage.check_path(str(tmp_path / "fine"))
    with pytest.raises(StorageError, match=r"the folder name 'aaaa.*' has 300 bytes; this file "
                                           r"system allows 255"):
        storage.check_path(str(tmp_path / ("a" * 300)))
    deep = os.path.join(str(tmp_path), *["b" * 250] * 16)
    with pytest.raises(StorageError, match=r"exceeds the 4096 this file system allows"):
        storage.check_path(deep)


def test_too_little_space_for_one_checkpoint_is_refused_with_the_figures(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(storage.shutil, "disk_usage",
                        lambda path: type("U", (), {"free": 3 * 2**20})())
    with pytest.raises(StorageError, match=r"3.0 MiB free, but one checkpoint of this run needs "
                                           r"about 50.0 MiB"):
        storage.check_space(str(tmp_path), 50 * 2**20, checkpointing=True)
    storage.check_space(str(tmp_path), 50 * 2**20, checkpointing=False)  # a warning only


def test_held_stderr_gives_back_what_was_written_unless_dropped(capfd):
    with storage.held_stderr():
        os.write(2, b"kept\n")
    with storage.held_stderr() as held:
        os.write(2, b"dropped\n")
        held["drop"] = True
    err = capfd.readouterr().err
    assert "kept" in err and "dropped" not in err


def test_a_failed_write_task_collected_after_the_save_logs_no_traceback(caplog):
    """asyncio logs "Task exception was never retrieved" with a traceback whenever one of the
    storage library's failed write tasks is garbage-collected, which may be after the failed
    save has reported its cause in one line: those records are dropped; other errors, and
    storage faults of code other than orbax's, are kept."""
    from fedjax_pfedes.io import checkpoints  # noqa: F401 - installs the filter

    def raised(error, where):  # `error` raised by code in the file `where`
        try:
            exec(compile("raise error", where, "exec"), {"error": error})
        except Exception as e:  # noqa: BLE001
            return e

    def task_record(error):
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=(type(error), error, error.__traceback__))

    in_orbax = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py")
    full = ValueError("RESOURCE_EXHAUSTED: Error writing \"x/0\": Failed to write 957341 "
                      "bytes to file 8: No space left on device [os_error_code='28']")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        task_record(raised(full, in_orbax))
        task_record(raised(OSError(errno.EDQUOT, "Disk quota exceeded"), in_orbax))
        assert not caplog.records
        task_record(raised(ValueError("a bug in a user's callback"), in_orbax))
        task_record(raised(OSError(errno.ENOSPC, "a user's own task"), "/home/me/mine.py"))
    assert [r.exc_info[1].args[-1] for r in caplog.records] == ["a bug in a user's callback",
                                                                "a user's own task"]


def test_a_save_past_the_libraries_time_limit_is_one_line_and_keeps_the_last_step(
        tmp_path, monkeypatch):
    """A process suspended (Ctrl-Z) during an asynchronous save for longer than orbax's limit
    (a wall-clock time) gets orbax's TimeoutError when it continues."""
    import jax.numpy as jnp

    from fedjax_pfedes.io import checkpoints
    saver = checkpoints.Checkpointer(str(tmp_path), max_to_keep=3)
    saver.save(1, {"w": jnp.ones(3)}, {"round": 1})

    def timed_out(self, rounds_done, state, meta):
        os.makedirs(os.path.join(self.directory, f"{rounds_done}.orbax-checkpoint-tmp-1"))
        raise TimeoutError("ChainedFuture completed 3/4 futures but timed out after 3473.12 "
                           "seconds.")

    monkeypatch.setattr(checkpoints.Checkpointer, "_save", timed_out)
    with pytest.raises(StorageError, match=r"checkpoint of round 2 failed: TimeoutError: .*"
                                           r"3473.12 seconds.*last good checkpoint \(round 1\) "
                                           r"is kept.*suspended during the save") as e:
        saver.save(2, {"w": jnp.ones(3)}, {"round": 2})
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_records_are_strict_json_with_non_finite_values_named(tmp_path):
    log = metrics.JsonlLog(str(tmp_path / "m.jsonl"), 0)
    log.write({"round": 1, "a": float("nan"), "b": {"c": float("-inf"), "d": 2.0}})
    line = open(tmp_path / "m.jsonl").read()
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert row == {"round": 1, "a": None, "b": {"c": None, "d": 2.0},
                   "non_finite_as_null": ["a", "b.c"]}


def test_a_line_cut_off_mid_write_is_left_out_and_a_damaged_one_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}\n{"round": 3, "pers')
    assert metrics.read_jsonl_lines(str(path)) == ([{"round": 1}, {"round": 2}], True)
    path.write_text('{"round": 1}\n{"rou\n{"round": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        metrics.read_jsonl(str(path))


def _run_dir(tmp_path, summary: str | None, tail: str = ""):
    rows = [{"round": r, "uploads_rejected_total": 0, "train_ce_loss_mean": 1.0 / r,
             **({"personalized_accuracy_mean": 0.5, "personalized_accuracy_std": 0.1,
                 "global_accuracy_mean": 0.4} if r % 2 == 0 else {})} for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if summary is not None:
        (tmp_path / "summary.json").write_text(summary)
    return str(tmp_path)


def test_the_report_of_a_run_in_progress_covers_its_complete_rounds_and_says_so(tmp_path):
    workdir = _run_dir(tmp_path, None, tail='{"round": 4, "train_')
    run_report.write_report(workdir)
    text = open(tmp_path / "report.md").read()
    assert "Run in progress" in text and "the 3 complete rounds" in text
    assert "| rounds written | 3 |" in text


def test_a_truncated_summary_is_named(tmp_path):
    workdir = _run_dir(tmp_path, '{"final": {"round": 3, "personalized_acc')
    with pytest.raises(ValueError, match=r"summary.json is not complete JSON .*cut off"):
        run_report.write_report(workdir)


def test_each_process_of_a_resumed_run_has_its_wall_time():
    # elapsed_s carried over (one process), restarted by an older resume (two), absent
    assert metrics.process_wall_times([{"elapsed_s": 1.0}, {"elapsed_s": 2.5},
                                       {"elapsed_s": 4.0}]) == [4.0]
    assert metrics.process_wall_times([{"elapsed_s": 1.0}, {"elapsed_s": 3.0},
                                       {"round": 3}, {"elapsed_s": 0.5},
                                       {"elapsed_s": 2.0}]) == [3.0, 2.0]
    assert metrics.process_wall_times([{"round": 1}]) == []


def test_client_states_that_would_fill_the_disk_are_refused_before_a_file_is_written(
        tmp_path, monkeypatch):
    """Offloaded states of a large population (configs/cross_device_10k.py: 33 GiB) are
    refused with the figures when the disk lacks their space; files already there (a resumed
    run's) count as space they reuse."""
    monkeypatch.setattr(storage.shutil, "disk_usage",
                        lambda path: type("U", (), {"free": 3 * 2**30})())
    directory = tmp_path / "run" / "client_states"  # not made yet
    with pytest.raises(StorageError, match=r"they need 10.00 GiB, 3.00 GiB is free there"):
        storage.check_states_space(str(directory), 10 * 2**30)
    assert not directory.exists()
    storage.check_states_space(str(directory), 2 * 2**30)
    (directory / "cnn").mkdir(parents=True)
    with open(directory / "cnn" / "leaf0.npy", "wb") as f:
        f.truncate(8 * 2**30)  # sparse: its apparent size is the space it reuses
    storage.check_states_space(str(directory), 10 * 2**30)
