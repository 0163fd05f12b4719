"""The paired verdict rule of the findings and comparisons: a claim about an arm against a
reference is decided on the per-seed differences (same seed: same data, clients and sampling)
and their Student-t 95% confidence interval: 'reproduced' when the interval excludes 0 (or the
claim's margin) on the claimed side, 'refuted' on the other, 'inconclusive' otherwise. Diverged
seeds are never dropped: they count with a stated value (`scored_final`, `scored_oscillation`)
or make the interval unbounded."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.studies.experiments import student_t_interval

REPRODUCED, REFUTED, INCONCLUSIVE = "reproduced", "refuted", "inconclusive"
VERDICTS = (REPRODUCED, REFUTED, INCONCLUSIVE)
CONFIDENCE = 0.95
# A diverged run's loss curve is taken to swing by its own mean every round: far above any
# converging curve's oscillation (mean |second difference| / mean loss).
DIVERGED_OSCILLATION = 1.0


def final(records: list[dict], key: str = "personalized_accuracy_mean") -> np.ndarray:
    """[seeds] final-round value of `key` (NaN for a diverged run)."""
    return np.array([np.nan if r.get("diverged") else r["final"][key] for r in records])


def curve(records: list[dict], key: str) -> np.ndarray:
    """[seeds, rounds] per-round values of `key`: NaN where missing, and after the last round of
    a run that stopped early (diverged)."""
    rows = [[np.nan if v is None else v for v in r["curves"][key]] for r in records]
    out = np.full((len(rows), max(map(len, rows), default=0)), np.nan)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def oscillation(values: np.ndarray) -> float:
    """Round-to-round roughness of a loss curve: mean |L[t+1] - 2 L[t] + L[t-1]| / mean L (a
    smooth monotone curve scores ~0, a zig-zag high); inf when the curve is not finite."""
    v = np.asarray(values, np.float64)
    if len(v) < 3:
        return float("nan")
    if not np.all(np.isfinite(v)):
        return float("inf")
    return float(np.mean(np.abs(np.diff(v, 2))) / max(np.mean(np.abs(v)), 1e-12))


@dataclasses.dataclass(frozen=True)
class Paired:
    """A paired comparison over seeds: per-seed differences and their confidence interval."""

    label: str
    diffs: np.ndarray      # [seeds] arm - reference (NaN: no value for that seed)
    mean: float
    low: float
    high: float
    verdict: str

    def row(self, scale: float = 1.0, unit: str = "") -> list[str]:
        """[label, 'mean [low, high] unit', n, verdict] for a Markdown table."""
        n = int(np.isfinite(self.diffs).sum())
        return [self.label, f"{scale * self.mean:+.4g} [{scale * self.low:+.4g}, "
                f"{scale * self.high:+.4g}]{unit}", f"{n}/{len(self.diffs)}", self.verdict]


def confidence_interval(diffs, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences' Student-t interval
    (`experiments.student_t_interval`: unbounded with a NaN, fewer than 2 values or no spread)."""
    return student_t_interval(diffs, confidence)


def paired_verdict(label: str, arm, reference, direction: int, margin: float = 0.0) -> Paired:
    """Verdict on the claim `direction * (arm - reference - margin) > 0`, paired by seed.

    Args:
      label: what is compared, for the table.
      arm: per-seed values.
      reference: per-seed values of the same seeds, in the same order.
      direction: +1 if the claim is that arm exceeds reference by more than `margin`, -1 if
        that it falls short of it by more than `margin` (arm - reference < margin).
      margin: the claimed difference's threshold (0: any difference).

    Returns:
      'reproduced' when the confidence interval of arm - reference lies beyond `margin` on the
      claimed side, 'refuted' when it lies on the other side, 'inconclusive' otherwise.
    """
    diffs = np.asarray(arm, np.float64) - np.asarray(reference, np.float64)
    mean, low, high = confidence_interval(diffs)
    beyond, short = (low > margin, high < margin) if direction > 0 else (high < margin,
                                                                           low > margin)
    verdict = REPRODUCED if beyond else REFUTED if short else INCONCLUSIVE
    return Paired(label, diffs, mean, low, high, verdict)


def within_verdict(label: str, arm, reference, margin: float) -> Paired:
    """Verdict on the claim |arm - reference| <= margin (equivalence), paired by seed:
    'reproduced' when the whole interval lies in [-margin, margin], 'refuted' when it lies
    wholly outside it, 'inconclusive' otherwise."""
    diffs = np.asarray(arm, np.float64) - np.asarray(reference, np.float64)
    mean, low, high = confidence_interval(diffs)
    verdict = (REPRODUCED if -margin <= low and high <= margin
               else REFUTED if low > margin or high < -margin else INCONCLUSIVE)
    return Paired(label, diffs, mean, low, high, verdict)


def combined(comparisons: Sequence[Paired]) -> str:
    """Reproduced when every comparison is, refuted when any is, inconclusive otherwise."""
    verdicts = [c.verdict for c in comparisons]
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return REFUTED if REFUTED in verdicts else INCONCLUSIVE


def comparison_table(comparisons: Sequence[Paired], scale: float = 1.0, unit: str = "") -> str:
    """Markdown: one row per paired comparison (mean [95% CI], seeds with a value, verdict)."""
    return markdown.table(["paired difference (same seeds)", "mean [95% CI]", "seeds", "verdict"],
                  [c.row(scale, unit) for c in comparisons])


def scored_final(records: list[dict], key: str = "personalized_accuracy_mean") -> np.ndarray:
    """[seeds] final-round value of `key`; a diverged run scores 0 (it left no usable model)."""
    return np.array([0.0 if r.get("diverged") else r["final"][key] for r in records],
                    np.float64)  # a null (non-finite) value: NaN


def scored_oscillation(records: list[dict], key: str) -> np.ndarray:
    """[seeds] oscillation of the per-round curve `key`; a diverged run (or any non-finite
    curve) scores `DIVERGED_OSCILLATION`."""
    out = np.array([oscillation(c) for c in curve(records, key)])
    diverged = np.array([bool(r.get("diverged")) for r in records]) | ~np.isfinite(out)
    return np.where(diverged, DIVERGED_OSCILLATION, out)
