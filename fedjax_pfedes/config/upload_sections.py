"""`config.upload`, `config.dp`, `config.dp_sgd`, `config.secagg`, `config.attack`: what a
client sends and what the server does with it (docs/guide/upload_pipeline.md)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fedjax_pfedes.config.fields import Range, Section, above, at_least, between, one_of, param
from fedjax_pfedes.errors import ConfigError

# The named choices of the upload fields (the modules that implement them read these).
WEIGHTINGS = ("samples", "sqrt_samples", "uniform", "all_samples")
AGGREGATORS = ("mean", "median", "trimmed_mean")
VALUE_ENCODINGS = ("none", "bf16", "qsgd")
ACCOUNTANTS = ("rdp", "pld")
# 'sum' and 'protocol' are what `upload.secure_aggregation.secure_sum` runs; 'aggregate' is the
# stage's own (`upload.stages.SecureAggregation`: the senders' summed noise drawn once).
SECAGG_SIMULATIONS = ("sum", "protocol", "aggregate")


@dataclasses.dataclass(frozen=True)
class UploadSection(Section):
    """`config.upload`: the upload pipeline's checks, weights, aggregator and compression."""

    SECTION: ClassVar[str] = "upload"

    reject_nonfinite: bool = param(True, "NaN/Inf uploads are rejected, the round goes on")
    norm_outlier_factor: float = param(
        10.0, "the norm rule (off at 0, under DP and under secure aggregation): reject an update "
        "whose norm per local sample is > this x the round's median AND whose log-norm lies > "
        "norm_outlier_z robust standard deviations above the median log-norm, or whose norm "
        "per sample is > norm_outlier_hard_factor x the median; docs/threat_model.md gives its "
        "measured false-positive and detection rates", at_least(0, " (0 = off)"))
    norm_outlier_z: float = param(
        8.0, "the norm rule: robust standard deviations (1.4826 x MAD) of the log-norm above "
        "the round's median (0 = the factor alone)", at_least(0, " (0 = the factor alone)"))
    norm_outlier_hard_factor: float = param(
        50.0, "the norm rule: reject above this x the median per sample whatever the spread "
        "(0 = no such bound; else >= norm_outlier_factor)", at_least(0, " (0 = no such bound)"))
    norm_outlier_model_ratio: float = param(
        -1.0, "the norm rule: only an update whose norm is > this x the norm of the model it "
        "updates can be rejected (0 = any; -1 = the method's AlgorithmEntry.norm_model_ratio: "
        "0.1; pfedes_paper 1, pfedes 0, fedmrl 0.5)",
        Range(lambda v: v >= 0 or v == -1, ">= 0 (0 = not applied) or -1 (the method's)"))
    norm_outlier_small_cohorts: bool = param(
        True, "per-cohort aggregation: a cohort with fewer than 3 uploads (no median of its "
        "own) is judged against the round's uploads of every cohort (False: not judged)")
    weighting: str = param(
        "samples", "'samples' (local training samples) | 'sqrt_samples' | 'uniform' | "
        "'all_samples' (training + local test samples: the published pFedES code's weights)",
        one_of(*WEIGHTINGS))
    aggregator: str = param("mean", "'mean' | 'median' | 'trimmed_mean' (per coordinate)",
                            one_of(*AGGREGATORS))
    trim_fraction: float = param(0.1, "trimmed mean: share cut at each end",
                                  between(0, 0.5, "[)"))
    topk_fraction: float = param(1.0, "top-k sparsification with error feedback (1 = off)",
                                  between(0, 1, "(]"))
    value_encoding: str = param("none", "'none' (float32) | 'bf16' | 'qsgd'",
                                 one_of(*VALUE_ENCODINGS))
    qsgd_levels: int = param(16, "QSGD: quantization levels s", at_least(1))

    def check(self) -> None:
        if not (self.norm_outlier_hard_factor == 0
                or self.norm_outlier_hard_factor >= self.norm_outlier_factor):
            raise ConfigError(
                "config.upload.norm_outlier_hard_factor must be 0 (none) or >= "
                f"config.upload.norm_outlier_factor ({self.norm_outlier_factor:g}), got "
                f"{self.norm_outlier_hard_factor}")

    @property
    def compresses(self) -> bool:
        """Whether an upload is sparsified or its values encoded (`upload.compression`)."""
        return self.topk_fraction < 1 or self.value_encoding != "none"


@dataclasses.dataclass(frozen=True)
class DPSection(Section):
    """`config.dp`: client-level DP (DP-FedAvg): updates clipped to clip_norm, Gaussian noise
    on the sum."""

    SECTION: ClassVar[str] = "dp"

    enabled: bool = param(False, "client-level DP (needs config.upload.weighting = 'uniform')")
    clip_norm: float = param(1.0, "C: each update is clipped to this L2 norm",
                             above(0).when_enabled())
    noise_multiplier: float = param(1.0, "sigma: noise std = sigma * C on the sum",
                                    at_least(0).when_enabled())
    target_epsilon: float = param(
        0.0, "> 0: calibrate sigma to reach this epsilon at the end",
        at_least(0, " (0 = use noise_multiplier)").when_enabled())
    delta: float = param(1e-5, "the delta of (epsilon, delta)",
                         between(0, 1).when_enabled())
    accountant: str = param("rdp", "'rdp' | 'pld' (pld needs train.sampling='poisson')",
                            one_of(*ACCOUNTANTS).when_enabled())


@dataclasses.dataclass(frozen=True)
class DPSGDSection(Section):
    """`config.dp_sgd`: sample-level DP-SGD in local training (pfedes and the FedAvg family):
    per-example gradients clipped to clip_norm, Gaussian noise per step; per-client epsilon in
    the metrics."""

    SECTION: ClassVar[str] = "dp_sgd"

    enabled: bool = param(False, "sample-level DP-SGD in the local steps")
    clip_norm: float = param(1.0, "per-example gradient clip", above(0).when_enabled())
    noise_multiplier: float = param(1.0, "noise std / clip_norm per step",
                                    at_least(0).when_enabled())
    delta: float = param(1e-5, "the delta of each client's (epsilon, delta)",
                         between(0, 1).when_enabled())


@dataclasses.dataclass(frozen=True)
class AttackSection(Section):
    """`config.attack`: simulated malicious clients (docs/threat_model.md) that send this
    instead of their update."""

    SECTION: ClassVar[str] = "attack"

    clients: str = param("", "comma-separated client ids, e.g. '0,3'")
    kind: str = param("none", "'none' | 'constant' | 'scale' | 'sign_flip' | 'gaussian' | 'nan'")
    value: float = param(1e4, "the constant, the scale factor or the noise std")


@dataclasses.dataclass(frozen=True)
class SecAggSection(Section):
    """`config.secagg`: secure aggregation (Bonawitz et al. 2017): the server sees only masked
    vectors."""

    SECTION: ClassVar[str] = "secagg"

    enabled: bool = param(False, "secure aggregation of the uploads")
    threshold_fraction: float = param(0.6, "Shamir threshold t = ceil(fraction * participants)",
                                     between(0, 1, "(]"))
    ring_bits: int = param(64, "fixed-point ring Z_(2^bits): 32 | 64", one_of(32, 64))
    fraction_bits: int = param(24, "fixed-point fractional bits (below ring_bits - 2)",
                               above(0))
    dropout_after_upload: float = param(0.0, "simulated share of senders lost before "
                                        "unmasking", between(0, 1, "[)"))
    min_senders: int = param(3, "fewer senders in a round: no update, no release (>= 2: with "
                            "one sender the 'secure sum' is that client's update)",
                            at_least(2).when_enabled())
    simulation: str = param(
        "sum", "'sum': the protocol's output | 'protocol': run every party | 'aggregate': its "
        "output in distribution, the senders' noise drawn as one sum (streams under 'scan'; no "
        "config.attack)", one_of(*SECAGG_SIMULATIONS))

    def check(self) -> None:
        if not 0 < self.fraction_bits < self.ring_bits - 2:
            raise ConfigError("config.secagg.fraction_bits must be in (0, ring_bits - 2), got "
                              f"{self.fraction_bits}")
