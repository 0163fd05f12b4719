"""`config.upload`, `config.dp`, `config.dp_sgd`, `config.secagg`, `config.attack`: what a
client sends and what the server does with it (docs/guide/upload_pipeline.md)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fedjax_pfedes.config.fields import Section, above, at_least, between, param


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
        "measured false-positive and detection rates")
    norm_outlier_z: float = param(
        8.0, "the norm rule: robust standard deviations (1.4826 x MAD) of the log-norm above "
        "the round's median (0 = the factor alone)")
    norm_outlier_hard_factor: float = param(
        50.0, "the norm rule: reject above this x the median per sample whatever the spread "
        "(0 = no such bound)")
    norm_outlier_model_ratio: float = param(
        -1.0, "the norm rule: only an update whose norm is > this x the norm of the model it "
        "updates can be rejected (0 = any; -1 = the method's AlgorithmEntry.norm_model_ratio: "
        "0.1; pfedes_paper 1, pfedes 0, fedmrl 0.5)")
    norm_outlier_small_cohorts: bool = param(
        True, "per-cohort aggregation: a cohort with fewer than 3 uploads (no median of its "
        "own) is judged against the round's uploads of every cohort (False: not judged)")
    weighting: str = param(
        "samples", "'samples' (local training samples) | 'sqrt_samples' | 'uniform' | "
        "'all_samples' (training + local test samples: the published pFedES code's weights)")
    aggregator: str = param("mean", "'mean' | 'median' | 'trimmed_mean' (per coordinate)")
    trim_fraction: float = param(0.1, "trimmed mean: share cut at each end")
    topk_fraction: float = param(1.0, "top-k sparsification with error feedback (1 = off)")
    value_encoding: str = param("none", "'none' (float32) | 'bf16' | 'qsgd'")
    qsgd_levels: int = param(16, "QSGD: quantization levels s")


@dataclasses.dataclass(frozen=True)
class DPSection(Section):
    """`config.dp`: client-level DP (DP-FedAvg): updates clipped to clip_norm, Gaussian noise
    on the sum."""

    SECTION: ClassVar[str] = "dp"

    enabled: bool = param(False, "client-level DP (needs config.upload.weighting = 'uniform')")
    clip_norm: float = param(1.0, "C: each update is clipped to this L2 norm")
    noise_multiplier: float = param(1.0, "sigma: noise std = sigma * C on the sum")
    target_epsilon: float = param(0.0, "> 0: calibrate sigma to reach this epsilon at the end")
    delta: float = param(1e-5, "the delta of (epsilon, delta)")
    accountant: str = param("rdp", "'rdp' | 'pld' (pld needs train.sampling='poisson')")


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
    threshold_fraction: float = param(0.6, "Shamir threshold t = ceil(fraction * participants)")
    ring_bits: int = param(64, "fixed-point ring Z_(2^bits): 32 | 64")
    fraction_bits: int = param(24, "fixed-point fractional bits")
    dropout_after_upload: float = param(0.0, "simulated share of senders lost before "
                                        "unmasking")
    min_senders: int = param(3, "fewer senders in a round: no update, no release")
    simulation: str = param(
        "sum", "'sum': the protocol's output | 'protocol': run every party | 'aggregate': its "
        "output in distribution, the senders' noise drawn as one sum (streams under 'scan'; no "
        "config.attack)")
