"""The workdir's disk and file system: checked before a run trains, and its faults told in one
line (`errors.StorageError`) naming the file and the cause, instead of the checkpoint library's
tracebacks.

Before training (`check_workdir`): the path's length against the file system's limits, with
room for the deepest file a run writes, and the free space against an estimate of one
checkpoint. While a run writes: `is_storage_fault` tells a failure of the disk or file system
(an `OSError`, or orbax's wrapping of one) from a bug, and `file_of` and `cause` name its file
and cause for the one-line `StorageError`."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import shutil
import sys
import tempfile
import time

from absl import logging

from fedjax_pfedes.errors import StorageError

# The deepest path a run writes below its workdir, with room to spare: an orbax step's OCDBT data
# file, `checkpoints/<round>.orbax-checkpoint-tmp-<n>/state.orbax-checkpoint-tmp-<n>/
# ocdbt.process_<i>/d/<32 hex>`.
DEEPEST_RELATIVE_PATH = 160
# What the metrics, client reports and plots of a run may take besides its checkpoints.
OUTPUT_ALLOWANCE_BYTES = 8 * 2**20
# orbax writes a new step next to the kept ones and prunes afterwards; it also writes
# per-array metadata: what one save needs, over the raw bytes of the state.
CHECKPOINT_OVERHEAD = 1.1

_CAUSES = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
           errno.EIO: "an input/output error", errno.ENAMETOOLONG: "a file name too long",
           errno.EROFS: "a read-only file system", errno.EACCES: "permission denied"}


def _limit(path: str, name: str, default: int) -> int:
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        return os.pathconf(existing or "/", name)
    except (OSError, ValueError):
        return default


def check_path(workdir: str) -> None:
    """Raises StorageError when `workdir`, or the deepest file a run writes under it, would be
    a name or path longer than the file system allows."""
    path = os.path.abspath(workdir)
    name_max = _limit(path, "PC_NAME_MAX", 255)
    long = [p for p in path.split(os.sep) if len(p.encode()) > name_max]
    if long:
        raise StorageError(f"--workdir: the folder name '{long[0][:40]}...' has "
                           f"{len(long[0].encode())} bytes; this file system allows {name_max}")
    path_max = _limit(path, "PC_PATH_MAX", 4096)
    need = len(path.encode()) + DEEPEST_RELATIVE_PATH
    if need > path_max:
        raise StorageError(f"--workdir: the path has {len(path.encode())} bytes; with the "
                           f"{DEEPEST_RELATIVE_PATH} a run's checkpoint files add it exceeds "
                           f"the {path_max} this file system allows; choose a shorter workdir")


def check_space(workdir: str, checkpoint_bytes: int, checkpointing: bool) -> None:
    """Refuses a run whose workdir lacks the space of one checkpoint plus the metrics (when
    `checkpointing`), or warns when it runs without checkpoints on nearly no space.

    Args:
      workdir: an existing folder.
      checkpoint_bytes: the raw bytes of the state a checkpoint holds.
      checkpointing: whether the run saves checkpoints (`config.checkpoint.every` > 0).
    """
    free = shutil.disk_usage(workdir).free
    need = int(checkpoint_bytes * CHECKPOINT_OVERHEAD) + OUTPUT_ALLOWANCE_BYTES
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    if checkpointing and free < need:
        raise StorageError(f"--workdir={workdir}: {mib(free)} free, but one checkpoint of this "
                           f"run needs about {mib(checkpoint_bytes)} and its metrics "
                           f"{mib(OUTPUT_ALLOWANCE_BYTES)}; free space, choose another workdir, "
                           "or set --config.checkpoint.every=0")
    if not checkpointing and free < OUTPUT_ALLOWANCE_BYTES:
        logging.warning("workdir %s has %s free; the run's metrics may not fit", workdir,
                        mib(free))


def check_states_space(directory: str, state_bytes: int) -> None:
    """Refuses a run whose clients' states go to memory-mapped files under `directory` when the
    disk lacks their space (files already there, a resumed run's, count as space they reuse):
    before any of them is written, not after filling the disk.

    Args:
      directory: where the state files go (it may not exist yet).
      state_bytes: the bytes of every offloaded client state together.
    """
    existing = sum(os.path.getsize(os.path.join(root, f))
                   for root, _, files in os.walk(directory) for f in files)
    probe = directory
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free + existing
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    if free < state_bytes + OUTPUT_ALLOWANCE_BYTES:
        raise StorageError(
            f"the clients' states go to files under {directory} (beyond "
            f"config.execution.client_state_budget_gb): they need {gib(state_bytes)}, "
            f"{gib(free)} is free there; free space, set config.execution.client_state_dir to "
            "a larger disk, or raise the budget to hold them in memory")


def cause(error: BaseException) -> str:
    """The one-line cause of an I/O failure, from an OSError's errno or from the message of a
    library that wrapped one (orbax/TensorStore: "... [os_error_code='28']")."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _CAUSES:
            return f"{_CAUSES[seen.errno]} (errno {seen.errno})"
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code and int(code.group(1)) in _CAUSES:
            return f"{_CAUSES[int(code.group(1))]} (errno {code.group(1)})"
        seen = seen.__cause__ or seen.__context__
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:300]}"


def file_of(error: BaseException) -> str | None:
    """The file an I/O failure names, where it names one."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.filename:
            return os.fspath(seen.filename)
        found = re.search(r'(?:local file|Failed writing:|file) "([^"]+)"', str(seen))
        if found:
            return found.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def is_storage_fault(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is a failure of the disk or file system."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _CAUSES:
            return True
        if re.search(r"os_error_code='?(\d+)|RESOURCE_EXHAUSTED|No space left", str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def remove_temporary(directory: str) -> list[str]:
    """Removes the unfinished steps (`*.orbax-checkpoint-tmp*`) a failed save left in the
    checkpoint `directory`; returns their names."""
    if not os.path.isdir(directory):
        return []
    gone = [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]
    for name in gone:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return gone


@contextlib.contextmanager
def held_stderr():
    """Holds what is written to file descriptor 2 meanwhile (by Python or by native threads)
    and yields a dict; on leaving, the text is written out unless the body set
    `held["drop"] = True`. After a failed checkpoint write, the storage library's threads print
    one traceback per unfinished write ("Event loop is closed") for a while: the failure path
    waits until they are quiet (`settle`) and drops them, reporting the one cause instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    held = {"drop": False}
    with tempfile.TemporaryFile(dir=_scratch_dir()) as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield held
        finally:
            if held["drop"]:
                gc.collect()  # the failed write tasks' records are written while held
            sys.stderr.flush()
            if held["drop"]:
                settle(capture.fileno())
            os.dup2(saved, 2)
            os.close(saved)
            if not held["drop"]:
                capture.seek(0)
                text = capture.read()
                if text:
                    os.write(2, text)


def _scratch_dir() -> str | None:
    """/dev/shm where there is one (memory: the workdir's disk may be the full one)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def settle(fd: int, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Waits until nothing more is written to `fd` for `quiet_s` (at most `limit_s`)."""
    start, size, since = time.monotonic(), -1, time.monotonic()
    while time.monotonic() - start < limit_s:
        now = os.fstat(fd).st_size
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)
