"""Stopping a run where its evaluated accuracy has stopped moving (`config.train.stop_at_plateau`).

The rule (`plateau_reached`) is the one the comparisons use to count runs "at a plateau"
(`studies.experiments.at_plateau`): with k = `window` x the evaluations so far (at least 1), the
mean personalized accuracy over the last k evaluations differs from the mean over the k before
by less than `tolerance`. Windows that grow with the run keep a short flat stretch of a rising
curve from stopping it, and a dip (a fall, or its recovery) moves the two means apart. The
callback reads the evaluated history the checkpoint holds (`SimState.history`), so a resumed run
stops where the unbroken one does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedjax_pfedes.engine.callbacks import Callback, RoundEnd, RunInfo

METRIC = "personalized_accuracy_mean"


def plateau_reached(accuracies: Sequence[float], window: float, tolerance: float,
                    min_evaluations: int = 2) -> bool:
    """Whether an accuracy curve has flattened.

    Args:
      accuracies: the evaluated accuracies in round order.
      window: the share of the evaluations in each of the two compared windows (k = max(1,
        round(window x n))).
      tolerance: the largest difference between the two windows' means that counts as flat.
      min_evaluations: fewer evaluations than this never count (nor fewer than 2k).

    Returns:
      True when the curve is flat by the rule; False for a curve with a non-finite value.
    """
    acc = np.asarray(accuracies, np.float64)
    k = max(1, int(round(window * len(acc))))
    if len(acc) < max(2 * k, min_evaluations) or not np.all(np.isfinite(acc)):
        return False
    return bool(abs(acc[-k:].mean() - acc[-2 * k:-k].mean()) < tolerance)


class PlateauStop(Callback):
    """Ends the run after an evaluated round at which `plateau_reached` holds; the record gets
    `stopped_at_plateau: true` and summary.json `stopped_early` says why and when."""

    def __init__(self, window: float, tolerance: float, min_evaluations: int):
        self.window, self.tolerance, self.min_evaluations = window, tolerance, min_evaluations

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        if not end.evaluated or end.stop:
            return
        curve = [h[METRIC] for h in end.state.history if METRIC in h] + [end.record[METRIC]]
        if plateau_reached(curve, self.window, self.tolerance, self.min_evaluations):
            k = max(1, int(round(self.window * len(curve))))
            end.record["stopped_at_plateau"] = True
            end.stop = True
            end.stop_reason = (
                f"plateau: mean personalized accuracy of the last {k} evaluations "
                f"{np.mean(curve[-k:]):.4f}, of the {k} before {np.mean(curve[-2 * k:-k]):.4f} "
                f"(within {self.tolerance:g}; config.train.stop_at_plateau)")
