"""Ctrl-C during a run: the first press asks the run to stop after the round in progress, with a
checkpoint of that round, so that the same command resumes exactly there; a second press stops
at once (`KeyboardInterrupt`: the run resumes from its last scheduled checkpoint)."""

from __future__ import annotations

import signal
import sys
import threading

import jax


class CtrlC:
    """A context in which SIGINT sets `requested` instead of raising, once.

    Only where SIGINT raises `KeyboardInterrupt` (Python's default: not where it is ignored, as
    in a job started with nohup, nor where a caller handles it), in the main thread (elsewhere
    Python cannot install a handler) of a single-process run (its processes would disagree on
    the round to stop after).
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> CtrlC:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler
                and jax.process_count() == 1):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # the second press: the handler before
        print("\nCtrl-C: the run stops after this round, with a checkpoint of it (Ctrl-C again "
              "to stop at once)", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self._previous)
