"""Checkpoints of the whole simulation with orbax, and the checks that make resuming safe.

A checkpoint holds everything a round reads that is not a pure function of (config, seed, round):
the server state, every client's private state (incl. local optimizer state), the upload
pipeline's error-feedback memories, the sampler's participation history, the DP-SGD accountant's
per-client step counts, the asynchronous buffer and in-flight updates, the simulated clock, and
the evaluated history. Every random draw is keyed by (seed, round), so the RNG state is the round
number. A run resumed from round r therefore continues exactly as an unbroken run would.

Layout: `<workdir>/checkpoints/<round>/{state,meta}` (orbax `CheckpointManager`, `max_to_keep`).
"""

from __future__ import annotations

import logging as pylogging
import os
from typing import Any

import ml_collections
import orbax.checkpoint as ocp
from absl import logging

from fedjax_pfedes.config_validation import ConfigError
from fedjax_pfedes.metrics_io import flatten, to_builtin

# Fields that may differ between the checkpointed run and the resumed one: they change what is
# logged or how it is computed, not the numbers (strategies agree up to float reassociation).
RESUMABLE_CHANGES = ("train.rounds", "eval.", "checkpoint.", "monitor.", "execution.")


class _QuietOrbax(pylogging.Filter):
    """Drops orbax's INFO lines (several per save) from the absl log; warnings stay."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname


logging.get_absl_logger().addFilter(_QuietOrbax())


def config_changes(saved: dict, current: dict) -> list[str]:
    """'config.FIELD: saved -> current' for every field that differs and would corrupt a resume.

    train.rounds may grow (a run continued for longer) unless the run depends on the total:
    a DP noise multiplier calibrated to a target epsilon, or FedKD's energy schedule."""
    a, b = flatten(to_builtin(saved), "."), flatten(to_builtin(current), ".")
    depends_on_total = (a.get("dp.enabled") and a.get("dp.target_epsilon", 0) > 0) or (
        a.get("algorithm") == "fedkd")
    changes = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<missing>") == b.get(key, "<missing>"):
            continue
        if key.startswith(RESUMABLE_CHANGES) and not (key == "train.rounds" and depends_on_total):
            continue
        changes.append(f"config.{key}: {a.get(key, '<missing>')!r} in the checkpoint, "
                       f"{b.get(key, '<missing>')!r} now")
    return changes


class Checkpointer:
    """Saves / restores `(state pytree, meta dict)` every `every` rounds under `<workdir>`."""

    def __init__(self, workdir: str, every: int, max_to_keep: int):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.every = every
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                                 create=True))

    def latest_round(self) -> int | None:
        return self.manager.latest_step()

    def due(self, rounds_done: int, total_rounds: int) -> bool:
        return self.every > 0 and (rounds_done % self.every == 0 or rounds_done == total_rounds)

    def save(self, rounds_done: int, state: Any, meta: dict) -> None:
        self.manager.save(rounds_done, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(to_builtin(meta))))
        self.manager.wait_until_finished()  # a kill after this line loses nothing

    def check_config(self, config: ml_collections.ConfigDict) -> dict:
        """The latest checkpoint's meta, after checking that `config` may resume it.

        Raises ConfigError when the checkpoint was written by a config that differs in a field
        that changes the run (client count, architectures, algorithm, data, seed, ...)."""
        step = self.manager.latest_step()
        meta = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        changes = config_changes(meta["config"], config.to_dict())
        if changes:
            raise ConfigError(
                f"cannot resume from {self.directory}/{step}: the config changed in ways that "
                "would corrupt the run:\n  " + "\n  ".join(changes) + "\nUse another --workdir, "
                "or --config.checkpoint.resume=False to start this workdir over.")
        return meta

    def restore(self, target_state: Any) -> tuple[int, Any]:
        """(rounds done, state) of the latest checkpoint; call `check_config` first."""
        step = self.manager.latest_step()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target_state)))["state"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot resume from {self.directory}/{step}: the saved state "
                              f"does not match this run's state ({e})") from None
        return step, restored

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
