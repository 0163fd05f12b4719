"""The upload pipeline's settings (`PipelineConfig`: what `config.upload`, `config.dp` and
`config.secagg` set) and the rules they must satisfy before a round runs (`check_compatible`,
`check_secagg_range`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedjax_pfedes.config.defaults import UploadSection
from fedjax_pfedes.upload import compression, privacy, robust, stages
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
