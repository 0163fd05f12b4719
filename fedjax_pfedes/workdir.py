"""What keeps a workdir honest: one writer at a time (`WorkdirLock`) and a fingerprint of the
data a checkpoint was written with (`data_fingerprint`)."""

from __future__ import annotations

import hashlib
import os
import socket

import numpy as np
from absl import logging

from fedjax_pfedes.data.federated import FederatedData


class RunLockedError(RuntimeError):
    """Another live process is writing the same workdir."""


class WorkdirLock:
    """`<workdir>/.lock` holding the writer's host and pid, created atomically. A lock left by a
    process that no longer runs on this host is taken over with a warning."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, ".lock")
        self.held = False

    def acquire(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._alive(*holder):
                    raise RunLockedError(
                        f"workdir {os.path.dirname(self.path)} is in use by pid {holder[1]} on "
                        f"{holder[0]} ({self.path}); wait for it, or use another --workdir"
                        ) from None
                logging.warning("taking over the stale lock %s (%s)", self.path,
                                f"pid {holder[1]} on {holder[0]} has ended" if holder
                                else "unreadable")
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return
        raise RunLockedError(f"cannot take the lock {self.path}")

    def _holder(self) -> tuple[str, int] | None:
        try:
            host, pid = open(self.path).read().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(host: str, pid: int) -> bool:
        if host != socket.gethostname():
            return True  # cannot tell: assume another machine's run is alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def release(self) -> None:
        if self.held and os.path.exists(self.path):
            os.remove(self.path)
        self.held = False


def data_fingerprint(data: FederatedData) -> str:
    """SHA-256 over the dataset's arrays and every client's train/test indices: resuming with
    other data contents (a regenerated .npz, another download) is refused even when the config
    is unchanged."""
    h = hashlib.sha256()
    c = data.central
    for a in (c.x_train, c.y_train, c.x_test, c.y_test, *data.train_indices,
              *data.test_indices):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
