"""The server's weights and aggregates: aggregation weights (`Weighting`), a robust aggregator
over the accepted uploads (`RobustAggregation`) and the DP Gaussian mechanism's noisy mean
(`DPNoisyMean`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_pfedes.upload import privacy, robust
from fedjax_pfedes.upload.stages.stage import (
    RoundUploads,
    UploadStage,
    register_stage,
    scope_key,
    skip_scope,
    weighted_row_sum,
)


@register_stage
@dataclasses.dataclass
class Weighting(UploadStage):
    """Zeroes the rejected slots' values (NaN x weight 0 is still NaN) and sets the weights:
    sample counts, their square root, uniform (`robust.smooth_weights`), or all of a client's
    samples, training and local test ('all_samples', the published pFedES code's weights)."""

    weighting: str
    name = "weighting"
    position = 50

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.upload.weighting)

    @property
    def transforms(self) -> bool:
        return self.weighting != "samples"

    def server(self, r: RoundUploads) -> None:
        for arch, c in r.cohorts.items():
            ok = jnp.asarray(r.valid[arch])
            if r.sent.get(arch) is not None:
                r.sent[arch] = _zero_rejected_rows(ok, r.sent[arch])
            if self.weighting == "all_samples":
                counts = c.sizes if c.all_sizes is None else c.all_sizes
                r.weights[arch] = robust.smooth_weights(counts, ok, "samples")
            else:
                r.weights[arch] = robust.smooth_weights(c.sizes, ok, self.weighting)


@jax.jit
def _zero_rejected_rows(ok: jax.Array, sent: Any) -> Any:
    """Rows of rejected clients set to 0 in every leaf: one program per cohort shape (applied
    leaf by leaf outside jit it compiled a small program per leaf in round 1)."""
    return jax.tree.map(lambda a: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0.0),
                        sent)


@register_stage
@dataclasses.dataclass
class RobustAggregation(UploadStage):
    """Coordinate-wise median or trimmed mean per scope; a scope with fewer than
    `robust.MIN_ROBUST_UPLOADS` valid uploads gets no update (and says so)."""

    aggregator: str
    trim_fraction: float
    name = "robust_aggregation"
    transforms = True
    report_keys = ("robust_aggregation_skipped",)
    position = 60  # one aggregator: secure sum, else DP noisy mean, else median / trimmed mean

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        if cfg.secagg is not None or cfg.dp is not None or cfg.upload.aggregator == "mean":
            return None
        return cls(cfg.upload.aggregator, cfg.upload.trim_fraction)

    def __post_init__(self):
        self._robust = jax.jit(self._aggregate)

    def _aggregate(self, stacked, valid):
        if self.aggregator == "median":
            return robust.coordinate_median(stacked, valid)
        return robust.trimmed_mean(stacked, valid, self.trim_fraction)

    def server(self, r: RoundUploads) -> None:
        r.aggregates = {}
        for scope in r.scopes:
            stacked, ok, _ = r.scope_arrays(scope)
            if ok.sum() < robust.MIN_ROBUST_UPLOADS:
                # A median / trimmed mean of 1-2 uploads is their mean: no protection. Skip.
                skip_scope(r, "robust_aggregation_skipped",
                      f"{'+'.join(scope)}: {int(ok.sum())} valid upload(s), config.upload."
                      f"aggregator='{self.aggregator}' needs >= {robust.MIN_ROBUST_UPLOADS}")
                agg = r.skip_scope(scope)
            else:
                agg = self._robust(stacked, jnp.asarray(ok))
            r.aggregates.update({a: agg for a in scope})


@register_stage
@dataclasses.dataclass
class DPNoisyMean(UploadStage):
    """DP-FedAvg: the sum of the clipped updates plus N(0, (sigma C)^2), divided by the expected
    number of participants in the scope (fixed denominator)."""

    noise_multiplier: float
    clip_norm: float
    name = "dp_noisy_mean"
    transforms = True
    report_keys = ("dp_realized_noise_multiplier",)  # written by the pipeline for the accountant
    position = 60

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        if cfg.secagg is not None or cfg.dp is None:
            return None
        return cls(noise_multiplier, cfg.dp.clip_norm)

    def __post_init__(self):
        self._noisy_mean = jax.jit(self._mean)
        self._noisy_total = jax.jit(self._released)

    def _released(self, total, key, denominator):
        noise = privacy.gaussian_noise_like(total, key, self.noise_multiplier * self.clip_norm)
        return jax.tree.map(lambda t, z: (t + z) / denominator, total, noise)

    def _mean(self, stacked, valid, key, denominator):
        return self._released(weighted_row_sum(stacked, valid.astype(jnp.float32)), key,
                              denominator)

    def server(self, r: RoundUploads) -> None:
        r.aggregates = {}
        for s_idx, scope in enumerate(r.scopes):
            key = scope_key(r, s_idx)
            denominator = jnp.float32(r.expected_in_scope(sum(r.members[a] for a in scope)))
            if r.streamed(scope):  # the clipped updates were summed as they were made
                agg = self._noisy_total(r.scope_sum(scope), key, denominator)
            else:
                stacked, ok, _ = r.scope_arrays(scope)
                agg = self._noisy_mean(stacked, jnp.asarray(ok), key, denominator)
            r.aggregates.update({a: agg for a in scope})
