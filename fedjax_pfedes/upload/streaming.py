"""The server's weighted sum kept while a cohort's participants train, instead of their stacked
uploads (the 'scan' strategy's streaming aggregation).

A round of the 'scan' strategy trains its participants one at a time inside one compiled
`lax.scan`. When the server step is a weighted mean (`Algorithm.mean_server_step`) and the
upload pipeline transforms nothing (its stages only check uploads and weigh them by samples),
each upload is added into a running sum in the scan's carry while it is in cache, and the
stacked uploads (participants x model size, written and read back by the server) are never
made. What the checks need is kept per client (`plan.UploadPlan.finish`: finite, norm), and the
stages decide after the scan exactly as on stacked uploads:

- the finite check is per client: a non-finite upload never enters the sum (when
  `config.upload.reject_nonfinite`);
- the norm rule compares each norm per local sample with the round's median, known only at the
  end, and it can only reject the largest ones. The scan therefore keeps the `hold` largest
  norms per sample seen so far (scalars), and an upload that enters them is written to a row
  of its own in the carry instead of the sum (up to `rows` of them; the expected number of such
  arrivals in random order is about hold x (1 + ln(participants / hold))). After the scan the
  held uploads the stages kept are added (`finalize`). Every upload among the round's `hold`
  largest was among the largest seen when it arrived, so as long as the rule rejects at most
  `hold` uploads of a cohort they are all held and simply not added; otherwise (or when rows
  ran out before a rejected upload arrived) the round stops with an error naming
  `config.execution.scan_held_uploads`. The held rows are only ever written inside the scan
  (a row read there makes XLA:CPU copy the whole buffer every iteration).

The result equals the weighted mean of the accepted stacked uploads up to the order of the
float32 additions (tested against it in tests/upload/test_streaming.py).

Under client-level DP whose client half only checks, measures and clips (no compression), the
scan sums the clipped updates instead (`StreamingClippedSum`): the DP aggregators add their
noise once to that sum, as they do to the sum of the stacked clipped updates (central
DP-FedAvg, and secure aggregation simulated as 'aggregate'); nothing is held aside, since the
norm rule is off under DP.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.upload import privacy

# What a streamed cohort's reduced carry holds.
SUM, WEIGHT, TOP, HELD, HELD_AT, HELD_WEIGHT = (
    "sum", "weight", "top", "held", "held_at", "held_weight")
LANES = "lanes"  # a merged carry's held uploads, one {HELD, HELD_AT, HELD_WEIGHT} per lane
COUNT = "count"  # a clipped sum's number of updates
ROWS_PER_HOLD = 8  # rows for held uploads per upload the norm rule may reject


class HeldUploadsExceeded(ValueError):
    """The norm rule rejected an upload of a cohort the scan had not held aside: the value of
    `config.execution.scan_held_uploads` cannot run this round (the launchers print it as one
    line and exit 2)."""


@dataclasses.dataclass(frozen=True)
class StreamingMean:
    """The reducer of `execution.strategies.protocol.Finishing` for 'samples'-weighted means (see
    the module).

    Attributes:
      hold: the most uploads of a cohort the norm rule may reject in a round (0: the rule is
        off, nothing is held).
      rows: rows for held uploads (`ROWS_PER_HOLD` x hold, at most the bucket).
      reject_nonfinite: whether non-finite uploads are rejected (else they enter the sum, as
        they enter the stacked mean).
    """

    hold: int
    rows: int
    reject_nonfinite: bool

    def init(self, template) -> dict:
        """The empty carry for uploads shaped like `template`."""
        zeros = lambda shape: jax.tree.map(  # noqa: E731
            lambda t: jnp.zeros(shape + jnp.shape(t), jnp.float32), template)
        return {SUM: zeros(()), WEIGHT: jnp.zeros((), jnp.float32),
                TOP: jnp.full((self.hold,), -jnp.inf, jnp.float32),
                HELD: zeros((self.rows,)), HELD_AT: jnp.full((self.rows,), -1, jnp.int32),
                HELD_WEIGHT: jnp.zeros((self.rows,), jnp.float32)}

    def add(self, carry: dict, upload, facts: dict, size, position, valid, template) -> dict:
        """`carry` with one client's `upload` added to the sum, or held aside.

        Args:
          carry: from `init` or a previous `add`.
          upload: the client's upload (the template's structure).
          facts: its `UploadPipeline.client_facts` ('finite', 'norm').
          size: its local training samples (its weight, and the norm rule's divisor).
          position: its position j in the round's bucket (held uploads are named by it).
          valid: False for a padded slot (nothing is added).
          template: the upload template (not read: the mean is of the uploads themselves).
        """
        del template
        weight = size.astype(jnp.float32)
        ok = valid if not self.reject_nonfinite else valid & facts["finite"]
        held = jnp.bool_(False)
        out = dict(carry)
        if self.hold:
            score = facts["norm"] / jnp.maximum(weight, 1.0)  # the norm rule's per sample
            k = jnp.argmin(carry[TOP])
            enters = ok & (score > carry[TOP][k])
            out[TOP] = carry[TOP].at[k].set(jnp.where(enters, score, carry[TOP][k]))
            count = jnp.sum(carry[HELD_AT] >= 0)  # rows used, filled in order
            held = enters & (count < self.rows)
            row = jnp.where(held, count, self.rows)  # out of range: nothing written
            out[HELD] = jax.tree.map(
                lambda h, u: h.at[row].set(u.astype(jnp.float32), mode="drop"),
                carry[HELD], upload)
            out[HELD_AT] = carry[HELD_AT].at[row].set(position.astype(jnp.int32), mode="drop")
            out[HELD_WEIGHT] = carry[HELD_WEIGHT].at[row].set(weight, mode="drop")
        into_sum = ok & ~held  # `where`, not a zero weight: 0 x NaN is NaN
        out[SUM] = jax.tree.map(
            lambda s, u: s + jnp.where(into_sum, weight * u.astype(jnp.float32), 0.0),
            carry[SUM], upload)
        out[WEIGHT] = carry[WEIGHT] + jnp.where(into_sum, weight, 0.0)
        return out

    def merge(self, carries: list[dict]) -> dict:
        """One carry from the carries of lanes that each streamed some of a cohort's
        participants (the 'scan' strategy on several host threads): the sums and weights added,
        each lane's held uploads kept where they are (`LANES`, read by `finalize`; nothing is
        copied). An upload among the round's `hold` largest is among its lane's largest, so a
        lane holds it as one stream would."""
        if len(carries) == 1:
            return carries[0]
        sums, weights = _added(tuple(c[SUM] for c in carries), tuple(c[WEIGHT] for c in carries))
        return {SUM: sums, WEIGHT: weights, TOP: carries[0][TOP],
                LANES: tuple(held for c in carries for held in held_lanes(c))}


@dataclasses.dataclass(frozen=True)
class StreamingClippedSum:
    """The reducer of `execution.strategies.protocol.Finishing` under client-level DP: each client's
    update (upload - template) clipped to L2 <= `clip_norm` and added to a sum, with the count of
    the updates added. It is the client half of the upload chain when that half is the finite check,
    the norm and the clip only (`UploadPipeline.streamed_clip_norm`); the DP aggregators
    (`stages.DPNoisyMean`, `stages.SecureAggregation` with simulation 'aggregate') then add the
    noise once to the sum, as they do to the sum of the stacked clipped updates.

    Attributes:
      clip_norm: C of `config.dp.clip_norm` (the `stages.Clip` stage's math: `privacy.
        clip_scale` of the update's norm, the chain's 'norm' fact measured before the clip).
      reject_nonfinite: whether non-finite updates are left out (the finite check rejects them).
    """

    clip_norm: float
    reject_nonfinite: bool

    def init(self, template) -> dict:
        """The empty carry for uploads shaped like `template`."""
        return {SUM: jax.tree.map(lambda t: jnp.zeros(jnp.shape(t), jnp.float32), template),
                COUNT: jnp.zeros((), jnp.float32)}

    def add(self, carry: dict, upload, facts: dict, size, position, valid, template) -> dict:
        """`carry` with one client's clipped update added (arguments as `StreamingMean.add`;
        `facts` must hold the chain's 'finite' and 'norm' of the update)."""
        del size, position  # every clipped update counts once (uniform weights under DP)
        ok = valid if not self.reject_nonfinite else valid & facts["finite"]
        scale = privacy.clip_scale(facts["norm"], self.clip_norm)
        total = jax.tree.map(  # `where`, not a zero factor: 0 x NaN is NaN
            lambda s, u, t: s + jnp.where(
                ok, (u.astype(jnp.float32) - t.astype(jnp.float32)) * scale, 0.0),
            carry[SUM], upload, template)
        return {SUM: total, COUNT: carry[COUNT] + ok.astype(jnp.float32)}

    def merge(self, carries: list[dict]) -> dict:
        """One carry from lanes' carries (`StreamingMean.merge`): the clipped sums and counts
        added."""
        if len(carries) == 1:
            return carries[0]
        sums, counts = _added(tuple(c[SUM] for c in carries), tuple(c[COUNT] for c in carries))
        return {SUM: sums, COUNT: counts}


@jax.jit
def _added(trees: tuple, scalars: tuple):
    """(the sum of `trees`, the sum of `scalars`), added in lane order."""
    return jax.tree.map(lambda *a: functools.reduce(jnp.add, a), *trees), \
        functools.reduce(jnp.add, scalars)


def held_lanes(carry: dict) -> tuple[dict, ...]:
    """A streamed carry's held uploads per lane: ({HELD, HELD_AT, HELD_WEIGHT}, ...), one
    entry for a carry of one stream."""
    if LANES in carry:
        return carry[LANES]
    return ({HELD: carry[HELD], HELD_AT: carry[HELD_AT], HELD_WEIGHT: carry[HELD_WEIGHT]},)


@functools.cache
def clipped_sum_reducer(clip_norm: float, reject_nonfinite: bool) -> StreamingClippedSum:
    """One `StreamingClippedSum` per setting (the same object every round and bucket)."""
    return StreamingClippedSum(clip_norm, reject_nonfinite)


@functools.partial(jax.jit, static_argnums=4)
def _finalize(total_sum, weight, lanes: tuple, accept_held: tuple, used: tuple):
    # Only the first `used` rows of a lane were written (rows fill in order): the rest are not
    # read.
    extras = [a[:u].astype(jnp.float32) * lane[HELD_WEIGHT][:u]
              for lane, a, u in zip(lanes, accept_held, used, strict=True)]
    total = weight + functools.reduce(jnp.add, [jnp.sum(e) for e in extras])
    safe = jnp.where(total > 0, total, 1.0)

    def leaf(s, *held):  # rejected rows zeroed first: 0 x Inf is NaN
        for h, a, e, u in zip(held, accept_held, extras, used, strict=True):
            h = h[:u]
            h = jnp.where(a[:u].reshape((-1,) + (1,) * (h.ndim - 1)), h, 0.0)
            s = s + jnp.tensordot(e, h, axes=1)
        return s / safe

    mean = jax.tree.map(leaf, total_sum, *[lane[HELD] for lane in lanes])
    return jax.tree.map(lambda m: m[None], mean), total[None]


# The fewest held rows `_finalize` reads per lane: each distinct count is a compilation of it, in
# the first rounds of a run, and a small bucket's held counts would otherwise make several.
_MIN_ROWS_READ = 8


def _rows_to_read(used: int, rows: int) -> int:
    """The used rows rounded up to a power of two, at least `_MIN_ROWS_READ` and at most
    `rows`: a few compiled shapes (the rows past the used ones weigh 0)."""
    return min(rows, max(_MIN_ROWS_READ, 1 << max(used - 1, 0).bit_length()))


def finalize(carry: dict, accepted: np.ndarray, rejected_for_norm: np.ndarray, arch: str,
             round_index: int) -> tuple[dict, jax.Array]:
    """The cohort's group for the server step: (its weighted mean as one row, [total weight]),
    over the sum and the held uploads whose slots are still `accepted`.

    Args:
      carry: the cohort's reduced carry (held uploads are named by their bucket position).
      accepted: [bucket] the slots the stages kept (valid, finite, not an outlier).
      rejected_for_norm: [bucket] the slots the norm rule rejected (each must be held aside).
      arch: the cohort, for the error.
      round_index: the 0-based round, for the error.

    Raises:
      HeldUploadsExceeded: when an upload the norm rule rejected is in the sum, naming the
        config field.
    """
    lanes = held_lanes(carry)
    held_at = [np.asarray(a) for a in jax.device_get([lane[HELD_AT] for lane in lanes])]
    if np.setdiff1d(np.flatnonzero(rejected_for_norm), np.concatenate(held_at)).size:
        raise HeldUploadsExceeded(
            f"round {round_index + 1}: the norm rule rejected {int(rejected_for_norm.sum())} "
            f"uploads of cohort '{arch}', one of them not held aside by the 'scan' strategy "
            f"(it holds up to {int(np.shape(carry[TOP])[0])} per cohort, "
            "config.execution.scan_held_uploads): raise it, or use execution.strategy='loop'")
    accepted = np.asarray(accepted, bool)
    accept_held, used = [], []
    for at in held_at:
        held = at >= 0
        accept_held.append(jnp.asarray(held & accepted[np.where(held, at, 0)]))
        used.append(_rows_to_read(int(held.sum()), len(held)))
    return _finalize(carry[SUM], carry[WEIGHT], lanes, tuple(accept_held), tuple(used))


@functools.cache
def reducer(hold: int, bucket: int, reject_nonfinite: bool) -> StreamingMean:
    """One `StreamingMean` per setting (the same object every round: it is part of the
    compiled program's identity), with `ROWS_PER_HOLD` x `hold` rows, at most `bucket`."""
    return StreamingMean(hold, min(ROWS_PER_HOLD * hold, bucket), reject_nonfinite)
