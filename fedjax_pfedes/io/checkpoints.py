"""Checkpoints of the whole simulation with orbax, and the checks that make resuming safe.

A checkpoint holds the run's `SimState`: everything a round reads that is not a pure function of
(config, seed, round): the server state, every client's private state (incl. local optimizer state),
the upload stages' per-client states (top-k error feedback), the sampler's participation history,
the DP-SGD accountant's per-client step counts, the asynchronous buffer and in-flight updates, the
simulated clock, and (in the JSON meta) the evaluated history. Every random draw is keyed by (seed,
round), so the RNG state is the round number. A run resumed from round r therefore continues exactly
as an unbroken run would.

Layout: `<workdir>/checkpoints/<round>/{state,meta}` (orbax `CheckpointManager`, `max_to_keep`).
"""

from __future__ import annotations

import hashlib
import json
import logging as pylogging
import os
import shutil
import threading
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.errors import ConfigError, StorageError
from fedjax_pfedes.io import storage
from fedjax_pfedes.io.metrics import flatten, to_builtin

# Fields that may differ between the checkpointed run and the resumed one: they change what is
# logged or how it is computed, not the numbers (strategies agree up to float reassociation).
RESUMABLE_CHANGES = ("train.rounds", "train.stop_at_plateau", "train.plateau_", "eval.",
                     "checkpoint.", "monitor.", "execution.", "distributed.")


class _QuietOrbax(pylogging.Filter):
    """Drops orbax's INFO lines (several per save) from the absl log; warnings stay."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname


class _ReportedStorageFaults(pylogging.Filter):
    """Drops asyncio's "Task exception was never retrieved" record (with its traceback) for
    orbax's write tasks that failed on the disk or file system: the failed save reports that
    cause in one line (`Checkpointer.save`). The record is written whenever such a task is
    garbage-collected, which may be after the save has returned. Records of other code's tasks
    are kept."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not (storage.is_storage_fault(error)  and _raised_in_orbax(error))


def _raised_in_orbax(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    return any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


logging.get_absl_logger().addFilter(_QuietOrbax())
pylogging.getLogger("asyncio").addFilter(_ReportedStorageFaults())


def config_changes(saved: dict, current: dict, defaults: dict,
                   source: str = "the checkpoint") -> list[str]:
    """'config.FIELD: saved -> current' for every field that differs and would corrupt a resume.

    train.rounds may grow (a run continued for longer) unless the run depends on the total:
    a DP noise multiplier calibrated to a target epsilon, or FedKD's energy schedule. A field
    the checkpoint lacks (added to the code after it was written) is no change at its shipped
    default (`defaults`, the shipped config's values: `fedjax_pfedes.engine.schema.
    default_values()`): new fields default to the old behaviour.

    Args:
      saved: the config a checkpoint was written with (nested plain values).
      current: this run's config (nested plain values).
      defaults: the shipped defaults (nested plain values).
      source: where `saved` was read, as each line names it.

    Returns:
      One line per field that may not change; empty when the run may resume.
    """
    a, b = flatten(to_builtin(saved), "."), flatten(to_builtin(current), ".")
    default = flatten(defaults, ".")
    known = algorithm_registry.entries()
    depends_on_total = (a.get("dp.enabled") and a.get("dp.target_epsilon", 0) > 0) or (
        a.get("algorithm") in known and known[a["algorithm"]].schedule_depends_on_rounds)
    changes = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<missing>") == b.get(key, "<missing>"):
            continue
        if key not in a and key in b and key in default and default[key] == b[key]:
            continue
        if key.startswith(RESUMABLE_CHANGES) and not (key == "train.rounds" and depends_on_total):
            continue
        changes.append(f"config.{key}: {a.get(key, '<missing>')!r} in {source}, "
                       f"{b.get(key, '<missing>')!r} now")
    return changes


# Orbax coordinates a save through process-wide signals: runs checkpointing from several threads
# of one process (the members of `launch.sweep`) take turns.
ORBAX_LOCK = threading.RLock()


def due(every: int, rounds_done: int, total_rounds: int) -> bool:
    """Whether a run checkpointing every `every` rounds (0 = never) saves after `rounds_done`
    (also after the last round)."""
    return every > 0 and (rounds_done % every == 0 or rounds_done == total_rounds)


class ConfigChangedError(ConfigError):
    """The workdir's checkpoint was written under a config that differs in a field that changes
    the run: resuming would corrupt it (a study that owns its run folders moves it aside)."""


def check_finished_run(workdir: str, current: dict, defaults: dict) -> None:
    """Refuses to start a run over the records of a finished run of another config: a workdir
    whose checkpoints were removed (an archive keeps summary.json and the metrics, not the
    checkpoints) still says, in summary.json, which config made it.

    Args:
      workdir: the run's folder.
      current: this run's config (nested plain values).
      defaults: as `config_changes`.

    Raises:
      ConfigChangedError: summary.json's config differs from `current` in a field that changes
        the run (`config_changes`). An unreadable summary.json is no finished run.
    """
    path = os.path.join(workdir, "summary.json")
    try:
        with open(path) as f:
            saved = json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    changes = (config_changes(saved, current, defaults, "summary.json")
               if isinstance(saved, dict) else [])
    if changes:
        raise ConfigChangedError(
            f"{workdir} holds the records of a finished run of another config (summary.json, no "
            "checkpoint to resume):\n  " + "\n  ".join(changes) + "\nUse another --workdir, or "
            "--config.checkpoint.resume=False to write this run over them.")


class Checkpointer:
    """Saves / restores `(state pytree, meta dict)` under `<workdir>` (when: `due`).

    Every save also writes an integrity record (size and SHA-256 of each file of the step) to
    `<workdir>/checkpoint_integrity/<round>.json`. On resume a step whose files do not match
    its record (a kill during a copy, a truncated or edited file) is reported as corrupt, moved
    to `<workdir>/corrupt_checkpoints/` and the previous intact step is used instead."""

    def __init__(self, workdir: str, max_to_keep: int, read_only: bool = False):
        """`read_only`: only `use_step` and `restore` (the other processes of a run over several
        processes read process 0's checkpoints). Over several processes each process's manager
        works alone (orbax's barriers span only it): process 0 saves process-local copies."""
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        self.integrity_dir = os.path.join(self.workdir, "checkpoint_integrity")
        alone = {}
        if not read_only:
            os.makedirs(self.directory, exist_ok=True)  # orbax will not with active_processes
        if jax.process_count() > 1:
            alone["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index(), active_processes={jax.process_index()},
                barrier_sync_key_prefix=f"process{jax.process_index()}")
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=False, read_only=read_only, **alone))
        self.step: int | None = None  # the step `check_config` selected
        self.verified = False  # whether that step had an integrity record
        self._closed = False

    def save(self, rounds_done: int, state: Any, meta: dict) -> None:
        """Saves the step `rounds_done`. A failure of the disk or file system, or a save past
        the library's time limit, raises `StorageError` naming the file and the cause, after
        removing the unfinished step and shutting the manager's threads down; the last good
        step stays."""
        # Under the lock: fd 2 is the process's, and sweep members save from several threads.
        with ORBAX_LOCK, storage.held_stderr() as held:
            try:
                self._save(rounds_done, state, meta)
                return
            except Exception as e:
                # TimeoutError: the library ends a save that took longer than its limit on the
                # wall clock, which includes time the process spent suspended (Ctrl-Z).
                if not (storage.is_storage_fault(e) or isinstance(e, TimeoutError)):
                    raise
                failure = e
                held["drop"] = True
                self._shut_down()
        storage.remove_temporary(self.directory)
        kept = [s for s in self._steps_on_disk() if s != rounds_done]
        where = storage.file_of(failure) or self._step_dir(rounds_done)
        raise StorageError(
            f"saving the checkpoint of round {rounds_done} failed: {storage.cause(failure)} "
            f"writing {where}; "
            + (f"the last good checkpoint (round {max(kept)}) is kept in {self.directory}"
               if kept else "no earlier checkpoint exists")
            + ("; run the same command to resume (was the process suspended during the save, "
               "or is the file system hung?)" if isinstance(failure, TimeoutError)
               else "; free space and run the same command to resume"))

    def _steps_on_disk(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return [int(n) for n in os.listdir(self.directory) if n.isdigit()]

    def _save(self, rounds_done: int, state: Any, meta: dict) -> None:
        with ORBAX_LOCK:
            self.manager.save(rounds_done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(to_builtin(meta))))
            self.manager.wait_until_finished()  # a kill after this line loses nothing
        os.makedirs(self.integrity_dir, exist_ok=True)
        record = os.path.join(self.integrity_dir, f"{rounds_done}.json")
        with open(record + ".tmp", "w") as f:
            json.dump(_digest(self._step_dir(rounds_done)), f)
        os.replace(record + ".tmp", record)
        kept = {str(s) for s in self.manager.all_steps()}
        for name in os.listdir(self.integrity_dir):  # records of steps orbax has pruned
            if name.endswith(".json") and name[:-5] not in kept:
                os.remove(os.path.join(self.integrity_dir, name))

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def corruption(self, step: int) -> str | None:
        """What is wrong with the files of `step` (None: they match the integrity record)."""
        record = os.path.join(self.integrity_dir, f"{step}.json")
        if not os.path.exists(record):
            return None  # killed between orbax's atomic commit and the record: unverified
        try:
            with open(record) as f:
                expected = json.load(f)
        except (OSError, ValueError) as e:
            return f"unreadable integrity record ({e})"
        found = _digest(self._step_dir(step))
        for name, (size, digest) in sorted(expected.items()):
            if name not in found:
                return f"file {name} is missing"
            if found[name][0] != size:
                return f"file {name} has {found[name][0]} bytes, {size} were saved (truncated?)"
            if found[name][1] != digest:
                return f"file {name} differs from what was saved"
        return None

    def _set_aside(self, step: int, problem: str) -> None:
        aside = os.path.join(self.workdir, "corrupt_checkpoints", str(step))
        logging.warning("checkpoint of round %d in %s is corrupt: %s; moved to %s, resuming from "
                        "the previous intact checkpoint", step, self.directory, problem, aside)
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        shutil.rmtree(aside, ignore_errors=True)
        shutil.move(self._step_dir(step), aside)
        record = os.path.join(self.integrity_dir, f"{step}.json")
        if os.path.exists(record):
            os.remove(record)
        self.manager.reload()

    def check_config(self, current: dict, defaults: dict) -> dict | None:
        """The meta of the latest intact checkpoint (None: none is left), after checking that
        this run's config may resume it. Corrupt steps are set aside with a warning naming the
        round.

        Args:
          current: this run's config as nested plain values (`config.to_dict()`).
          defaults: the shipped defaults (`engine.schema.default_values()`).

        Returns:
          The checkpoint's meta, or None. Raises ConfigError when the checkpoint was written by
          a config that differs in a field that changes the run (client count, architectures,
          algorithm, data, seed, ...)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = self.corruption(step)
            meta = None
            if problem is None:
                try:
                    with ORBAX_LOCK:
                        meta = self.manager.restore(step, args=ocp.args.Composite(
                            meta=ocp.args.JsonRestore()))["meta"]
                except Exception as e:  # noqa: BLE001 - any unreadable meta is corruption
                    problem = f"meta unreadable ({type(e).__name__}: {e})"
            if problem is not None:
                self._set_aside(step, problem)
                continue
            changes = config_changes(meta["config"], current, defaults)
            if changes:
                raise ConfigChangedError(
                    f"cannot resume from {self.directory}/{step}: the config changed in ways "
                    "that would corrupt the run:\n  " + "\n  ".join(changes) + "\nUse another "
                    "--workdir, or --config.checkpoint.resume=False to start this workdir over.")
            self.step = step
            self.verified = os.path.exists(os.path.join(self.integrity_dir, f"{step}.json"))
            return meta
        return None

    def use_step(self, step: int, current: dict, defaults: dict) -> dict:
        """The meta of `step`, chosen by process 0's `check_config` (a read-only checkpointer
        of another process); ConfigError when it cannot be read from here.

        Args:
          step: the round process 0 resumes from.
          current: as `check_config`.
          defaults: as `check_config`.

        Returns:
          The checkpoint's meta.
        """
        try:
            with ORBAX_LOCK:
                meta = self.manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any failure to read it says the same
            raise ConfigError(
                f"config.checkpoint: process {jax.process_index()} cannot read process 0's "
                f"checkpoint {self.directory}/{step} ({type(e).__name__}); across hosts the "
                "workdir must be on a filesystem every process shares, or set "
                "--config.checkpoint.every=0") from None
        changes = config_changes(meta["config"], current, defaults)
        if changes:
            raise ConfigError(f"cannot resume from {self.directory}/{step}: " + changes[0])
        self.step = step
        return meta

    def restore(self, target_state: Any) -> tuple[int, Any]:
        """(rounds done, state) of the step `check_config` selected."""
        step = self.step
        try:
            with ORBAX_LOCK:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target_state)))["state"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot resume from {self.directory}/{step}: the saved state "
                              f"does not match this run's state ({e})") from None
        except Exception as e:  # noqa: BLE001 - unreadable files: corruption, said as such
            raise ConfigError(
                f"cannot resume from {self.directory}/{step}: its files cannot be read "
                f"({'corrupt' if self.verified else 'no integrity record; corrupt?'}: "
                f"{type(e).__name__}: {e}); --config.checkpoint.resume=False starts over"
                ) from None
        return step, restored

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.wait_until_finished()
            self.manager.close()

    def _shut_down(self) -> None:
        """After a failed save: stop the manager's threads without raising its error again."""
        self._closed = True
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001 - its error is the one being reported
            logging.info("checkpoint manager closed after a failed save: %s", e)


def _digest(directory: str) -> dict[str, tuple[int, str]]:
    """{relative path: (size, SHA-256)} of every file under `directory`."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
            out[os.path.relpath(path, directory)] = (os.path.getsize(path), h.hexdigest())
    return out
