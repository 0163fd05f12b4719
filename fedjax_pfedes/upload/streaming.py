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
  end. An upload it rejects is already in the sum, and a sum cannot give it back exactly (an
  outlier can be many orders larger than the rest): in such a round the cohort's participants
  are trained again from their rows as they were before the round, with stacked uploads, and
  the mean is taken of the accepted ones as under any other strategy
  (`pipeline.CohortUploads.restack`, kept by `engine.rounds`). Honest rounds rarely meet it
  (docs/threat_model.md gives the rule's false-positive rates); a simulated attack never
  streams.

The result equals the weighted mean of the accepted stacked uploads up to the order of the
float32 additions (tested against it in tests/upload/test_streaming.py).

Under client-level DP whose client half only checks, measures and clips (no compression), the
scan sums the clipped updates instead (`StreamingClippedSum`): the DP aggregators add their
noise once to that sum, as they do to the sum of the stacked clipped updates (central
DP-FedAvg, and secure aggregation simulated as 'aggregate'); the norm rule is off under DP.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fedjax_pfedes.upload import privacy

# What a streamed cohort's reduced carry holds.
SUM, WEIGHT = "sum", "weight"
COUNT = "count"  # a clipped sum's number of updates


@dataclasses.dataclass(frozen=True)
class StreamingMean:
    """The reducer of `execution.strategies.protocol.Finishing` for 'samples'-weighted means (see
    the module).

    Attributes:
      reject_nonfinite: whether non-finite uploads are rejected (else they enter the sum, as
        they enter the stacked mean).
    """

    reject_nonfinite: bool

    def init(self, template) -> dict:
        """The empty carry for uploads shaped like `template`."""
        return {SUM: jax.tree.map(lambda t: jnp.zeros(jnp.shape(t), jnp.float32), template),
                WEIGHT: jnp.zeros((), jnp.float32)}

    def add(self, carry: dict, upload, facts: dict, size, position, valid, template) -> dict:
        """`carry` with one client's `upload` added to the sum, weighted by its samples.

        Args:
          carry: from `init` or a previous `add`.
          upload: the client's upload (the template's structure).
          facts: its `UploadPipeline.client_facts` ('finite', 'norm').
          size: its local training samples (its weight).
          position: its position j in the round's bucket (not read).
          valid: False for a padded slot (nothing is added).
          template: the upload template (not read: the mean is of the uploads themselves).
        """
        del position, template
        weight = size.astype(jnp.float32)
        ok = valid if not self.reject_nonfinite else valid & facts["finite"]
        return {SUM: jax.tree.map(  # `where`, not a zero weight: 0 x NaN is NaN
                    lambda s, u: s + jnp.where(ok, weight * u.astype(jnp.float32), 0.0),
                    carry[SUM], upload),
                WEIGHT: carry[WEIGHT] + jnp.where(ok, weight, 0.0)}

    def merge(self, carries: list[dict]) -> dict:
        """One carry from the carries of lanes that each streamed some of a cohort's
        participants (the 'scan' strategy on several host threads): the sums and weights
        added, in lane order."""
        if len(carries) == 1:
            return carries[0]
        sums, weights = _added(tuple(c[SUM] for c in carries), tuple(c[WEIGHT] for c in carries))
        return {SUM: sums, WEIGHT: weights}


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


@functools.cache
def clipped_sum_reducer(clip_norm: float, reject_nonfinite: bool) -> StreamingClippedSum:
    """One `StreamingClippedSum` per setting (the same object every round and bucket)."""
    return StreamingClippedSum(clip_norm, reject_nonfinite)


@jax.jit
def finalize(carry: dict) -> tuple[dict, jax.Array]:
    """A streamed cohort's group for the server step: (its weighted mean as one row, [its total
    weight]), from its reduced carry (`StreamingMean`), when the stages rejected none of the
    uploads it summed (else `pipeline.CohortUploads.restack`)."""
    safe = jnp.where(carry[WEIGHT] > 0, carry[WEIGHT], 1.0)
    mean = jax.tree.map(lambda s: (s / safe)[None], carry[SUM])
    return mean, carry[WEIGHT][None]


@functools.cache
def mean_reducer(reject_nonfinite: bool) -> StreamingMean:
    """One `StreamingMean` per setting (the same object every round: it is part of the compiled
    program's identity)."""
    return StreamingMean(reject_nonfinite)
