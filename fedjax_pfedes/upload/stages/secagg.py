"""Secure aggregation as an upload stage: the server sees only masked sums per aggregation
scope (`upload.secure_aggregation` is the protocol it runs)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.tree_util import tree_size
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload import secure_aggregation as sa_protocol
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
class SecureAggregation(UploadStage):
    """Bonawitz et al. 2017 over each scope's valid clients (`secure_aggregation.secure_sum`):
    each client's vector (weighted update and weight; with DP, its clipped update plus its share
    of the noise) is range-checked on the client before masking; fewer than `min_senders`
    senders get no sum; the decoded mean's quantization error bound and, with DP, the noise the
    senders really added are reported."""

    threshold_fraction: float
    dropout_after_upload: float
    min_senders: int
    encoding: sa_protocol.RingEncoding
    noise_multiplier: float  # > 0: client-level DP noise added by the senders
    clip_norm: float
    dp: bool
    simulation: str  # `secure_aggregation.secure_sum`: its output, or every party
    name = "secure_aggregation"
    transforms = True
    report_keys = ("secagg_senders", "secagg_dropped_after_upload", "secagg_failures",
                   "secagg_skipped", "secagg_quantization_error_bound",
                   "dp_realized_noise_multiplier")
    position = 60

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        s = cfg.secagg
        if s is None:
            return None
        return cls(s.threshold_fraction, s.dropout_after_upload, s.min_senders, cfg.encoding,
                   noise_multiplier, cfg.dp.clip_norm if cfg.dp is not None else 1.0,
                   cfg.dp is not None, s.simulation)

    def __post_init__(self):
        self._released = jax.jit(lambda total, key, std, divisor: jax.tree.map(
            lambda t, z: (t + z) / divisor, total, privacy.gaussian_noise_like(total, key, std)))

    def server(self, r: RoundUploads) -> None:
        r.aggregates = {}
        for s_idx, scope in enumerate(r.scopes):
            denominator = r.expected_in_scope(sum(r.members[a] for a in scope))
            key = scope_key(r, s_idx)
            if self.simulation == "aggregate":
                agg = self._aggregate_mean(r, scope, key, denominator)
            else:
                stacked, ok, w = r.scope_arrays(scope)
                agg = self._secure_mean(r, scope, stacked, ok, w, key, denominator)
            if agg is None:  # protocol failed or skipped: nobody in this scope counts
                agg = r.skip_scope(scope)
            r.aggregates.update({a: agg for a in scope})

    def _aggregate_mean(self, r, scope, key, denominator):
        """simulation='aggregate': what the server decodes, drawn in distribution. Every
        honest sender's noise share is N(0, s^2) per value, independent, so their sum is one
        N(0, senders x s^2) draw, added once to the sum of the senders' clipped updates (the
        streamed sum of `streaming.StreamingClippedSum`, or the stacked updates'); the quorum,
        the drop-outs after upload, the senders' count and bytes, and the released noise
        multiplier are those of 'sum'. Not simulated: the fixed-point rounding of each
        sender's vector (at most the reported `secagg_quantization_error_bound` per value of
        the mean) and the range check of the noise-free part, which a clipped update (|value|
        <= C) always passes (`pipeline.check_secagg_range` leaves room for C plus 6 standard
        deviations of a share). Clients that skip the client code are refused before the run
        (`config.attack` needs 'sum' or 'protocol')."""
        report = r.report
        ids = np.concatenate([r.cohorts[a].client_ids for a in scope])
        ok = np.concatenate([r.valid[a] for a in scope])
        rogue = np.concatenate([r.info[a]["skips_client_code"] for a in scope]).astype(bool)
        if (ok & rogue).any():
            raise ConfigError("config.secagg.simulation='aggregate' cannot simulate clients "
                             "that skip their client code (config.attack): use 'sum'")
        senders = int(ok.sum())
        if senders < self.min_senders:
            skip_scope(r, "secagg_skipped", f"{'+'.join(scope)}: {senders} sender(s), "
                  f"config.secagg.min_senders={self.min_senders}")
            return None
        rng = np.random.default_rng([int(jax.random.randint(key, (), 0, 2 ** 31 - 1)),
                                     r.round_index])
        dropped = int(np.sum(rng.random(senders) < self.dropout_after_upload))
        threshold = max(2, math.ceil(self.threshold_fraction * senders))
        length = tree_size(r.cohorts[scope[0]].template)[0] + 1  # + the weight
        r.wire_bytes.append(
            (senders, sa_protocol.bytes_per_sender(length, senders, self.encoding)))
        try:
            sa_protocol.check_quorum(senders, senders, senders - dropped, threshold)
        except sa_protocol.SecureAggregationError as e:
            report.setdefault("secagg_failures", []).append(str(e))
            r.reject(ids[ok], "secure aggregation failed")
            return None
        if r.streamed(scope):  # DP only: uniform weights, clipped updates
            total, weight = r.scope_sum(scope), float(senders)
        else:
            stacked, _, w = r.scope_arrays(scope)
            weights = jnp.asarray(ok, jnp.float32) * (1.0 if self.dp else w)
            total, weight = weighted_row_sum(stacked, weights), float(jnp.sum(weights))
        # The senders' shares, each of variance (sigma C)^2 / expected, summed.
        std = (self.noise_multiplier * self.clip_norm * math.sqrt(senders / max(denominator, 1.0))
               if self.dp else 0.0)
        divisor = denominator if self.dp else max(weight, 1e-12)
        self._report_sum(report, senders, senders, dropped, denominator, divisor)
        return self._released(total, key, jnp.float32(std), jnp.float32(divisor))

    def _report_sum(self, report: dict, senders: int, honest: int, dropped: int,
                    denominator: float, divisor: float) -> None:
        """What a finished sum adds to the round's report: the noise multiplier it released
        (with DP), its senders and drop-outs, and its rounding bound."""
        if self.dp:
            # Released (a failed unmasking releases nothing): every honest sender's noise is in
            # the sum, also of those lost before unmasking: total variance senders x std^2 =
            # (sigma C)^2 x senders / expected. A client that runs its own code adds none.
            realized = self.noise_multiplier * math.sqrt(honest / max(denominator, 1.0))
            report["dp_realized_noise_multiplier"] = min(
                report.get("dp_realized_noise_multiplier", math.inf), realized)
        report["secagg_senders"] = report.get("secagg_senders", 0) + senders
        report["secagg_dropped_after_upload"] = (report.get("secagg_dropped_after_upload", 0)
                                                 + dropped)
        # Each sender's values are rounded to the nearest multiple of 2^-fraction_bits: the
        # decoded mean is off by at most senders x 2^-(fraction_bits + 1) / divisor per value.
        error = senders * 2.0 ** -(self.encoding.fraction_bits + 1) / divisor
        report["secagg_quantization_error_bound"] = max(
            report.get("secagg_quantization_error_bound", 0.0), error)

    def _secure_mean(self, r, scope, stacked, ok, w, key, denominator):
        """simulation='sum' / 'protocol': the scope's valid clients' vectors summed by
        `secure_aggregation.secure_sum` (every party run under 'protocol'); the mean of the
        scope's updates (or None: too few senders, or the protocol failed)."""
        if ok.sum() < self.min_senders:
            # Too few senders: the "secure" sum would reveal (nearly) one client's update.
            skip_scope(r, "secagg_skipped", f"{'+'.join(scope)}: {int(ok.sum())} sender(s), "
                  f"config.secagg.min_senders={self.min_senders}")
            return None
        rng = np.random.default_rng([int(jax.random.randint(key, (), 0, 2 ** 31 - 1)),
                                     r.round_index])
        vectors, unchecked = self._sender_vectors(r, scope, stacked, ok, w, rng, denominator)
        if len(vectors) < self.min_senders:
            skip_scope(r, "secagg_skipped", f"{'+'.join(scope)}: {len(vectors)} sender(s) within "
                  f"range, config.secagg.min_senders={self.min_senders}")
            return None
        drop = frozenset(u for u in vectors if rng.random() < self.dropout_after_upload)
        threshold = max(2, math.ceil(self.threshold_fraction * len(vectors)))
        senders = len(vectors)  # clients that drop after uploading have sent their vector
        r.wire_bytes.append((senders, sa_protocol.bytes_per_sender(
            next(iter(vectors.values())).shape[0], senders, self.encoding)))
        try:
            result = sa_protocol.secure_sum(vectors, threshold, self.encoding,
                                            int(rng.integers(0, 2 ** 62)),
                                            drop_after_upload=drop,
                                            unchecked=frozenset(unchecked),
                                            simulation=self.simulation)
        except sa_protocol.SecureAggregationError as e:
            r.report.setdefault("secagg_failures", []).append(str(e))
            r.reject(np.array(sorted(vectors)), "secure aggregation failed")
            return None  # the round's update is lost; the server keeps its state
        total, weight = result.total[:-1], result.total[-1]
        divisor = denominator if self.dp else max(weight, 1e-12)
        self._report_sum(r.report, len(result.senders), senders - len(unchecked), len(drop),
                         denominator, divisor)
        return _unflatten_like(stacked, total / divisor)

    def _sender_vectors(self, r, scope, stacked, ok, w, rng, denominator):
        """({client id: the vector it masks}, ids of clients that skip their client code): each
        valid client's [weighted update, weight] (with DP: [clipped update, 1] plus its noise
        share), those outside the fixed-point range rejected before masking."""
        ids = np.concatenate([r.cohorts[a].client_ids for a in scope])
        flat = np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1)
                               for a in jax.tree.leaves(stacked)], axis=1)
        w = np.asarray(w, np.float64)
        noise_std = 0.0
        if self.dp:  # distributed noise: each client adds its share of the variance
            noise_std = self.noise_multiplier * self.clip_norm / math.sqrt(max(denominator, 1.0))
        bound = self.encoding.max_abs(int(ok.sum()))
        rogue = np.concatenate([r.info[a]["skips_client_code"] for a in scope]).astype(bool)
        # Weights are sent divided by a public scale the server broadcasts, the power of two
        # at or below the round's mean weight: the weighted mean is unchanged, a sample count of
        # thousands fits a 32-bit ring as well as a weight of 1 does, and integer counts stay
        # exact in fixed point (a division by 2^k only shifts bits).
        w = w / 2.0 ** math.floor(math.log2(max(float(w[ok].mean()), 2.0 ** -20)))
        # The honest ones add their noise shares (one draw for all of them: the same stream,
        # row after row, as one draw per client) and check their range before masking.
        rows = np.flatnonzero(ok)
        x = flat[rows] * (1.0 if self.dp else w[rows, None])
        honest = ~rogue[rows]
        if noise_std > 0 and honest.any():
            x[honest] += rng.normal(0.0, noise_std, (int(honest.sum()), x.shape[1]))
        x = np.concatenate([x, w[rows, None]], axis=1)
        worst = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(len(rows))
        vectors, unchecked = {}, set()
        for i, j in enumerate(rows):
            if rogue[j]:  # its own code: no noise share, no range check, masked as it is
                unchecked.add(int(ids[j]))
            elif worst[i] > bound:  # range check on the client, before masking
                r.reject(ids[j:j + 1],
                         f"|value| {float(worst[i]):.3g} beyond the secure-aggregation "
                         f"fixed-point range {bound:.3g} (checked before masking; "
                         "config.secagg.ring_bits / fraction_bits)")
                continue
            vectors[int(ids[j])] = x[i]
        return vectors, unchecked


def _unflatten_like(stacked, flat: np.ndarray):
    """`flat` (float64 [all values]) as one row of `stacked`'s tree, float32."""
    leaves, treedef = jax.tree.flatten(
        jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.float32), stacked))
    out, start = [], 0
    for leaf in leaves:
        out.append(jnp.asarray(flat[start:start + leaf.size].reshape(leaf.shape), jnp.float32))
        start += leaf.size
    return jax.tree.unflatten(treedef, out)
