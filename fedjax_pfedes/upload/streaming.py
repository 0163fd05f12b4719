"""The server's weighted sum kept while a cohort's participants train, instead of their stacked
uploads (the 'scan' strategy's streaming aggregation).

A round of the 'scan' strategy trains its participants one at a time inside one compiled
`lax.scan`. When the server step is a weighted mean (`Algorithm.mean_server_step`) and the
upload pipeline transforms nothing (its stages only check uploads and weigh them by samples),
each upload is added into a running sum in the scan's carry while it is in cache, and the
stacked uploads (participants x model size, written and read back by the server) are never
made. What the checks need is kept per client (`rounds.upload_finish`: finite, norm), and the
stages decide after the scan exactly as on stacked uploads:

- the finite check is per client: a non-finite upload never enters the sum (when
  `config.upload.reject_nonfinite`);
- the norm rule compares each norm per local sample with the round's median, known only at the
  end. The `hold` uploads with the largest norm per sample are therefore held aside in the carry
  (a new upload larger than the smallest held one takes its place, and that one joins the sum);
  the rule can only reject uploads larger than every upload it keeps, so as long as it rejects
  at most `hold` uploads of a cohort, those are all held and simply not added (`finalize`).
  More rejections than that cannot be undone from a sum: the round stops with an error naming
  `config.execution.scan_held_uploads`.

The result equals the weighted mean of the accepted stacked uploads up to the order of the
float32 additions (tested against it in tests/test_streaming.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# What a streamed cohort's reduced carry holds.
SUM, WEIGHT, HELD, HELD_SCORE, HELD_SLOT, HELD_WEIGHT = (
    "sum", "weight", "held", "held_score", "held_slot", "held_weight")


class HeldUploadsExceeded(RuntimeError):
    """The norm rule rejected more uploads of a cohort than the scan held aside."""


@dataclasses.dataclass(frozen=True)
class StreamingMean:
    """The reducer of `execution.Finishing` for 'samples'-weighted means (see the module).

    Attributes:
      hold: uploads held aside per cohort for the norm rule (0: the rule is off).
      reject_nonfinite: whether non-finite uploads are rejected (else they enter the sum, as
        they enter the stacked mean).
    """

    hold: int
    reject_nonfinite: bool

    def init(self, template) -> dict:
        """The empty carry for uploads shaped like `template`."""
        zeros = lambda shape: jax.tree.map(  # noqa: E731
            lambda t: jnp.zeros(shape + jnp.shape(t), jnp.float32), template)
        return {SUM: zeros(()), WEIGHT: jnp.zeros((), jnp.float32),
                HELD: zeros((self.hold,)),
                HELD_SCORE: jnp.full((self.hold,), -jnp.inf, jnp.float32),
                HELD_SLOT: jnp.full((self.hold,), -1, jnp.int32),
                HELD_WEIGHT: jnp.zeros((self.hold,), jnp.float32)}

    def add(self, carry: dict, upload, facts: dict, size, position, valid) -> dict:
        """`carry` with one client's `upload` added (or held aside).

        Args:
          carry: from `init` or a previous `add`.
          upload: the client's upload (the template's structure).
          facts: its `UploadPipeline.client_facts` ('finite', 'norm').
          size: its local training samples (its weight, and the norm rule's divisor).
          position: its position j in the round's bucket (held uploads are named by it).
          valid: False for a padded slot (nothing is added).
        """
        weight = size.astype(jnp.float32)
        ok = valid if not self.reject_nonfinite else valid & facts["finite"]
        upload = jax.tree.map(lambda u: u.astype(jnp.float32), upload)

        if self.hold == 0:
            return {**carry, SUM: jax.tree.map(lambda s, u: s + jnp.where(ok, weight * u, 0.0),
                                               carry[SUM], upload),
                    WEIGHT: carry[WEIGHT] + jnp.where(ok, weight, 0.0)}
        # Without a branch (a `lax.cond` copies the whole carry in and out on XLA:CPU): held
        # row k is read and rewritten every time, with itself unless this upload takes it.
        score = facts["norm"] / jnp.maximum(weight, 1.0)  # the norm rule's per-sample norm
        k = jnp.argmin(carry[HELD_SCORE])
        take = ok & (score > carry[HELD_SCORE][k])
        evicted_w = jnp.where(take & (carry[HELD_SLOT][k] >= 0), carry[HELD_WEIGHT][k], 0.0)
        added_w = jnp.where(ok & ~take, weight, 0.0)

        write = jnp.where(take, k, self.hold)  # out of range: the write is dropped

        def leaf(s, h, u):  # `where`, not a zero weight: 0 x NaN is NaN
            row = jax.lax.dynamic_index_in_dim(h, k, keepdims=False)
            s = s + jnp.where(evicted_w > 0, evicted_w * row, 0.0) + jnp.where(
                added_w > 0, added_w * u, 0.0)
            return s, h.at[write].set(u, mode="drop")

        out = jax.tree.map(leaf, carry[SUM], carry[HELD], upload)
        treedef = jax.tree.structure(carry[SUM])
        sums, held = (jax.tree.unflatten(treedef, [o[i] for o in treedef.flatten_up_to(out)])
                      for i in (0, 1))
        return {SUM: sums, WEIGHT: carry[WEIGHT] + evicted_w + added_w, HELD: held,
                HELD_SCORE: carry[HELD_SCORE].at[k].set(
                    jnp.where(take, score, carry[HELD_SCORE][k])),
                HELD_SLOT: carry[HELD_SLOT].at[k].set(
                    jnp.where(take, position.astype(jnp.int32), carry[HELD_SLOT][k])),
                HELD_WEIGHT: carry[HELD_WEIGHT].at[k].set(
                    jnp.where(take, weight, carry[HELD_WEIGHT][k]))}


@jax.jit
def _finalize(carry: dict, accept_held: jax.Array):
    extra = accept_held.astype(jnp.float32) * carry[HELD_WEIGHT]
    total = carry[WEIGHT] + jnp.sum(extra)
    safe = jnp.where(total > 0, total, 1.0)
    mean = jax.tree.map(lambda s, h: (s + jnp.tensordot(extra, h, axes=1)) / safe,
                        carry[SUM], carry[HELD])
    return jax.tree.map(lambda m: m[None], mean), total[None]


def finalize(carry: dict, accepted: np.ndarray, rejected_for_norm: np.ndarray, arch: str,
             round_index: int) -> tuple[dict, jax.Array]:
    """The cohort's group for the server step: (its weighted mean as one row, [total weight]),
    over the sum and the held uploads whose slots are still `accepted`.

    Args:
      carry: the cohort's reduced carry (held uploads are named by their bucket position).
      accepted: [bucket] the slots the stages kept (valid, finite, not an outlier).
      rejected_for_norm: [bucket] the slots the norm rule rejected (each must be held aside).
      arch, round_index: the cohort and the 0-based round, for the error.

    Raises:
      HeldUploadsExceeded: when an upload the norm rule rejected was not held aside (it
        rejected more than `hold` uploads of the cohort), naming the config field.
    """
    held_ids = np.asarray(jax.device_get(carry[HELD_SLOT]))
    if np.setdiff1d(np.flatnonzero(rejected_for_norm), held_ids).size:
        raise HeldUploadsExceeded(
            f"round {round_index + 1}: the norm rule rejected {int(rejected_for_norm.sum())} "
            f"uploads of cohort '{arch}', more than the {len(held_ids)} the 'scan' strategy holds "
            "aside (config.execution.scan_held_uploads): raise it, or use "
            "execution.strategy='loop'")
    held = held_ids >= 0
    accept_held = held & np.asarray(accepted, bool)[np.where(held, held_ids, 0)]
    return _finalize(carry, jnp.asarray(accept_held))


@functools.cache
def reducer(hold: int, reject_nonfinite: bool) -> StreamingMean:
    """One `StreamingMean` per setting (the same object every round: it is part of the
    compiled program's identity)."""
    return StreamingMean(hold, reject_nonfinite)
