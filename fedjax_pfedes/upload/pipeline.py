"""The upload pipeline of one round: validation -> compression -> clipping -> aggregation.

For each cohort the simulator hands over the stacked uploads, the upload template (the reference
the updates are measured from), the sample counts and which slots are real. The pipeline

1. checks each cohort's model fingerprint against the template's (a mismatch rejects the
   cohort's clients);
2. forms each client's update u_i = upload_i - template and, on the client side (vmapped),
   compresses it (top-k with error feedback kept per client, then bf16 or QSGD values) and, with
   DP, clips it to L2 <= C;
3. rejects non-finite updates and norm outliers (> `norm_outlier_factor` x the median norm of
   the uploads aggregated together; see `outlier_rule` for where it is off), logged with the
   client id and reason; the weights of the rest are used as they are, i.e. renormalized; under
   secure aggregation the checks run on the client, and values beyond the fixed-point range are
   rejected before masking;
4. aggregates: either leaves the (decoded) uploads to the algorithm's own weighted mean, or
   computes the aggregate itself — coordinate-wise median / trimmed mean, the DP-FedAvg noisy
   fixed-denominator mean, or the secure-aggregation sum — and hands every real slot
   template + aggregate, so the algorithm's weighted mean of those is exactly that aggregate.

The aggregate is taken per cohort for per-cohort methods (FedAvg family) and over all cohorts for
methods that share one tree (pFedES, LG-FedAvg, FML, FedKD, FedMRL); see `Algorithm.aggregation`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes import aggregation
from fedjax_pfedes.upload import compression, privacy, robust, validation
from fedjax_pfedes.upload import secure_aggregation as sa_protocol

# Default of config.upload.norm_outlier_factor: an update whose L2 norm exceeds 10x the median of
# the round's valid updates is rejected. Honest updates of one round differ in norm by a few x
# (sample counts, local epochs); a scaled or boosted poisoning update (Bhagoji et al., "Analyzing
# Federated Learning through an Adversarial Lens", ICML 2019) is orders of magnitude larger.
NORM_OUTLIER_FACTOR = 10.0


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything `config.upload`, `config.dp` and `config.secagg` set."""

    reject_nonfinite: bool = True
    norm_outlier_factor: float = NORM_OUTLIER_FACTOR  # 0 = off
    weighting: str = "samples"
    aggregator: str = "mean"
    trim_fraction: float = 0.1
    compression: compression.CompressionConfig = compression.CompressionConfig()
    dp: privacy.ClientDPConfig | None = None
    secagg: bool = False
    secagg_threshold_fraction: float = 0.6
    secagg_dropout_after_upload: float = 0.0
    secagg_min_senders: int = 3
    encoding: sa_protocol.RingEncoding = sa_protocol.RingEncoding()


def uniformly_random_selection(config) -> bool:
    """Whether every round's participants are a uniformly random draw from all clients (what
    privacy amplification by subsampling assumes): 'uniform' / 'poisson' sampling, every client
    always online, no drop-outs or deadlines (which decay failing clients' sampling weights), and
    nobody skipped below a minimum size."""
    t, s = config.train, config.system
    availability = [float(a) for a in str(s.availability).split(",") if a.strip()]
    reliable = (min(availability, default=1.0) >= 1.0 and s.availability_period == 0
                and s.dropout == 0 and s.deadline_s == 0)
    skips = t.min_samples > 0 and t.below_min == "skip"
    return t.sampling in ("uniform", "poisson") and reliable and not skips


def pipeline_config(config) -> PipelineConfig:
    """`PipelineConfig` from an experiment config's `upload`, `dp`, `secagg`, `train` and
    `system` fields (ValueError naming the field for a bad value)."""
    u, d, s = config.upload, config.dp, config.secagg
    dp = None
    if d.enabled:
        sampling = "poisson" if config.train.sampling == "poisson" else "fixed"
        if not uniformly_random_selection(config):
            sampling = "none"  # no amplification by subsampling is claimed
        dp = privacy.ClientDPConfig(
            clip_norm=d.clip_norm, noise_multiplier=d.noise_multiplier,
            target_epsilon=d.target_epsilon, delta=d.delta, accountant=d.accountant,
            sampling=sampling)
    return PipelineConfig(
        reject_nonfinite=u.reject_nonfinite, norm_outlier_factor=u.norm_outlier_factor,
        weighting=u.weighting, aggregator=u.aggregator, trim_fraction=u.trim_fraction,
        compression=compression.CompressionConfig(u.topk_fraction, u.value_encoding,
                                                  u.qsgd_levels),
        dp=dp, secagg=s.enabled, secagg_threshold_fraction=s.threshold_fraction,
        secagg_dropout_after_upload=s.dropout_after_upload, secagg_min_senders=s.min_senders,
        encoding=sa_protocol.RingEncoding(s.ring_bits, s.fraction_bits))


def check_compatible(cfg: PipelineConfig, aggregation: str, algorithm: str) -> None:
    """Raises ValueError naming the field for combinations that cannot be honest."""
    pre_aggregates = cfg.aggregator != "mean" or cfg.dp is not None or cfg.secagg
    if aggregation == "none" and (pre_aggregates or cfg.compression.active):
        raise ValueError(f"config.algorithm='{algorithm}' uploads nothing: config.upload "
                         "compression / aggregator, config.dp and config.secagg do not apply")
    if aggregation == "custom" and pre_aggregates:
        raise ValueError(
            f"config.algorithm='{algorithm}' combines uploads with its own server math "
            "(prototypes / header training), not a weighted mean: config.upload.aggregator "
            "must be 'mean' and config.dp.enabled / config.secagg.enabled must be False")
    if cfg.aggregator not in robust.AGGREGATORS:
        raise ValueError(f"config.upload.aggregator must be one of {robust.AGGREGATORS}, got "
                         f"'{cfg.aggregator}'")
    if cfg.weighting not in robust.WEIGHTINGS:
        raise ValueError(f"config.upload.weighting must be one of {robust.WEIGHTINGS}, got "
                         f"'{cfg.weighting}'")
    if cfg.secagg and cfg.aggregator != "mean":
        raise ValueError("config.secagg.enabled: the server sees only the sum, so "
                         "config.upload.aggregator must be 'mean'")
    if cfg.secagg and cfg.secagg_min_senders < 2:
        raise ValueError("config.secagg.min_senders must be >= 2 (with one sender the 'secure "
                         f"sum' is that client's update), got {cfg.secagg_min_senders}")
    if cfg.dp is not None and cfg.aggregator != "mean":
        raise ValueError("config.dp.enabled: DP-FedAvg's noisy sum needs "
                         "config.upload.aggregator='mean'")
    if cfg.dp is not None and cfg.weighting != "uniform":
        raise ValueError("config.dp.enabled needs config.upload.weighting='uniform' (every "
                         "clipped update counts once, so one client changes the sum by <= C)")
    if not 0 < cfg.secagg_threshold_fraction <= 1:
        raise ValueError("config.secagg.threshold_fraction must be in (0, 1], got "
                         f"{cfg.secagg_threshold_fraction}")
    if not 0 <= cfg.secagg_dropout_after_upload < 1:
        raise ValueError("config.secagg.dropout_after_upload must be in [0, 1), got "
                         f"{cfg.secagg_dropout_after_upload}")
    if not 0 <= cfg.trim_fraction < 0.5:
        raise ValueError(f"config.upload.trim_fraction must be in [0, 0.5), got "
                         f"{cfg.trim_fraction}")
    if cfg.norm_outlier_factor < 0:
        raise ValueError("config.upload.norm_outlier_factor must be >= 0 (0 = off), got "
                         f"{cfg.norm_outlier_factor}")


@dataclasses.dataclass
class CohortUploads:
    """One cohort's round: stacked uploads [slots, ...], the template, sample counts [slots],
    which slots are real [slots], their global client ids [slots] (-1 = padding), and the rows
    of the cohort's clients they occupy [slots]."""

    uploads: Any
    template: Any
    sizes: jax.Array
    valid: np.ndarray
    client_ids: np.ndarray
    slots: np.ndarray


def _mismatch(c: CohortUploads) -> str:
    """The rejection reason of a fingerprint mismatch, naming the first offending leaf."""
    try:
        aggregation.check_upload(c.template, c.uploads, "the cohort", stacked=len(c.valid))
    except aggregation.UploadMismatchError as e:
        return f"model fingerprint mismatch ({e})"
    return "model fingerprint mismatch"


def _replicate(tree, slots: int):
    """`tree` repeated on a new leading axis of `slots`."""
    return jax.tree.map(lambda t: jnp.broadcast_to(t, (slots, *jnp.shape(t))), tree)


def _where_rows(keep, on_true, on_false):
    """Per slot (leading axis): `on_true` where `keep`, else `on_false`."""
    return jax.tree.map(lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                        on_true, on_false)


def _take_rows(tree, rows):
    return jax.tree.map(lambda m: jnp.take(m, rows, axis=0, mode="clip"), tree)


def _put_rows(tree, rows, values):
    """Rows out of range (padding, skipped clients) are dropped."""
    return jax.tree.map(lambda m, r: m.at[rows].set(r, mode="drop"), tree, values)


def _sub(a, b):
    return jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)


class UploadPipeline:
    """Runs the stages for every round; holds the jitted pieces, the noise multiplier and the
    noise each round really released (`round_noise_multipliers`, for the accountant)."""

    def __init__(self, cfg: PipelineConfig, aggregation: str, algorithm: str, num_clients: int,
                 expected_participants: float, clients_per_round: int, rounds: int):
        check_compatible(cfg, aggregation, algorithm)
        self.cfg = cfg
        self.aggregation = aggregation
        self.num_clients = num_clients
        self.expected_participants = expected_participants
        self.clients_per_round = clients_per_round
        self.noise_multiplier = 0.0
        if cfg.dp is not None:
            self.noise_multiplier = privacy.resolve_noise_multiplier(
                cfg.dp, num_clients, clients_per_round, rounds)
        self.outlier_factor, self.outlier_note = outlier_rule(cfg)
        self._client_side = jax.jit(jax.vmap(self._one_client))
        self._robust = jax.jit(self._robust_aggregate)
        self._noisy_mean = jax.jit(self._dp_mean)
        self.rejections: list[tuple[int, int, str]] = []
        # Per round: the smallest noise multiplier any released aggregate carried (None: nothing
        # was released). Under secure aggregation the clients add the noise, so fewer senders
        # than expected release less of it; the accountant composes what really happened.
        self.round_noise_multipliers: list[float | None] = []

    @property
    def active(self) -> bool:
        """Whether accepted uploads are transformed (otherwise they reach the algorithm as they
        are, and only validation runs)."""
        c = self.cfg
        return (c.compression.active or c.dp is not None or c.secagg or c.aggregator != "mean"
                or c.weighting != "samples")

    # --- client side (one client, vmapped) ----------------------------------------------------
    def _one_client(self, delta, memory, key):
        finite = validation.finite_mask(jax.tree.map(lambda a: a[None], delta))[0]
        sent, memory = compression.compress(delta, memory, key, self.cfg.compression)
        norm = validation.update_norms(jax.tree.map(lambda a: a[None], sent))[0]
        if self.cfg.dp is not None:
            sent, _ = privacy.clip_update(sent, self.cfg.dp.clip_norm)
        return sent, memory, norm, finite

    def init_memory(self, template, num_members: int):
        """Error-feedback memory of a cohort: zeros [members, ...] (float32)."""
        return jax.tree.map(lambda a: jnp.zeros((num_members, *jnp.shape(a)), jnp.float32),
                            template)

    # --- server side --------------------------------------------------------------------------
    def _robust_aggregate(self, stacked, valid):
        if self.cfg.aggregator == "median":
            return robust.coordinate_median(stacked, valid)
        return robust.trimmed_mean(stacked, valid, self.cfg.trim_fraction)

    def _dp_mean(self, stacked, valid, key, denominator):
        total = jax.tree.map(
            lambda a: jnp.tensordot(valid.astype(jnp.float32), a, axes=1), stacked)
        std = self.noise_multiplier * self.cfg.dp.clip_norm
        noise = privacy.gaussian_noise_like(total, key, std)
        return jax.tree.map(lambda t, z: (t + z) / denominator, total, noise)

    def expected_in_scope(self, members: int) -> float:
        """Fixed denominator: the expected number of participants among `members` clients."""
        return self.expected_participants * members / self.num_clients

    def process(self, round_index: int, cohorts: dict[str, CohortUploads],
                memories: dict[str, Any], members: dict[str, int], key: jax.Array
                ) -> tuple[dict[str, tuple[Any, jax.Array]], dict[str, Any], dict[str, Any]]:
        """Returns ({arch: (uploads, weights)} for the server step, new memories, report)."""
        cfg = self.cfg
        report: dict[str, Any] = {"rejected": 0, "rejections": []}
        del self.round_noise_multipliers[round_index:]  # a resumed round is recounted
        self.round_noise_multipliers.extend([None] * (round_index + 1
                                                      - len(self.round_noise_multipliers)))
        if self.aggregation == "none":  # nothing is uploaded (Standalone)
            return ({a: (c.uploads, jnp.zeros(len(c.valid), jnp.float32))
                     for a, c in cohorts.items()}, memories, report)
        if not self.active:
            return self._validate_only(round_index, cohorts, report), memories, report
        sent, valid, norms, finite, weights, new_memories = {}, {}, {}, {}, {}, dict(memories)
        new_rows = {}
        for k, (arch, c) in enumerate(cohorts.items()):
            ok = np.asarray(c.valid).copy()
            if validation.fingerprint(c.uploads, leading_axes=1) != validation.fingerprint(
                    c.template):
                self._reject(round_index, c.client_ids[ok], _mismatch(c), report)
                ok[:] = False
                uploads = _replicate(c.template, len(ok))
            else:
                uploads = c.uploads
            deltas = _sub(uploads, jax.tree.map(lambda t: t[None], c.template))
            memory_rows = _take_rows(memories[arch], jnp.asarray(c.slots))
            keys = jax.random.split(jax.random.fold_in(key, k), len(ok))
            sent[arch], new_rows[arch], norms[arch], f = self._client_side(deltas, memory_rows,
                                                                           keys)
            finite[arch] = np.asarray(f)
            valid[arch] = ok
        if cfg.reject_nonfinite:
            self._reject_nonfinite(round_index, cohorts, valid, finite, report,
                                   "non-finite values (client-side check)" if cfg.secagg
                                   else "non-finite values")
        self._reject_outliers(round_index, cohorts, valid, norms, report)
        upload_bytes = []
        for arch, c in cohorts.items():
            ok = valid[arch]
            # Error feedback: only real participants with finite updates write their rows.
            rows = jnp.asarray(c.slots)
            write = jnp.where(jnp.asarray(np.asarray(c.valid) & finite[arch]), rows,
                              members[arch])
            new_memories[arch] = _put_rows(memories[arch], write, new_rows[arch])
            # Rejected slots send nothing: their values leave every sum (NaN x 0 is NaN).
            sent[arch] = _where_rows(jnp.asarray(ok), sent[arch],
                                     jax.tree.map(jnp.zeros_like, sent[arch]))
            weights[arch] = robust.smooth_weights(c.sizes, jnp.asarray(ok), cfg.weighting)
            if ok.any():
                upload_bytes.append((int(ok.sum()), compression.encoded_bytes(
                    c.template, cfg.compression) + (4 if cfg.dp is not None else 0)))

        aggregates = self._aggregate(round_index, cohorts, sent, valid, weights, members, key,
                                     report)
        if cfg.secagg and report.get("secagg_bytes"):  # the wire carries dense masked vectors
            upload_bytes = report.pop("secagg_bytes")
        groups = {}
        for arch, c in cohorts.items():
            if aggregates is None:  # the algorithm averages the decoded uploads itself
                uploads = jax.tree.map(lambda t, d: (t[None] + d).astype(t.dtype), c.template,
                                       sent[arch])
            else:
                uploads = _replicate(jax.tree.map(lambda t, d: (t + d).astype(t.dtype),
                                                  c.template, aggregates[arch]), len(c.valid))
            groups[arch] = (uploads, weights[arch])
        if upload_bytes:
            counts = np.array(upload_bytes, np.float64)
            report["upload_bytes_per_client"] = float(counts[:, 1] @ counts[:, 0]
                                                      / counts[:, 0].sum())
        if cfg.dp is not None:
            # The server adds sigma C itself; under secure aggregation the senders did.
            realized = (report.get("dp_realized_noise_multiplier") if cfg.secagg
                        else self.noise_multiplier)
            self.round_noise_multipliers[round_index] = realized
            if realized is not None:
                report["dp_realized_noise_multiplier"] = realized
        return groups, new_memories, report

    def _validate_only(self, round_index: int, cohorts: dict[str, CohortUploads],
                       report: dict) -> dict[str, tuple[Any, jax.Array]]:
        """Default settings: fingerprint, finiteness and norm-outlier checks on the uploads as
        they are (no arithmetic on accepted uploads, so results equal a run without the
        pipeline)."""
        uploads, valid, finite, norms = {}, {}, {}, {}
        for arch, c in cohorts.items():
            ok = np.asarray(c.valid).copy()
            uploads[arch] = c.uploads
            if validation.fingerprint(c.uploads, leading_axes=1) != validation.fingerprint(
                    c.template):
                self._reject(round_index, c.client_ids[ok], _mismatch(c), report)
                ok[:] = False
                uploads[arch] = _replicate(c.template, len(ok))
            finite[arch] = np.asarray(validation.finite_mask(uploads[arch]))
            if self.outlier_factor > 0:
                norms[arch] = validation.upload_norms(uploads[arch], c.template)
            valid[arch] = ok
        if self.cfg.reject_nonfinite:
            self._reject_nonfinite(round_index, cohorts, valid, finite, report,
                                   "non-finite values")
        self._reject_outliers(round_index, cohorts, valid, norms, report)
        groups = {}
        for arch, c in cohorts.items():
            ok = valid[arch]
            if (np.asarray(c.valid) & ~ok).any():  # NaN x weight 0 is still NaN: drop values
                uploads[arch] = _where_rows(jnp.asarray(ok), uploads[arch],
                                            _replicate(c.template, len(ok)))
            groups[arch] = (uploads[arch], robust.smooth_weights(c.sizes, jnp.asarray(ok),
                                                                 self.cfg.weighting))
        return groups

    def _reject_nonfinite(self, round_index: int, cohorts: dict[str, CohortUploads],
                          valid: dict, finite: dict, report: dict, reason: str) -> None:
        """Rejects valid slots with NaN/Inf values. When at least half of the round's uploads
        are non-finite, the reason says that the broadcast they trained from is the likelier
        culprit (a poisoned or diverged server model makes honest clients fail together)."""
        bad = {a: valid[a] & ~finite[a] for a in cohorts}
        n_bad = sum(int(b.sum()) for b in bad.values())
        n_all = sum(int(v.sum()) for v in valid.values())
        if n_bad >= 2 and 2 * n_bad >= n_all:
            reason += (f" ({n_bad} of {n_all} uploads this round: a poisoned or diverged "
                       "broadcast model is the likelier cause than these clients)")
        for arch, c in cohorts.items():
            self._reject(round_index, c.client_ids[bad[arch]], reason, report)
            valid[arch] &= ~bad[arch]

    def _reject_outliers(self, round_index: int, cohorts: dict[str, CohortUploads],
                         valid: dict, norms: dict, report: dict) -> None:
        """Rejects valid slots whose update norm exceeds `outlier_factor` x the median norm of
        the valid updates aggregated together (per cohort or over all cohorts)."""
        if self.outlier_factor <= 0:
            return
        for scope in self._scopes(cohorts):
            ok = np.concatenate([valid[a] for a in scope])
            scope_norms = jnp.concatenate([jnp.asarray(norms[a], jnp.float32) for a in scope])
            outlier = np.asarray(validation.norm_outliers(scope_norms, jnp.asarray(ok),
                                                          self.outlier_factor))
            start = 0
            for a in scope:
                n = len(valid[a])
                mine = outlier[start:start + n]
                start += n
                for j in np.flatnonzero(mine):
                    self._reject(round_index, cohorts[a].client_ids[j:j + 1],
                                 f"update norm {float(norms[a][j]):.3g} beyond "
                                 f"{self.outlier_factor:g} x the round's median "
                                 f"(config.upload.norm_outlier_factor)", report)
                valid[a] &= ~mine

    def _reject(self, round_index: int, ids: np.ndarray, reason: str, report: dict) -> None:
        for cid in np.asarray(ids).tolist():
            self.rejections.append((round_index + 1, int(cid), reason))
            report["rejections"].append({"client": int(cid), "reason": reason})
            report["rejected"] += 1

    def _scopes(self, cohorts: dict[str, CohortUploads]) -> list[list[str]]:
        if self.aggregation == "per_cohort":
            return [[a] for a in cohorts]
        return [list(cohorts)]

    def _aggregate(self, round_index, cohorts, sent, valid, weights, members, key, report):
        cfg = self.cfg
        if cfg.aggregator == "mean" and cfg.dp is None and not cfg.secagg:
            return None
        out = {}
        for s_idx, scope in enumerate(self._scopes(cohorts)):
            stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[sent[a] for a in scope])
            ok = np.concatenate([valid[a] for a in scope])
            w = jnp.concatenate([weights[a] for a in scope])
            scope_key = jax.random.fold_in(jax.random.fold_in(key, 1000 + s_idx), round_index)
            denominator = self.expected_in_scope(sum(members[a] for a in scope))
            if cfg.secagg:
                agg = self._secure_mean(round_index, scope, cohorts, stacked, ok, w, scope_key,
                                        denominator, report)
                if agg is None:  # protocol failed or skipped: nobody in this scope counts
                    for a in scope:
                        weights[a] = jnp.zeros_like(weights[a])
                    agg = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], jnp.float32), stacked)
            elif cfg.dp is not None:
                agg = self._noisy_mean(stacked, jnp.asarray(ok), scope_key,
                                       jnp.float32(denominator))
            elif ok.sum() < robust.MIN_ROBUST_UPLOADS:
                # A median / trimmed mean of 1-2 uploads is their mean: no protection. Skip.
                report.setdefault("robust_aggregation_skipped", []).append(
                    f"{'+'.join(scope)}: {int(ok.sum())} valid upload(s), config.upload."
                    f"aggregator='{cfg.aggregator}' needs >= {robust.MIN_ROBUST_UPLOADS}")
                for a in scope:
                    weights[a] = jnp.zeros_like(weights[a])
                agg = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], jnp.float32), stacked)
            else:
                agg = self._robust(stacked, jnp.asarray(ok))
            for a in scope:
                out[a] = agg
        return out

    def _secure_mean(self, round_index, scope, cohorts, stacked, ok, w, key, denominator,
                     report):
        cfg = self.cfg
        ids = np.concatenate([cohorts[a].client_ids for a in scope])
        flat_leaves = [np.asarray(a, np.float64).reshape(a.shape[0], -1)
                       for a in jax.tree.leaves(stacked)]
        flat = np.concatenate(flat_leaves, axis=1)
        w = np.asarray(w, np.float64)
        if ok.sum() < cfg.secagg_min_senders:
            # Too few senders: the "secure" sum would reveal (nearly) one client's update.
            report.setdefault("secagg_skipped", []).append(
                f"{'+'.join(scope)}: {int(ok.sum())} sender(s), config.secagg.min_senders="
                f"{cfg.secagg_min_senders}")
            return None
        noise_std = 0.0
        if cfg.dp is not None:  # distributed noise: each client adds its share of the variance
            noise_std = self.noise_multiplier * cfg.dp.clip_norm / math.sqrt(
                max(denominator, 1.0))
        rng = np.random.default_rng([int(jax.random.randint(key, (), 0, 2 ** 31 - 1)),
                                     round_index])
        bound = cfg.encoding.max_abs(int(ok.sum()))
        vectors = {}
        for j in np.flatnonzero(ok):
            x = flat[j] * (1.0 if cfg.dp is not None else w[j])
            if noise_std > 0:
                x = x + rng.normal(0.0, noise_std, x.shape)
            x = np.append(x, w[j])
            worst = float(np.max(np.abs(x)))
            if worst > bound:  # range check on the client, before masking
                self._reject(round_index, ids[j:j + 1],
                             f"|value| {worst:.3g} beyond the secure-aggregation fixed-point "
                             f"range {bound:.3g} (checked before masking; config.secagg."
                             "ring_bits / fraction_bits)", report)
                continue
            vectors[int(ids[j])] = x
        if len(vectors) < cfg.secagg_min_senders:
            report.setdefault("secagg_skipped", []).append(
                f"{'+'.join(scope)}: {len(vectors)} sender(s) within range, "
                f"config.secagg.min_senders={cfg.secagg_min_senders}")
            return None
        drop = frozenset(u for u in vectors if rng.random() < cfg.secagg_dropout_after_upload)
        threshold = max(2, math.ceil(cfg.secagg_threshold_fraction * len(vectors)))
        senders = len(vectors)  # clients that drop after uploading have sent their vector
        report.setdefault("secagg_bytes", []).append((senders, sa_protocol.bytes_per_sender(
            next(iter(vectors.values())).shape[0], senders, cfg.encoding)))
        if cfg.dp is not None:
            # Every sender's noise is in the sum (also of those lost before unmasking): total
            # variance senders x std^2 = (sigma C)^2 x senders / expected.
            realized = self.noise_multiplier * math.sqrt(senders / max(denominator, 1.0))
            report["dp_realized_noise_multiplier"] = min(
                report.get("dp_realized_noise_multiplier", math.inf), realized)
        try:
            result = sa_protocol.secure_sum(vectors, threshold, cfg.encoding,
                                            int(rng.integers(0, 2 ** 62)),
                                            drop_after_upload=drop)
        except sa_protocol.SecureAggregationError as e:
            report.setdefault("secagg_failures", []).append(str(e))
            self._reject(round_index, np.array(sorted(vectors)), "secure aggregation failed",
                         report)
            return None  # the round's update is lost; the server keeps its state
        report["secagg_senders"] = report.get("secagg_senders", 0) + len(result.senders)
        report["secagg_dropped_after_upload"] = (report.get("secagg_dropped_after_upload", 0)
                                                 + len(drop))
        total, weight = result.total[:-1], result.total[-1]
        divisor = denominator if cfg.dp is not None else max(weight, 1e-12)
        # Each sender's values are rounded to the nearest multiple of 2^-fraction_bits: the
        # decoded mean is off by at most senders x 2^-(fraction_bits + 1) / divisor per value.
        error = len(result.senders) * 2.0 ** -(cfg.encoding.fraction_bits + 1) / divisor
        report["secagg_quantization_error_bound"] = max(
            report.get("secagg_quantization_error_bound", 0.0), error)
        mean = total / divisor
        zero = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.float32), stacked)
        leaves, treedef = jax.tree.flatten(zero)
        out, start = [], 0
        for leaf in leaves:
            out.append(jnp.asarray(mean[start:start + leaf.size].reshape(leaf.shape),
                                   jnp.float32))
            start += leaf.size
        return jax.tree.unflatten(treedef, out)


def outlier_rule(cfg: PipelineConfig) -> tuple[float, str]:
    """(the norm-outlier factor in force, why) — the median rule is off where it cannot hold:
    under client-level DP (whether one client is counted would depend on the others' data, which
    voids the sensitivity bound; clipping to C bounds every client instead) and under secure
    aggregation (the server never sees an individual norm; a range check before masking applies
    instead)."""
    if cfg.norm_outlier_factor <= 0:
        return 0.0, "off (config.upload.norm_outlier_factor=0)"
    if cfg.dp is not None:
        return 0.0, ("off under config.dp.enabled: clipping to config.dp.clip_norm bounds every "
                     "update instead")
    if cfg.secagg:
        return 0.0, ("off under config.secagg.enabled: the server sees no individual norm; "
                     "values are range-checked before masking instead")
    return cfg.norm_outlier_factor, (f"updates with norm > {cfg.norm_outlier_factor:g} x the "
                                     "round's median are rejected")
