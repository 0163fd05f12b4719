"""What keeps a workdir honest: one writer at a time (`WorkdirLock`) and a fingerprint of the
data a checkpoint was written with (`data_fingerprint`)."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import numpy as np
from absl import logging

from fedjax_pfedes.data.federated import FederatedData


class RunLockedError(RuntimeError):
    """Another live process is writing the same workdir."""


class WorkdirLock:
    """`<workdir>/.lock` holding the writer's host and pid. It is created atomically WITH its
    content (written to a private file, then hard-linked into place), so no other process can
    see it empty; a lock left by a process that no longer runs on this host is taken over with
    a warning, by an atomic rename that only one contender wins. An empty or unreadable lock
    younger than `FRESH_S` seconds is treated as held (another writer of an older version may
    be creating it)."""

    FRESH_S = 30.0

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, ".lock")
        self.held = False

    def acquire(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        workdir = os.path.dirname(self.path) or "."
        for _ in range(3):
            try:
                if self._create(me):
                    self.held = True
                    return
            except PermissionError as e:
                raise RunLockedError(f"workdir {workdir} is not writable ({e.strerror}); use "
                                     "another --workdir") from None
            except OSError as e:
                raise RunLockedError(f"cannot create the lock {self.path} ({e.strerror})"
                                     ) from None
            holder = self._holder()
            if holder is not None and self._alive(*holder):
                raise RunLockedError(
                    f"workdir {workdir} is in use by pid {holder[1]} on {holder[0]} "
                    f"({self.path}); wait for it, or use another --workdir")
            if holder is None and self._age() < self.FRESH_S:
                raise RunLockedError(
                    f"workdir {workdir} is being locked by another run ({self.path} is fresh "
                    "and not yet readable); wait for it, or use another --workdir")
            self._take_over(holder)
        raise RunLockedError(f"cannot take the lock {self.path}")

    def _create(self, me: str) -> bool:
        """True when this process now holds a lock file that already names it."""
        private = f"{self.path}.{os.getpid()}.{os.urandom(4).hex()}"
        with open(private, "w") as f:
            f.write(me)
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(private)

    def _take_over(self, holder: tuple[str, int] | None) -> None:
        """Moves a stale lock aside; if what moved was not the stale lock (another run took
        it over in between), it goes back and the workdir counts as in use."""
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it: try to create again
        moved = self._holder(aside)
        if moved != holder:
            try:
                os.link(aside, self.path)
            finally:
                os.remove(aside)
            raise RunLockedError(f"workdir {os.path.dirname(self.path)} was just locked by "
                                 f"another run ({self.path}); use another --workdir")
        logging.warning("taking over the stale lock %s (%s)", self.path,
                        f"pid {holder[1]} on {holder[0]} has ended" if holder else "unreadable")
        os.remove(aside)

    def _age(self) -> float:
        try:
            return time.time() - os.path.getmtime(self.path)
        except OSError:
            return 0.0

    def _holder(self, path: str | None = None) -> tuple[str, int] | None:
        try:
            with open(path or self.path) as f:
                host, pid = f.read().split()
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
