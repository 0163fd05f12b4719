"""Where metrics go.

`<workdir>/metrics.jsonl`: one JSON object per round (evaluation fields at evaluated rounds);
`metrics.csv`: the same rows flattened (nested dicts become `key/sub` columns); `clients.jsonl`:
one line per selected client per round (the per-client report); `rejections.jsonl`; TensorBoard
event files under `tensorboard/` (scalars per round, update-norm histograms); `summary.json`.
On resume, every file is cut back to the checkpoint's round, so the files of a resumed run equal
those of an unbroken one.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import threading
from typing import Any

import numpy as np


def to_builtin(value: Any) -> Any:
    """Converts numpy/jax scalars and arrays to JSON-serializable Python values."""
    if isinstance(value, dict):
        return {k: to_builtin(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_builtin(v) for v in value]
    if hasattr(value, "tolist"):
        return np.asarray(value).tolist()
    return value


def strict_json(value: Any, where: str = "", found: list[str] | None = None) -> Any:
    """`to_builtin`, with every non-finite float (NaN, Inf) replaced by None: strict JSON
    (`NaN` is not JSON, and strict parsers reject it). The paths of the replaced values are
    appended to `found`."""
    return _nulls(to_builtin(value), where, found)


def _nulls(value: Any, where: str, found: list[str] | None) -> Any:
    """`strict_json` on values already converted by `to_builtin` (one pass)."""
    if isinstance(value, dict):
        return {k: _nulls(v, f"{where}.{k}" if where else str(k), found)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_nulls(v, f"{where}[{i}]", found) for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        if found is not None:
            found.append(where)
        return None
    return value


NON_FINITE_KEY = "non_finite_as_null"  # a record's fields that were NaN/Inf, written as null


def write_json(path: str, obj: dict) -> None:
    """Writes `obj` as strict JSON (non-finite values as null, their paths listed under
    `NON_FINITE_KEY`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    found: list[str] = []
    out = strict_json(obj, found=found)
    if found:
        out[NON_FINITE_KEY] = found
    with open(path, "w") as f:
        json.dump(out, f, indent=2, allow_nan=False)


def read_jsonl(path: str) -> list[dict]:
    """The complete records of a JSON-lines file ([] when it is missing). A last line cut off
    mid-write (a run still writing, or killed) is left out; see `read_jsonl_lines`."""
    return read_jsonl_lines(path)[0]


def read_jsonl_lines(path: str) -> tuple[list[dict], bool]:
    """(the complete records, whether an unfinished last line was left out).

    Raises:
      ValueError: naming the file and the line, for a line before the last that is not JSON
        (a damaged file, not one being written).
    """
    if not os.path.exists(path):
        return [], False
    with open(path) as f:
        lines = f.read().split("\n")
    rows, cut = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: still being written
                cut = True
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e.msg}); the file is "
                             "damaged") from None
    return rows, cut


# The fields of a round's record that time the machine, not the simulation: two runs with the
# same numbers (a resumed run and an unbroken one, two execution strategies) differ only in these.
WALL_CLOCK_FIELDS = ("round_time_s", "elapsed_s")


def process_wall_times(records: list[dict]) -> list[float]:
    """The wall time of each process that wrote a run's rounds (its metrics.jsonl, in order).

    A record's `elapsed_s` counts from its run's start. A run resumed from a checkpoint carries
    the earlier processes' time over, so its `elapsed_s` keeps growing; in files written
    before it did, `elapsed_s` falls where a resumed process began. Each process's share is
    then the last `elapsed_s` before such a fall (a run never resumed, or resumed since: one
    process, its last `elapsed_s`).

    Args:
      records: the rounds' records; those without `elapsed_s` are skipped.

    Returns:
      One figure per process, first first ([] without any `elapsed_s`).
    """
    shares: list[float] = []
    last = None
    for r in records:
        e = r.get("elapsed_s")
        if e is None:
            continue
        if last is not None and e < last:
            shares.append(last)
        last = e
    return shares if last is None else [*shares, last]


def flatten(record: dict, sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts as {'a<sep>b': value}."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flatten_scalars(record: dict) -> dict[str, float]:
    """Numeric leaves of a record as {'a/b': value}; lists, strings and None are left out."""
    return {k: float(v) for k, v in flatten(record).items()
            if isinstance(v, bool | int | float | np.number)}


class JsonlLog:
    """Appends JSON lines; on resume keeps only the lines of rounds <= `keep_rounds`."""

    def __init__(self, path: str, keep_rounds: int):
        self.path = path
        kept = [r for r in read_jsonl(path) if r.get("round", 0) <= keep_rounds]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        found: list[str] = []
        out = strict_json(record, found=found)
        if found:
            out[NON_FINITE_KEY] = found
        with open(self.path, "a") as f:
            f.write(json.dumps(out, allow_nan=False) + "\n")


def write_csv(rows: list[dict], path: str) -> None:
    """Rows flattened to scalar columns (union of keys, in order of first appearance)."""
    flat = [flatten_scalars(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)


_IMPORT_LOCK = threading.Lock()  # sweep members open their writers from several threads


def summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported on first use. When PyTorch is installed,
    tensorboardX imports it at once (about 2 s of start-up on this repository's CI-class machine)
    only to accept torch tensors; we log Python floats, so unless the program has imported torch
    already, tensorboardX is imported with torch hidden (`import torch` fails meanwhile, as if
    it were not installed). Importing torch later works as usual."""
    with _IMPORT_LOCK:
        if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
            sys.modules["torch"] = None  # type: ignore[assignment]
            try:
                from tensorboardX import SummaryWriter
            finally:
                if sys.modules.get("torch", 0) is None:
                    del sys.modules["torch"]
            return SummaryWriter
    from tensorboardX import SummaryWriter
    return SummaryWriter


_TENSORBOARD_FAILURES: list[BaseException] = []  # what tensorboardX's writer threads raised
_PREVIOUS_HOOK = None


def _catch_tensorboard_failures() -> None:
    """Keeps what a tensorboardX writer thread raises (a full disk: OSError ENOSPC) instead of
    printing its traceback; `RunWriters` then stops the run with one line instead of blocking
    on the dead thread's full queue."""
    global _PREVIOUS_HOOK
    if _PREVIOUS_HOOK is not None:
        return
    _PREVIOUS_HOOK = threading.excepthook

    def hook(args):
        if type(args.thread).__name__ == "_EventLoggerThread":
            _TENSORBOARD_FAILURES.append(args.exc_value)
            return
        _PREVIOUS_HOOK(args)

    threading.excepthook = hook


def _abandon(writer) -> None:
    """Lets a tensorboardX writer whose thread died go without waiting on it: its exit-time
    close and its queue's feeder would block on the full queue forever."""
    events = getattr(getattr(writer, "file_writer", None), "event_writer", None)
    if events is None:
        return
    queue = getattr(events, "_event_queue", None)
    if queue is not None and hasattr(queue, "cancel_join_thread"):
        queue.cancel_join_thread()
    events._closed = True


class RunWriters:
    """All per-round outputs of a run (see the module docstring)."""

    def __init__(self, workdir: str, resume_round: int = 0, tensorboard: bool = True,
                 client_report: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.metrics = JsonlLog(os.path.join(workdir, "metrics.jsonl"), resume_round)
        self.rejections = JsonlLog(os.path.join(workdir, "rejections.jsonl"), resume_round)
        self.clients = (JsonlLog(os.path.join(workdir, "clients.jsonl"), resume_round)
                        if client_report else None)
        self.csv_path = os.path.join(workdir, "metrics.csv")
        self.tb = None
        self._tb_failures_before = len(_TENSORBOARD_FAILURES)
        if tensorboard:
            _catch_tensorboard_failures()
            # purge_step: TensorBoard drops events of rounds after the checkpoint on resume.
            self.tb = summary_writer_class()(os.path.join(workdir, "tensorboard"),
                                    purge_step=resume_round + 1 if resume_round else None)

    def write_round(self, record: dict, client_rows: list[dict], rejections: list[dict]
                    ) -> None:
        self.metrics.write(record)
        for r in rejections:
            self.rejections.write({"round": record["round"], **r})
        if self.clients is not None:
            for row in client_rows:
                self.clients.write({"round": record["round"], **row})
        if self.tb is not None:
            self._check_tensorboard()
            step = record["round"]
            for k, v in flatten_scalars(record).items():
                if k != "round" and np.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            norms = [c["update_norm"] for c in client_rows
                     if c.get("update_norm") is not None and np.isfinite(c["update_norm"])]
            if norms:
                self.tb.add_histogram("update_norm", np.asarray(norms), step)

    def _check_tensorboard(self) -> None:
        """Raises the OSError a TensorBoard writer thread died of (its queue would block the
        next write forever); the writer is dropped first, so closing does not wait on it."""
        if len(_TENSORBOARD_FAILURES) > self._tb_failures_before:
            error = _TENSORBOARD_FAILURES[-1]
            _abandon(self.tb)
            self.tb = None
            if isinstance(error, OSError):
                raise OSError(error.errno, error.strerror,
                              os.path.join(self.workdir, "tensorboard")) from error
            raise OSError(f"the TensorBoard writer of {self.workdir} failed: {error!r}")

    def flush(self) -> None:
        """Rewrites metrics.csv from metrics.jsonl and flushes TensorBoard."""
        write_csv(read_jsonl(self.metrics.path), self.csv_path)
        if self.tb is not None:
            self._check_tensorboard()
            self.tb.flush()

    def close(self) -> None:
        try:
            self.flush()
        except BaseException:
            if self.tb is not None:  # a failing disk: closing could wait on a dead thread
                _abandon(self.tb)
                self.tb = None
            raise
        if self.tb is not None:
            if len(_TENSORBOARD_FAILURES) > self._tb_failures_before:
                _abandon(self.tb)
            else:
                self.tb.close()
            self.tb = None
