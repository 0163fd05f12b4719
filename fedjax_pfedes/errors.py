"""The errors a user acts on, one place for all layers (a leaf: imports nothing).

Each message names the config field, file, client or leaf at fault; `launch/` turns them into a
one-line message and exit status 2 (3 for a diverged run).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config field with a value the simulator cannot run."""


class NothingTrainedError(ConfigError):
    """No participant's update reached the server in any round (and
    `config.train.allow_untrained` is False): every figure describes the initial models."""


class DataError(ValueError):
    """A dataset that cannot be trained on honestly; the message names the file or dataset, the
    array and the first offending index."""


class DatasetUnavailableError(RuntimeError):
    """Raised when a dataset cannot be read on this machine (e.g. not prepared, no network)."""


class DivergedError(RuntimeError):
    """Training went non-finite (and `config.train.allow_divergence` is False); the summary with
    `diverged: true` has been written."""


class RunInterrupted(KeyboardInterrupt):
    """The user stopped a run (Ctrl-C, SIGINT): the message says where it can resume from. A
    `KeyboardInterrupt`, so that code catching `Exception` does not swallow it."""


class StorageError(RuntimeError):
    """The workdir's disk or file system failed (no space, I/O error, a name too long): the
    message names the file and the cause; the last good checkpoint is kept."""
