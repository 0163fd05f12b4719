"""The config read into the typed settings the lower layers take.

The upload pipeline (`upload/`), the client system (`engine.client_system`), the attacks, the
multi-process settings and the rounds (`RoundSettings`) each receive their own dataclass, built
here or by the section's own `*_config(section)` function, never the ConfigDict. What needs
several sections at once (client-level DP's sampling assumption reads `train` and `system`) is
decided here.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from fedjax_pfedes.upload import compression, privacy
from fedjax_pfedes.upload import secure_aggregation as sa_protocol
from fedjax_pfedes.upload.pipeline import PipelineConfig


def uniformly_random_selection(config: ml_collections.ConfigDict) -> bool:
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


def check_selection_is_data_independent(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field when client-level DP meets a selection rule that
    reads the clients' private data: then one client's data changes who ELSE takes part, and no
    per-client sensitivity bound (amplified or not) holds. Strata from sample counts, skipping
    clients below a minimum size, and deadlines whose misses (set by a client's local steps,
    i.e. its sample count) decay its sampling weight are such rules; coverage sampling is
    refused by the config checks for the same reason."""
    t, s = config.train, config.system
    if t.sampling == "stratified" and t.strata > 1:
        raise ValueError(
            f"config.train.strata={t.strata} buckets clients by sample count, which client-level "
            "DP treats as private (one client's size would change who else is selected); with "
            "config.dp.enabled set config.train.strata=1 (strata from the public availability "
            "classes only) or use config.train.sampling='uniform' / 'poisson'")
    if t.min_samples > 0 and t.below_min == "skip":
        raise ValueError(
            f"config.train.min_samples={t.min_samples} with below_min='skip' selects clients by "
            "their private sample count; with config.dp.enabled set config.train.min_samples=0 "
            "or config.train.below_min='one_epoch'")
    if float(s.deadline_s) > 0 and float(s.failure_decay) < 1:
        raise ValueError(
            f"config.system.deadline_s={s.deadline_s} with failure_decay={s.failure_decay}: a "
            "client misses the deadline by its local steps (its private sample count), and the "
            "decayed weight then changes who else is selected; with config.dp.enabled set "
            "config.system.failure_decay=1.0 or config.system.deadline_s=0")


def pipeline_config(config: ml_collections.ConfigDict) -> PipelineConfig:
    """`PipelineConfig` from an experiment config's `upload`, `dp` and `secagg` sections, with
    the DP accountant's sampling assumption read from `train` and `system`.

    Args:
      config: the experiment config.

    Returns:
      The pipeline's settings. ValueError naming the field for a selection rule client-level
      DP cannot account for.
    """
    u, d, s = config.upload, config.dp, config.secagg
    dp = None
    if d.enabled:
        check_selection_is_data_independent(config)
        sampling = "poisson" if config.train.sampling == "poisson" else "fixed"
        if not uniformly_random_selection(config):
            sampling = "none"  # no amplification by subsampling is claimed
        dp = privacy.ClientDPConfig(
            clip_norm=d.clip_norm, noise_multiplier=d.noise_multiplier,
            target_epsilon=d.target_epsilon, delta=d.delta, accountant=d.accountant,
            sampling=sampling,
            sampling_rate=float(config.train.client_fraction) if sampling == "poisson" else 0.0)
    return PipelineConfig(
        reject_nonfinite=u.reject_nonfinite, norm_outlier_factor=u.norm_outlier_factor,
        weighting=u.weighting, aggregator=u.aggregator, trim_fraction=u.trim_fraction,
        compression=compression.CompressionConfig(u.topk_fraction, u.value_encoding,
                                                  u.qsgd_levels),
        dp=dp, secagg=s.enabled, secagg_threshold_fraction=s.threshold_fraction,
        secagg_dropout_after_upload=s.dropout_after_upload,
        secagg_min_senders=s.min_senders, secagg_simulation=s.simulation,
        encoding=sa_protocol.RingEncoding(s.ring_bits, s.fraction_bits))


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """Buffered asynchronous rounds (FedBuff; `config.asynchronous`)."""

    concurrency: int          # clients training at any time
    buffer_size: int          # updates per server step (K)
    staleness: str            # 'constant' | 'polynomial' | 'hinge'
    staleness_exponent: float
    hinge_a: float
    hinge_b: float


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """What a run's rounds read of the config (`engine.rounds`, `engine.asynchronous`)."""

    seed: int
    rounds: int
    client_fraction: float
    sampling: str                   # 'uniform' | 'poisson' | 'stratified' | 'coverage'
    coverage_candidates: int
    monitor_aggregation_loss: bool  # participants' losses before / after the server step
    evaluate_after_training: bool   # each participant right after training
    scan_held_uploads: int          # uploads a streamed 'scan' round may hold for the norm rule
    asynchronous: AsyncSettings | None = None  # None: synchronous rounds


def round_settings(config: ml_collections.ConfigDict) -> RoundSettings:
    """`RoundSettings` from an experiment config's `seed`, `train`, `monitor`, `eval`,
    `execution` and `asynchronous` sections.

    Args:
      config: the experiment config (validated).

    Returns:
      The rounds' settings.
    """
    t, a = config.train, config.asynchronous
    return RoundSettings(
        seed=int(config.seed), rounds=int(t.rounds), client_fraction=float(t.client_fraction),
        sampling=str(t.sampling), coverage_candidates=int(t.coverage_candidates),
        monitor_aggregation_loss=bool(config.monitor.aggregation_loss),
        evaluate_after_training=bool(config.eval.after_training),
        scan_held_uploads=int(config.execution.scan_held_uploads),
        asynchronous=(AsyncSettings(int(a.concurrency), int(a.buffer_size), str(a.staleness),
                                    float(a.staleness_exponent), float(a.hinge_a),
                                    float(a.hinge_b))
                      if a.enabled else None))
