"""The upload pipeline of one round: validation -> compression -> clipping -> aggregation.

For each cohort the simulator hands over the stacked uploads, the upload template (the reference
the updates are measured from), the sample counts and which slots are real. The pipeline

1. checks each cohort's model fingerprint against the template's (a mismatch rejects the
   cohort's clients);
2. forms each client's update u_i = upload_i - template and, on the client side (vmapped),
   compresses it (top-k with error feedback kept per client, then bf16 or QSGD values) and, with
   DP, clips it to L2 <= C;
3. rejects non-finite updates and norm outliers (norm per local sample > `norm_outlier_factor`
   x the median of the uploads aggregated together; see `stages.outlier_rule` for where it is off),
   logged with the client id and reason; the weights of the rest are used as they are, i.e.
   renormalized; under secure aggregation the checks run on the client, and values beyond the
   fixed-point range are rejected before masking (a malicious client skips all client halves:
   `UploadStage.server_enforced`);
4. aggregates: either leaves the (decoded) uploads to the algorithm's own weighted mean, or
   computes the aggregate itself — coordinate-wise median / trimmed mean, the DP-FedAvg noisy
   fixed-denominator mean, or the secure-aggregation sum — and hands every real slot
   template + aggregate, so the algorithm's weighted mean of those is exactly that aggregate.

The aggregate is taken per cohort for per-cohort methods (FedAvg family) and over all cohorts for
methods that share one tree (pFedES, LG-FedAvg, FML, FedKD, FedMRL); see `Algorithm.aggregation`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_pfedes import aggregation
from fedjax_pfedes.config.defaults import UploadSection
from fedjax_pfedes.tree_util import put_rows, take_rows
from fedjax_pfedes.upload import compression, privacy, robust, stages, streaming, validation
from fedjax_pfedes.upload import secure_aggregation as sa_protocol

# Default of config.upload.norm_outlier_factor (declared in `config.defaults`): an update whose L2
# norm exceeds 10x the median of the round's valid updates is rejected. Honest updates of one round
# differ in norm by a few x (sample counts, local epochs); a scaled or boosted poisoning update
# (Bhagoji et al., "Analyzing Federated Learning through an Adversarial Lens", ICML 2019) is orders
# of magnitude larger.
NORM_OUTLIER_FACTOR = UploadSection.norm_outlier_factor
# Default of config.upload.norm_outlier_z (declared in `config.defaults`): an update beyond the
# factor is rejected only when its log-norm is also this many robust standard deviations above the
# round's median log-norm. Where honest norms of a round spread over orders of magnitude (the
# published pFedES's small proxy on 2-class clients late in training: 0.002 to 2.5 in one round) a
# 10x-median rule rejected ~4 % of honest uploads; a robust z-score scales with that spread, while a
# boosted update among like-sized honest ones stays dozens of deviations off (docs/threat_model.md).
NORM_OUTLIER_Z = UploadSection.norm_outlier_z
# Default of config.upload.norm_outlier_hard_factor (declared in `config.defaults`): beyond this
# many times the round's median an update is rejected whatever the spread (a round spread over
# three orders of magnitude puts even a 1e4-per-value update only ~5 robust deviations off, and
# FedMRL's x100 updates among its widely spread honest ones 3-5). Honest norms stayed within 44x
# the median in every 20-300-round run measured, but the published pFedES's and late FedAvg's,
# which the model-ratio test keeps (docs/threat_model.md).
NORM_OUTLIER_HARD_FACTOR = UploadSection.norm_outlier_hard_factor
# config.upload.norm_outlier_model_ratio's value that lets the method choose
# (`AlgorithmEntry.norm_model_ratio`); the pipeline receives the resolved value (0 = all judged).
NORM_OUTLIER_MODEL_RATIO = 0.0


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything `config.upload`, `config.dp` and `config.secagg` set."""

    reject_nonfinite: bool = True
    norm_outlier_factor: float = NORM_OUTLIER_FACTOR  # 0 = off
    norm_outlier_z: float = NORM_OUTLIER_Z  # 0 = the factor alone
    norm_outlier_hard_factor: float = NORM_OUTLIER_HARD_FACTOR  # 0 = no bound beyond the z
    norm_outlier_small_cohorts: bool = True  # a cohort of < 3 judged against the whole round
    norm_outlier_model_ratio: float = NORM_OUTLIER_MODEL_RATIO  # 0 = not applied
    norm_keys: tuple[str, ...] = ()  # the uploads' model part the norm rule measures (() = all)
    weighting: str = "samples"
    aggregator: str = "mean"
    trim_fraction: float = 0.1
    compression: compression.CompressionConfig = compression.CompressionConfig()
    dp: privacy.ClientDPConfig | None = None
    secagg: bool = False
    secagg_threshold_fraction: float = 0.6
    secagg_dropout_after_upload: float = 0.0
    secagg_min_senders: int = 3
    # 'sum' | 'protocol' (`secure_aggregation.secure_sum`) | 'aggregate' (see SecureAggregation)
    secagg_simulation: str = "sum"
    encoding: sa_protocol.RingEncoding = sa_protocol.RingEncoding()
    # The registered stages' own config fields (`UploadStage.fields`) at this run's values, as
    # (dotted path, value) pairs; a stage reads its own with `field(path)`.
    stage_fields: tuple[tuple[str, Any], ...] = ()

    def field(self, path: str) -> Any:
        """The value of a stage's own config field (`UploadStage.fields`).

        Args:
          path: the field's dotted path, e.g. 'my_stage.amount'.

        Returns:
          Its value in this run (KeyError naming it when no registered stage declares it).
        """
        for key, value in self.stage_fields:
            if key == path:
                return value
        raise KeyError(f"config.{path}: no registered upload stage declares this field")


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
    if cfg.secagg_simulation not in sa_protocol.SIMULATIONS:
        raise ValueError(f"config.secagg.simulation must be one of {sa_protocol.SIMULATIONS}, "
                         f"got '{cfg.secagg_simulation}'")
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
    if not (cfg.norm_outlier_hard_factor == 0
            or cfg.norm_outlier_hard_factor >= cfg.norm_outlier_factor):
        raise ValueError("config.upload.norm_outlier_hard_factor must be 0 (none) or >= "
                         f"config.upload.norm_outlier_factor ({cfg.norm_outlier_factor:g}), "
                         f"got {cfg.norm_outlier_hard_factor}")
    if not cfg.norm_outlier_model_ratio >= 0:
        raise ValueError("config.upload.norm_outlier_model_ratio must be >= 0 (0 = not "
                         f"applied) or -1 (the method's), got {cfg.norm_outlier_model_ratio}")
    if not cfg.norm_outlier_z >= 0:
        raise ValueError("config.upload.norm_outlier_z must be >= 0 (0 = the factor alone), "
                         f"got {cfg.norm_outlier_z}")
    for cls in stages.STAGES:  # each stage's own fields
        cls.check(cfg)


@dataclasses.dataclass
class CohortUploads:
    """One cohort's round: stacked uploads [slots, ...], the template, sample counts [slots],
    which slots are real [slots], their global client ids [slots] (-1 = padding), the rows
    of the cohort's clients they occupy [slots], which slots run their own code instead of
    the client halves of the chain [slots] (malicious clients; None = none), and every sample
    each client holds, training and local test [slots] (None = the training counts); `facts`
    the client halves' per-client facts [slots] already computed with the uploads
    (`UploadPipeline.client_facts` inside the cohort's program; None = computed here), used
    only by a pipeline that transforms nothing; `reduced` the carry of a streamed cohort
    (`upload.streaming`: its uploads were summed as they were made, `uploads` is None)."""

    uploads: Any
    template: Any
    sizes: jax.Array
    valid: np.ndarray
    client_ids: np.ndarray
    slots: np.ndarray
    skips_client_code: np.ndarray | None = None
    all_sizes: jax.Array | None = None
    facts: dict[str, np.ndarray] | None = None
    reduced: dict | None = None


def _mismatch(c: CohortUploads) -> str:
    """The rejection reason of a fingerprint mismatch, naming the first offending leaf."""
    try:
        aggregation.check_upload(c.template, c.uploads, "the cohort", stacked=len(c.valid))
    except aggregation.UploadMismatchError as e:
        return f"model fingerprint mismatch ({e})"
    return "model fingerprint mismatch"


@functools.partial(jax.jit, static_argnums=1)
def _replicate(tree, slots: int):
    """`tree` repeated on a new leading axis of `slots`."""
    return jax.tree.map(lambda t: jnp.broadcast_to(t, (slots, *jnp.shape(t))), tree)


@jax.jit
def _select_rows(pick, a, b):
    """Per slot (leading axis): the row of `a` where `pick`, else the row of `b`."""
    return jax.tree.map(lambda x, y: jnp.where(pick.reshape((-1,) + (1,) * (x.ndim - 1)), x, y),
                        a, b)


@jax.jit
def _rows_or_template(keep, uploads, template):
    """Per slot (leading axis): the upload where `keep` (bit for bit), else `template`. It reads
    and writes every stacked upload (with 1,000 participants a pass over hundreds of MB), so
    it runs in rounds that reject someone, plus once per cohort shape so that it compiles then
    and a first rejection later compiles nothing (`UploadPipeline.process`)."""
    return jax.tree.map(lambda u, t: jnp.where(keep.reshape((-1,) + (1,) * t.ndim), u, t[None]),
                        uploads, template)


@functools.partial(jax.jit, static_argnums=2)
def _client_keys(key: jax.Array, cohort_index: int, slots: int) -> jax.Array:
    """[slots] keys of a cohort's upload stages: split(fold_in(key, cohort_index), slots)."""
    return jax.random.split(jax.random.fold_in(key, cohort_index), slots)


def _sub(a, b):
    return jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)


def build_stages(cfg: PipelineConfig, noise_multiplier: float) -> list[stages.UploadStage]:
    """The ordered stage list of `cfg`: every registered stage (`stages.STAGES`, in `position`
    order) that `cfg` asks for — checks and client-side transforms in the order a client applies
    them (finite check on the raw update, compression, norm measured on what is sent, DP
    clipping), then the server's weighting and aggregation."""
    chain = [cls.from_config(cfg, noise_multiplier) for cls in stages.STAGES]
    return [stage for stage in chain if stage is not None]


class UploadPipeline:
    """Runs the stage chain (`build_stages`) every round; holds the jitted client side and the
    noise multiplier. What each round really released is in its report
    (`dp_round_noise_multiplier`); the run keeps that history in its `SimState`."""

    def __init__(self, cfg: PipelineConfig, aggregation: str, algorithm: str, num_clients: int,
                 expected_participants: float, clients_per_round: int, rounds: int,
                 stages_override: list[stages.UploadStage] | None = None):
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
        if cfg.secagg:
            check_secagg_range(cfg, self.noise_multiplier, clients_per_round, expected_participants,
                               num_clients)
        self.outlier_note = stages.outlier_rule(cfg)[1]
        self.stages = (build_stages(cfg, self.noise_multiplier) if stages_override is None
                       else list(stages_override))
        self._client_side = jax.jit(jax.vmap(self._one_client, in_axes=(0, None, 0, 0)))
        # One client at a time (`lax.map`): its upload is reduced while in cache (the vmapped
        # form reduces the whole stack at once, slower on XLA:CPU: docs/performance.md).
        self._client_facts = jax.jit(lambda uploads, template, memory, keys: jax.lax.map(
            lambda xs: self._one_client(xs[0], template, xs[1], xs[2])[1:],
            (uploads, memory, keys)))
        self._rogue_side = jax.jit(jax.vmap(self._one_rogue_client, in_axes=(0, None, 0)))
        self._compiled_shapes: set[tuple[str, int]] = set()  # (arch, slots) seen by process

    @property
    def active(self) -> bool:
        """Whether accepted uploads are transformed (otherwise they reach the algorithm exactly
        as they arrived, and only the checks and the weights act)."""
        return any(stage.transforms for stage in self.stages)

    def _one_client(self, upload, template, memory, key):
        """The client halves of the chain, for one client (vmapped and jitted once) on its
        update upload - template (float32); `memory` is {stage name: this client's row of the
        stage's state}."""
        delta = _sub(upload, template)
        info: dict[str, jax.Array] = {}
        memory = dict(memory)
        for stage in self.stages:
            delta, own, info = stage.client(delta, memory.get(stage.name), key, info)
            if stage.name in memory:
                memory[stage.name] = own
        return delta, memory, info

    @property
    def keyless_client_side(self) -> bool:
        """Whether no stage's client half keeps a per-client state or draws a key (only
        compression does), so a client's facts can be computed from its upload alone."""
        return not any(s.client_keyed for s in self.stages)

    @property
    def streamed_clip_norm(self) -> float | None:
        """C, when a streamed round may sum the clipped updates instead of stacking them
        (`streaming.StreamingClippedSum`): client-level DP whose client half is the finite
        check, the norm and the clip only (no compression), the norm over the whole update,
        and an aggregator that adds its noise to that sum (central DP-FedAvg, or secure
        aggregation simulated as 'aggregate'); else None."""
        cfg = self.cfg
        if (cfg.dp is None or not self.keyless_client_side or cfg.norm_keys
                or (cfg.secagg and cfg.secagg_simulation != "aggregate")):
            return None
        return cfg.dp.clip_norm

    def client_facts(self, upload, template) -> dict[str, jax.Array]:
        """One client's facts for the server-side checks ('finite', 'norm', ...), when no
        client half keeps a state or draws a key (`keyless_client_side`): the same values
        `process` computes from the stacked uploads, for a cohort's program to compute while
        the client's upload is in cache (`CohortUploads.facts`)."""
        if not self.keyless_client_side:
            raise ValueError("UploadPipeline.client_facts: the pipeline's client halves keep "
                             "states or draw keys (compression); process computes them")
        return self._one_client(upload, template, {}, None)[2]

    def _one_rogue_client(self, upload, template, key):
        """What the server receives from a client that runs its own code: its raw update, with
        only the stages the server enforces on what it sees applied (`server_enforced`)."""
        delta = _sub(upload, template)
        info: dict[str, jax.Array] = {}
        for stage in self.stages:
            if stage.server_enforced(self.cfg.secagg):
                delta, _, info = stage.client(delta, None, key, info)
            else:
                delta, info = stage.skipped(delta, info)
        return delta, info

    def init_memory(self, template, num_members: int) -> dict[str, Any]:
        """A cohort's per-client stage states: {stage name: state stacked over the members}
        for the stages that keep one (an empty dict when none does)."""
        states = {s.name: s.init_state(template, num_members) for s in self.stages}
        return {name: state for name, state in states.items() if state is not None}

    def expected_in_scope(self, members: int) -> float:
        """Fixed denominator: the expected number of participants among `members` clients."""
        return self.expected_participants * members / self.num_clients

    def process(self, round_index: int, cohorts: dict[str, CohortUploads],
                memories: dict[str, Any], members: dict[str, int], key: jax.Array
                ) -> tuple[dict[str, tuple[Any, jax.Array]], dict[str, Any], dict[str, Any]]:
        """Returns ({arch: (uploads, weights)} for the server step, new memories, report).

        Under client-level DP the report's `dp_round_noise_multiplier` is the smallest noise
        multiplier any aggregate released this round carried (None: nothing was released).
        Under secure aggregation the clients add the noise, so fewer senders than expected
        release less of it; the accountant composes what really happened."""
        cfg = self.cfg
        report: dict[str, Any] = {"rejected": 0, "rejections": []}
        if self.aggregation == "none":  # nothing is uploaded (Standalone)
            return ({a: (c.uploads, jnp.zeros(len(c.valid), jnp.float32))
                     for a, c in cohorts.items()}, memories, report)
        r = stages.RoundUploads(
            round_index=round_index, cohorts=cohorts, scopes=self._scopes(cohorts),
            members=members, key=key, valid={}, sent={}, info={}, report=report,
            reject=lambda ids, reason: self._reject(round_index, ids, reason, report),
            expected_in_scope=self.expected_in_scope)
        arrived, new_rows = {}, {}
        for k, (arch, c) in enumerate(cohorts.items()):
            ok = np.asarray(c.valid).copy()
            if c.reduced is not None:  # streamed: only the facts, the stages decide on them
                r.sent[arch], r.valid[arch] = None, ok
                r.info[arch] = {**c.facts, "skips_client_code": np.zeros(len(ok), bool)}
                continue
            uploads = c.uploads
            mismatch = validation.fingerprint(uploads, leading_axes=1) != validation.fingerprint(
                c.template)
            if mismatch:
                self._reject(round_index, c.client_ids[ok], _mismatch(c), report)
                ok[:] = False
                uploads = _replicate(c.template, len(ok))
            arrived[arch] = uploads
            memory_rows = take_rows(memories[arch], jnp.asarray(c.slots))
            keys = _client_keys(key, k, len(ok))
            if self.active:
                r.sent[arch], new_rows[arch], info = self._client_side(uploads, c.template,
                                                                       memory_rows, keys)
            elif c.facts is not None and not mismatch:
                # nothing is transformed and the cohort's program computed the facts
                r.sent[arch], info = None, c.facts
            else:  # nothing is transformed: only the checks' facts, no stacked deltas
                r.sent[arch] = None
                new_rows[arch], info = self._client_facts(uploads, c.template, memory_rows,
                                                          keys)
            r.info[arch] = dict(jax.device_get(info))  # one transfer for the cohort
            rogue = ok & (c.skips_client_code if c.skips_client_code is not None else False)
            if rogue.any():
                raw, rogue_info = self._rogue_side(uploads, c.template, keys)
                if self.active:
                    r.sent[arch] = _select_rows(jnp.asarray(rogue), raw, r.sent[arch])
                for name, v in rogue_info.items():
                    r.info[arch][name] = np.where(rogue, np.asarray(v), r.info[arch][name])
            r.info[arch]["skips_client_code"] = rogue
            r.valid[arch] = ok
        for stage in self.stages:  # checks, weights, aggregation: in chain order
            stage.server(r)
        if not self.active:  # the uploads as they arrived; rejected slots hold the template
            groups = {}
            for arch, c in cohorts.items():
                rejected = np.asarray(c.valid) & ~r.valid[arch]
                if c.reduced is not None:  # the held-aside uploads the stages rejected
                    entered = np.asarray(c.valid) & (np.asarray(r.info[arch]["finite"])
                                                     | (not cfg.reject_nonfinite))
                    groups[arch] = streaming.finalize(c.reduced, r.valid[arch],
                                                      rejected & entered, arch, round_index)
                    continue
                # rejected slots hold the template: NaN x 0 weight is still NaN
                shape = (arch, len(rejected))
                if rejected.any() or shape not in self._compiled_shapes:
                    self._compiled_shapes.add(shape)
                    uploads = _rows_or_template(jnp.asarray(~rejected), arrived[arch],
                                                c.template)
                else:
                    uploads = arrived[arch]
                groups[arch] = (uploads, r.weights[arch])
            return groups, memories, report
        new_memories = dict(memories)
        for arch, c in cohorts.items():
            if arch not in new_rows:  # streamed: its client halves keep no state
                continue
            # Error feedback: only real participants with finite updates write their rows.
            rows = jnp.asarray(c.slots)
            write = jnp.where(jnp.asarray(np.asarray(c.valid) & r.info[arch]["finite"]), rows,
                              members[arch])
            new_memories[arch] = put_rows(memories[arch], write, new_rows[arch])
        upload_bytes = [(int(r.valid[a].sum()), compression.encoded_bytes(
            c.template, cfg.compression) + (4 if cfg.dp is not None else 0))
            for a, c in cohorts.items() if r.valid[a].any()]
        if cfg.secagg and report.get("secagg_bytes"):  # the wire carries dense masked vectors
            upload_bytes = report.pop("secagg_bytes")
        groups = {}
        for arch, c in cohorts.items():
            if c.reduced is not None:
                # Streamed (its server step is a weighted mean): one row, the aggregate, with
                # the group's total weight, instead of a copy of it for every slot.
                groups[arch] = (jax.tree.map(lambda t, d: (t + d).astype(t.dtype)[None],
                                             c.template, r.aggregates[arch]),
                                jnp.sum(r.weights[arch])[None])
                continue
            if r.aggregates is None:  # the algorithm averages the decoded uploads itself
                uploads = jax.tree.map(lambda t, d: (t[None] + d).astype(t.dtype), c.template,
                                       r.sent[arch])
            else:
                uploads = _replicate(jax.tree.map(lambda t, d: (t + d).astype(t.dtype),
                                                  c.template, r.aggregates[arch]),
                                     len(c.valid))
            groups[arch] = (uploads, r.weights[arch])
        if upload_bytes:
            counts = np.array(upload_bytes, np.float64)
            report["upload_bytes_per_client"] = float(counts[:, 1] @ counts[:, 0]
                                                      / counts[:, 0].sum())
        if cfg.dp is not None:
            # The server adds sigma C itself; under secure aggregation the senders did.
            realized = (report.get("dp_realized_noise_multiplier") if cfg.secagg
                        else self.noise_multiplier)
            report["dp_round_noise_multiplier"] = realized
            if realized is not None:
                report["dp_realized_noise_multiplier"] = realized
                if realized < self.noise_multiplier:
                    logging.warning("round %d: the secure sum carries noise multiplier %.3f, "
                                    "below the configured %.3f (fewer senders than expected); "
                                    "accounted as it is", round_index + 1, realized,
                                    self.noise_multiplier)
        return groups, new_memories, report

    @property
    def report_keys(self) -> tuple[str, ...]:
        """The round report's entries the stages declare for the monitoring record."""
        return tuple(dict.fromkeys(k for s in self.stages for k in s.report_keys))

    def _reject(self, round_index: int, ids: np.ndarray, reason: str, report: dict) -> None:
        for cid in np.asarray(ids).tolist():
            report["rejections"].append({"client": int(cid), "reason": reason})
            report["rejected"] += 1

    def _scopes(self, cohorts: dict[str, CohortUploads]) -> list[list[str]]:
        if self.aggregation == "per_cohort":
            return [[a] for a in cohorts]
        return [list(cohorts)]


# What the fixed-point range must hold per sender at the least: weights are sent divided by the
# power of two at or below the round's mean weight (`stages.SecureAggregation`), so a client of
# 4x the mean weight, or an update value of 4 at twice the mean weight, still fits.
SECAGG_HEADROOM = 8.0


def check_secagg_range(cfg: PipelineConfig, noise_multiplier: float, clients_per_round: int,
                       expected_participants: float, num_clients: int) -> None:
    """Raises ValueError naming the field when `config.secagg.ring_bits` / `fraction_bits`
    leave too little range for a round's senders to send anything (every upload would be
    rejected before masking), with the largest `fraction_bits` that works; and when
    `config.secagg.min_senders` exceeds the most senders a round can have."""
    poisson = cfg.dp is not None and cfg.dp.sampling == "poisson"
    most = num_clients if poisson else clients_per_round
    if cfg.secagg_min_senders > most:
        raise ValueError(
            f"config.secagg.min_senders={cfg.secagg_min_senders} exceeds the {most} senders a "
            f"round can have ({'clients' if poisson else 'participants per round'}): no round "
            "would ever be summed")
    need = SECAGG_HEADROOM
    if cfg.dp is not None:  # a clipped value plus 6 std of the sender's noise share
        share = noise_multiplier * cfg.dp.clip_norm / np.sqrt(max(expected_participants, 1.0))
        need = max(need, cfg.dp.clip_norm + 6 * share)
    enc = cfg.encoding
    senders = max(1, int(np.ceil(expected_participants if poisson else clients_per_round)))
    if enc.max_abs(senders) < need:
        best = enc.largest_fraction_bits(senders, need)
        fix = (f"the largest that works is fraction_bits={best}" if best > 0 else
               "no fraction_bits works at this ring size; use ring_bits=64")
        raise ValueError(
            f"config.secagg.ring_bits={enc.ring_bits} with fraction_bits={enc.fraction_bits} "
            f"lets each of {senders} senders send |values| <= {enc.max_abs(senders):.3g}, below "
            f"the {need:.3g} a round needs: every upload would be rejected before masking; "
            f"{fix}")

