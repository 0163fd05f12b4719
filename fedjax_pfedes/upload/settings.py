"""The upload pipeline's settings (`PipelineConfig`: the built `config.upload`, `config.dp` and
`config.secagg` sections with what a run resolves from them) and the rules across sections they
must satisfy before a round runs (`check_compatible`, `check_secagg_range`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_pfedes.config.defaults import SecAggSection, UploadSection
from fedjax_pfedes.config.fields import Section
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload import secure_aggregation as sa_protocol

# The norm rule's defaults, as `UploadSection` declares them (its fields' help says what they
# do; docs/threat_model.md gives the measurements behind each value). The factor: an update whose
# norm per sample exceeds it times the round's median (a boosted poisoning update, Bhagoji et al.,
# "Analyzing Federated Learning through an Adversarial Lens", ICML 2019, is orders of magnitude
# larger than honest ones, which differ by a few times). The z: where a round's honest norms
# spread over orders of magnitude (the published pFedES's small proxy on 2-class clients late in
# training) the factor alone rejects honest uploads; a robust z-score of the log-norm scales with
# that spread. The hard factor: beyond it an update is rejected whatever the spread (honest
# norms stayed below it in every run measured, but the published pFedES's and late FedAvg's,
# which the model-ratio test keeps).
NORM_OUTLIER_FACTOR = UploadSection.norm_outlier_factor
NORM_OUTLIER_Z = UploadSection.norm_outlier_z
NORM_OUTLIER_HARD_FACTOR = UploadSection.norm_outlier_hard_factor


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One run's upload settings: the built sections and what the run resolved from them.

    Attributes:
      upload: `config.upload` (checks, weights, aggregator, compression).
      dp: client-level DP as the run accounts it (`config.dp` with the sampling assumption the
        selection rule allows: `privacy.ClientDPConfig`), or None without it.
      secagg: `config.secagg` when secure aggregation is on, else None.
      norm_model_ratio: the norm rule's model ratio in force (`config.upload.
        norm_outlier_model_ratio`, the method's own where that is -1; 0 = not applied).
      norm_keys: the uploads' model part the norm rule measures (() = all; the method's).
      stage_sections: the registered stages' own sections (`UploadStage.section`), built.
    """

    upload: UploadSection = UploadSection()
    dp: privacy.ClientDPConfig | None = None
    secagg: SecAggSection | None = None
    norm_model_ratio: float = 0.0
    norm_keys: tuple[str, ...] = ()
    stage_sections: tuple[Section, ...] = ()

    @property
    def encoding(self) -> sa_protocol.RingEncoding:
        """The secure sum's fixed-point encoding (`config.secagg.ring_bits`, `fraction_bits`)."""
        s = self.secagg or SecAggSection()
        return sa_protocol.RingEncoding(s.ring_bits, s.fraction_bits)

    def section(self, cls: type[Section]) -> Section:
        """A stage's own section (`UploadStage.section`) at this run's values.

        Args:
          cls: the section's class.

        Returns:
          The built section (its defaults when the run was not given one).
        """
        for built in self.stage_sections:
            if type(built) is cls:
                return built
        return cls()


def check_compatible(cfg: PipelineConfig, aggregation: str, algorithm: str) -> None:
    """Raises ValueError naming the field for combinations of sections that cannot be honest
    (each field's own range is its section's: `config.upload_sections`)."""
    u = cfg.upload
    pre_aggregates = u.aggregator != "mean" or cfg.dp is not None or cfg.secagg is not None
    if aggregation == "none" and (pre_aggregates or u.compresses):
        raise ConfigError(f"config.algorithm='{algorithm}' uploads nothing: config.upload "
                         "compression / aggregator, config.dp and config.secagg do not apply")
    if aggregation == "custom" and pre_aggregates:
        raise ConfigError(
            f"config.algorithm='{algorithm}' combines uploads with its own server math "
            "(prototypes / header training), not a weighted mean: config.upload.aggregator "
            "must be 'mean' and config.dp.enabled / config.secagg.enabled must be False")
    if cfg.secagg is not None and u.aggregator != "mean":
        raise ConfigError("config.secagg.enabled: the server sees only the sum, so "
                         "config.upload.aggregator must be 'mean'")
    if cfg.dp is not None and u.aggregator != "mean":
        raise ConfigError("config.dp.enabled: DP-FedAvg's noisy sum needs "
                         "config.upload.aggregator='mean'")
    if cfg.dp is not None and u.weighting != "uniform":
        raise ConfigError("config.dp.enabled needs config.upload.weighting='uniform' (every "
                         "clipped update counts once, so one client changes the sum by <= C)")


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
    if cfg.secagg.min_senders > most:
        raise ConfigError(
            f"config.secagg.min_senders={cfg.secagg.min_senders} exceeds the {most} senders a "
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
        raise ConfigError(
            f"config.secagg.ring_bits={enc.ring_bits} with fraction_bits={enc.fraction_bits} "
            f"lets each of {senders} senders send |values| <= {enc.max_abs(senders):.3g}, below "
            f"the {need:.3g} a round needs: every upload would be rejected before masking; "
            f"{fix}")
