"""Upload stages: each transform of an upload is one object, and the pipeline is their list.

In the spirit of `optax.chain`, a stage has up to two halves:

- `init_state(template, members)`: the stage's persistent per-client state, stacked over a
  cohort's members (e.g. top-k's error-feedback memory), or None when it keeps none. The
  pipeline keeps every cohort's states as {stage name: state}; they are part of the run's
  `SimState` and checkpointed with it, whatever the stage.
- `client(delta, memory, key, info) -> (delta, memory, info)`: what ONE client does to its
  update before sending it (traced; the pipeline vmaps and jits the chain of client halves
  once). `memory` is this client's row of the stage's state (None without one); `info` is a
  dict of per-client facts later stages read on the server (e.g. 'finite', 'norm').
- `server(r: RoundUploads)`: what the server does with the round's uploads (host side, in chain
  order): reject clients, set aggregation weights, or compute the aggregate.
- `report_keys`: the entries of the round's report the stage writes that go into the round's
  monitoring record (metrics.jsonl); the engine copies what the stages declare and names none.

`transforms` says whether a stage changes the values of accepted uploads; when no stage does, the
algorithm receives the uploads exactly as they arrived (bit for bit).

A stage class registers itself (`@register_stage`) with its `position` in the chain and a
`from_config(cfg, noise_multiplier)` that returns the stage a run's `pipeline.PipelineConfig`
asks for, or None; `pipeline.build_stages` builds the chain from the registry. A stage may own
config fields (`fields`: dotted path -> default, e.g. {'my_stage.amount': 0.0}): they join the
default config (`fedjax_pfedes.default_config()`), reach it as `cfg.field('my_stage.amount')`
and are range-checked by its `check(cfg)` before anything is built. A new stage is one class
(here or in its own module) with its registration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.tree_util import tree_size
from fedjax_pfedes.upload import compression, privacy, robust, validation
from fedjax_pfedes.upload import secure_aggregation as sa_protocol


@dataclasses.dataclass
class RoundUploads:
    """One round's uploads as the server-side stages see them (host side, updated in place).

    Attributes:
      round_index: 0-based round.
      cohorts: architecture -> `pipeline.CohortUploads` (ids, sizes, template, real slots).
      scopes: groups of architectures aggregated together (one per cohort for per-cohort
        methods, one for all cohorts for shared-tree methods).
      members: architecture -> clients in the cohort.
      key: the round's upload RNG key.
      valid: architecture -> [slots] whether the slot still counts (stages reject by clearing).
      sent: architecture -> stacked updates as decoded by the server (float32); None when no
        stage transforms (`UploadPipeline.active`: the uploads reach the algorithm as they
        arrived, so only the client halves' facts are computed).
      info: architecture -> per-client facts from the client halves ('finite', 'norm').
      weights: architecture -> [slots] aggregation weights (set by the weighting stage).
      aggregates: architecture -> the update the server applies to every real slot, or None
        when the algorithm averages the decoded uploads itself.
      report: the round's report (rejections, skipped scopes, protocol figures).
      reject: (ids, reason) -> None; records rejections (the caller clears `valid`).
      expected_in_scope: members -> expected participants among them (fixed DP denominator).
    """

    round_index: int
    cohorts: dict[str, Any]
    scopes: list[list[str]]
    members: dict[str, int]
    key: jax.Array
    valid: dict[str, np.ndarray]
    sent: dict[str, Any]
    info: dict[str, dict[str, np.ndarray]]
    report: dict[str, Any]
    reject: Callable[[np.ndarray, str], None]
    expected_in_scope: Callable[[int], float]
    weights: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    aggregates: dict[str, Any] | None = None

    def scope_arrays(self, scope: list[str]):
        """(stacked sent [slots, ...], valid [slots], weights [slots]) over a scope's cohorts."""
        stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[self.sent[a] for a in scope])
        ok = np.concatenate([self.valid[a] for a in scope])
        w = jnp.concatenate([self.weights[a] for a in scope])
        return stacked, ok, w

    def streamed(self, scope: list[str]) -> bool:
        """Whether any of the scope's cohorts was summed as it trained (`upload.streaming`):
        its clipped updates' sum instead of stacked updates (`scope_sum`). Under
        `execution.strategy='auto'` one cohort may stream and another stack."""
        return any(self.cohorts[a].reduced is not None for a in scope)

    def scope_sum(self, scope: list[str]) -> Any:
        """The sum of the scope's valid clipped updates, float32: a streamed cohort's sum
        (`StreamingClippedSum`) as it is, a stacked cohort's valid rows added up."""
        return _sum_trees([
            self.cohorts[a].reduced["sum"] if self.cohorts[a].reduced is not None
            else _weighted_row_sum(self.sent[a], jnp.asarray(self.valid[a], jnp.float32))
            for a in scope])

    def skip_scope(self, scope: list[str]) -> Any:
        """No server update from `scope` this round: zero weights, a zero aggregate."""
        for a in scope:
            self.weights[a] = jnp.zeros_like(self.weights[a])
        return jax.tree.map(lambda t: jnp.zeros(jnp.shape(t), jnp.float32),
                            self.cohorts[scope[0]].template)


@jax.jit
def _weighted_row_sum(stacked, weights):
    """sum_i weights[i] x row i of every leaf of `stacked` (one program per shape)."""
    return jax.tree.map(lambda a: jnp.tensordot(weights, a, axes=1), stacked)


@jax.jit
def _sum_trees(trees: list):
    """The leaf-wise sum of equally shaped trees, in one program."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


class UploadStage:
    """A stage that does nothing; subclasses override the halves they need.

    A malicious client runs its own code: it skips every client half, except those the server
    enforces on what it receives (`server_enforced`: checks and clipping the server can apply
    because it sees individual uploads, i.e. without secure aggregation). `skipped` is what the
    server sees of a stage a client skipped (by default: the update as it is)."""

    name = "identity"
    transforms = False
    client_keyed = False  # its client half keeps a per-client state or draws a key
    report_keys: tuple[str, ...] = ()
    position = 0  # where in the chain (`register_stage`): lower runs first
    # Config fields the stage owns, dotted path -> default ({} for the shipped stages, whose
    # fields are PipelineConfig's own); read with `cfg.field(path)`.
    fields: ClassVar[dict[str, Any]] = {}

    @classmethod
    def check(cls, cfg) -> None:
        """Raises ValueError naming the field for a bad value of the stage's own `fields`.

        Args:
          cfg: the run's `PipelineConfig` (its `field(path)` reads them).
        """
        del cfg

    @classmethod
    def from_config(cls, cfg, noise_multiplier: float) -> UploadStage | None:
        """The stage a run's `pipeline.PipelineConfig` asks for, or None (not in this chain).

        Args:
          cfg: the run's `PipelineConfig`.
          noise_multiplier: the client-level DP noise multiplier in force (0 without DP).

        Returns:
          A configured stage, or None.
        """
        del cfg, noise_multiplier
        return None

    def server_enforced(self, secagg: bool) -> bool:
        del secagg
        return False

    def skipped(self, delta, info):
        return delta, info

    def init_state(self, template, members: int):
        del template, members
        return None

    def client(self, delta, memory, key, info):
        del key
        return delta, memory, info

    def server(self, r: RoundUploads) -> None:
        del r


# --- checks -----------------------------------------------------------------------------------

STAGES: list[type[UploadStage]] = []


def register_stage(cls: type[UploadStage]) -> type[UploadStage]:
    """Adds a stage class to the chain `pipeline.build_stages` builds (in `position` order).

    Args:
      cls: an `UploadStage` subclass with a `position` and a `from_config`.

    Returns:
      `cls` (use as a class decorator). A second class under a registered `name` raises.
    """
    if not (isinstance(cls, type) and issubclass(cls, UploadStage)):
        raise ValueError(f"register_stage: expected a subclass of UploadStage, got "
                        f"{cls!r} ({type(cls).__name__})")
    where = f"register_stage({cls.__name__})"
    if not isinstance(cls.name, str) or not cls.name or (
            cls.name == UploadStage.name and cls is not UploadStage):
        raise ValueError(f"{where}: the stage needs a name of its own (class attribute "
                         f"`name`), got {cls.name!r}")
    if not isinstance(cls.position, int | float) or isinstance(cls.position, bool):
        raise ValueError(f"{where}: position must be a number (lower runs first), got "
                         f"{cls.position!r}")
    taken = {c.name: c for c in STAGES}
    if cls.name in taken and taken[cls.name] is not cls:
        raise ValueError(f"upload stage '{cls.name}' is registered twice")
    _check_stage_fields(cls, where)
    if cls not in STAGES:
        STAGES.append(cls)
        STAGES.sort(key=lambda c: c.position)
    return cls


def _check_stage_fields(cls: type[UploadStage], where: str) -> None:
    """A stage's fields may not collide with the core config's, a method's or another stage's
    (at another default), naming both owners."""
    if not isinstance(cls.fields, dict):
        raise ValueError(f"{where}: fields must map dotted config paths to defaults, got "
                         f"{cls.fields!r}")
    if not cls.fields:
        return
    methods = algorithm_registry.entries()
    core = algorithm_registry.core_paths()
    for path, default in cls.fields.items():
        if path in core["leaves"] or path in core["sections"]:
            raise ValueError(f"{where}: field 'config.{path}' collides with the core config's")
        for m in methods.values():
            if path in m.fields:
                raise ValueError(f"{where}: field 'config.{path}' is declared by the method "
                                 f"'{m.name}' too")
        for other in STAGES:
            if other is not cls and path in other.fields and other.fields[path] != default:
                raise ValueError(f"{where}: field 'config.{path}' is declared by the stage "
                                 f"'{other.name}' too, with default {other.fields[path]!r}")


def declared_fields() -> dict[str, Any]:
    """Every registered stage's own config fields with their defaults (dotted paths).

    Returns:
      {path: default}; ValueError when two stages declare one path with different defaults.
    """
    out: dict[str, Any] = {}
    for cls in STAGES:
        for path, default in cls.fields.items():
            if path in out and out[path] != default:
                raise ValueError(f"config.{path}: declared by two upload stages with the "
                                 f"defaults {out[path]!r} and {default!r}")
            out[path] = default
    return out


def outlier_rule(cfg) -> tuple[float, str]:
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
    z, hard = cfg.norm_outlier_z, cfg.norm_outlier_hard_factor
    return cfg.norm_outlier_factor, (
        f"updates with norm per local sample > {cfg.norm_outlier_factor:g} x the round's median"
        + (f" and log-norm > {z:g} robust standard deviations above the round's median "
           "log-norm" if z > 0 else "")
        + (f", or > {hard:g} x the median," if z > 0 and hard > 0 else "")
        + (f" and > {cfg.norm_outlier_model_ratio:g} x the norm of the model they update"
           if cfg.norm_outlier_model_ratio > 0 else "")
        + " are rejected"
        + ("; a cohort aggregated alone that sent fewer than 3 uploads is judged against the "
           "round's uploads of every cohort" if cfg.norm_outlier_small_cohorts else ""))


@register_stage
@dataclasses.dataclass
class FiniteCheck(UploadStage):
    """Rejects uploads with NaN/Inf values (when `reject`). When at least half of the round's
    uploads are non-finite, the reason says the broadcast they trained from is the likelier
    culprit (a poisoned or diverged server model makes honest clients fail together)."""

    reject: bool = True
    reason: str = "non-finite values"
    name = "finite_check"
    position = 10  # on the raw update

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.reject_nonfinite, "non-finite values (client-side check)"
                   if cfg.secagg else "non-finite values")

    def client(self, delta, memory, key, info):
        return delta, memory, {**info, "finite": validation.all_finite(delta)}

    def server_enforced(self, secagg: bool) -> bool:
        return not secagg  # the server checks what it sees; under secure aggregation it sees none

    def skipped(self, delta, info):
        return delta, {**info, "finite": jnp.bool_(True)}  # a rogue client passes itself

    def server(self, r: RoundUploads) -> None:
        if not self.reject:
            return
        bad = {a: r.valid[a] & ~r.info[a]["finite"] for a in r.cohorts}
        n_bad = sum(int(b.sum()) for b in bad.values())
        n_all = sum(int(v.sum()) for v in r.valid.values())
        reason = self.reason
        if n_bad >= 2 and 2 * n_bad >= n_all:
            reason += (f" ({n_bad} of {n_all} uploads this round: a poisoned or diverged "
                       "broadcast model is the likelier cause than these clients)")
        for arch, c in r.cohorts.items():
            r.reject(c.client_ids[bad[arch]], reason)
            r.valid[arch] &= ~bad[arch]


@register_stage
@dataclasses.dataclass
class NormOutlierCheck(UploadStage):
    """Measures each update's L2 norm where it stands in the chain (after compression, before
    clipping) and rejects those whose norm PER LOCAL SAMPLE exceeds `factor` x the median of
    the valid updates aggregated together (`validation.norm_outliers`; needs >= 3 of them: a
    cohort aggregated alone with fewer is judged against the round's uploads of every cohort).

    Per sample, because honest update norms grow with the local steps a client takes, i.e. with
    its sample count: under quantity skew (LogNormal sizes, sigma 2) raw norms of one round
    differ 20x and a raw-norm rule rejected the largest honest clients; per sample they stay
    within a few x (docs/threat_model.md), while a boosted poisoning update is still orders
    of magnitude off. With equal sample counts it is the raw-norm rule. With `keys` only the
    upload's model part is measured (FedNova's solver scalar, FedProto's class counts are
    not an update)."""

    factor: float = 0.0
    keys: tuple[str, ...] = ()  # the upload's model part (`Algorithm.norm_keys`; () = all)
    z_threshold: float = 0.0  # `validation.norm_outliers`' robust z-score (0 = not applied)
    hard_factor: float = 0.0  # beyond this many medians whatever the z (0 = none)
    model_ratio: float = 0.0  # only updates larger than this x the model's norm (0 = all)
    small_cohorts: bool = False  # a scope of < 3 judged against every scope of the round
    name = "norm_outlier_check"
    position = 30  # measured on what is sent

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(outlier_rule(cfg)[0], cfg.norm_keys, cfg.norm_outlier_z,
                   cfg.norm_outlier_hard_factor, cfg.norm_outlier_model_ratio,
                   cfg.norm_outlier_small_cohorts)

    def client(self, delta, memory, key, info):
        norm = validation.update_norms(jax.tree.map(
            lambda a: a[None], validation.model_part(delta, self.keys)))[0]
        return delta, memory, {**info, "norm": norm}

    def server_enforced(self, secagg: bool) -> bool:
        return not secagg

    def skipped(self, delta, info):  # the norm of what was sent (the rule reads it or not)
        delta, _, info = self.client(delta, None, None, info)
        return delta, info

    def server(self, r: RoundUploads) -> None:
        if self.factor <= 0:
            return
        every = [a for scope in r.scopes for a in scope]
        valid = {a: r.valid[a].copy() for a in every}  # as the stage found them
        for scope in r.scopes:
            # A scope of fewer than 3 valid uploads has no median of its own: it is judged
            # against the round's uploads of every scope (per local sample), so an attacker
            # alone or with one other in its cohort is judged too (U13).
            alone = len(r.scopes) == 1 or sum(int(valid[a].sum()) for a in scope) >= 3
            if alone or self.small_cohorts:
                self._judge(r, scope if alone else every, scope, valid, alone)

    def _judge(self, r: RoundUploads, reference: list[str], judged: list[str],
               valid: dict[str, np.ndarray], alone: bool) -> None:
        """Rejects the outliers among `judged`'s uploads, measured against `reference`'s."""
        ok = np.concatenate([valid[a] for a in reference])
        norms = np.concatenate([np.asarray(r.info[a]["norm"], np.float32) for a in reference])
        sizes = np.concatenate([np.asarray(r.cohorts[a].sizes, np.float32) for a in reference])
        per_sample = norms / np.maximum(sizes, 1.0)
        outlier = validation.norm_outliers(per_sample, ok, self.factor, self.z_threshold,
                                           self.hard_factor)
        relative = None
        if outlier.any() and self.model_ratio > 0:
            tiny = np.finfo(np.float32).tiny  # a template of zeros: every ratio is huge
            relative = np.concatenate([
                np.asarray(r.info[a]["norm"], np.float32)
                / max(validation.model_norm(r.cohorts[a].template, self.keys), tiny)
                for a in reference])
            outlier = validation.norm_outliers(
                per_sample, ok, self.factor, self.z_threshold, self.hard_factor, relative,
                self.model_ratio)
        z = validation.robust_log_z(per_sample, ok) if outlier.any() else None
        median = ("the round's median per sample" if alone else
                  "the median per sample of the round's uploads of every cohort (its own "
                  "sent fewer than 3)")
        start = 0
        for a in reference:
            n = len(valid[a])
            mine = outlier[start:start + n] if a in judged else np.zeros(n, bool)
            for j in np.flatnonzero(mine):
                r.reject(r.cohorts[a].client_ids[j:j + 1],
                         f"update norm {float(norms[start + j]):.3g} "
                         f"({float(per_sample[start + j]):.3g} per local sample) beyond "
                         f"{self.factor:g} x {median} "
                         + (f"and {float(z[start + j]):.3g} robust standard deviations "
                            "above its median log-norm " if self.z_threshold > 0 else "")
                         + (f"and {float(relative[start + j]):.3g} x the norm of the model "
                            "it updates " if relative is not None else "")
                         + "(config.upload.norm_outlier_*)")
            start += n
            r.valid[a] &= ~mine


# --- client-side transforms ---------------------------------------------------------------------

@register_stage
@dataclasses.dataclass
class Compression(UploadStage):
    """Top-k with error feedback (the client's `memory`), then bf16 or QSGD values."""

    cfg: compression.CompressionConfig = compression.CompressionConfig()
    name = "compression"
    position = 20

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.compression)

    @property
    def transforms(self) -> bool:
        return self.cfg.active

    @property
    def client_keyed(self) -> bool:
        return self.cfg.active  # error feedback's memory, QSGD's stochastic rounding

    def init_state(self, template, members: int):
        """Error-feedback memory, zeros [members, ...] (float32), when top-k is on."""
        if self.cfg.topk_fraction >= 1:
            return None
        return jax.tree.map(lambda a: jnp.zeros((members, *jnp.shape(a)), jnp.float32),
                            template)

    def client(self, delta, memory, key, info):
        delta, memory = compression.compress(delta, memory, key, self.cfg)
        return delta, memory, info


@register_stage
@dataclasses.dataclass
class Clip(UploadStage):
    """Client-level DP: the update scaled to L2 norm <= `clip_norm`."""

    clip_norm: float = 1.0
    name = "clip"
    transforms = True
    position = 40

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.dp.clip_norm) if cfg.dp is not None else None

    def client(self, delta, memory, key, info):
        delta, _ = privacy.clip_update(delta, self.clip_norm)
        return delta, memory, info

    def server_enforced(self, secagg: bool) -> bool:
        # Central DP: the trusted server clips what it receives. Distributed DP (secure
        # aggregation): clipping is the client's own code, which a rogue client skips.
        return not secagg


# --- server-side weights and aggregation --------------------------------------------------------

@register_stage
@dataclasses.dataclass
class Weighting(UploadStage):
    """Zeroes the rejected slots' values (NaN x weight 0 is still NaN) and sets the weights:
    sample counts, their square root, uniform (`robust.smooth_weights`), or all of a client's
    samples, training and local test ('all_samples', the published pFedES code's weights)."""

    weighting: str = "samples"
    name = "weighting"
    position = 50

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.weighting)

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

    aggregator: str = "median"
    trim_fraction: float = 0.1
    name = "robust_aggregation"
    transforms = True
    report_keys = ("robust_aggregation_skipped",)
    position = 60  # one aggregator: secure sum, else DP noisy mean, else median / trimmed mean

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        if cfg.secagg or cfg.dp is not None or cfg.aggregator == "mean":
            return None
        return cls(cfg.aggregator, cfg.trim_fraction)

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
                _skip(r, "robust_aggregation_skipped",
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

    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    name = "dp_noisy_mean"
    transforms = True
    report_keys = ("dp_realized_noise_multiplier",)  # written by the pipeline for the accountant
    position = 60

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        if cfg.secagg or cfg.dp is None:
            return None
        return cls(noise_multiplier, cfg.dp.clip_norm)

    def __post_init__(self):
        self._noisy_mean = jax.jit(self._mean)
        self._noisy_total = jax.jit(self._released)

    def _released(self, total, key, denominator):
        noise = privacy.gaussian_noise_like(total, key, self.noise_multiplier * self.clip_norm)
        return jax.tree.map(lambda t, z: (t + z) / denominator, total, noise)

    def _mean(self, stacked, valid, key, denominator):
        return self._released(_weighted_row_sum(stacked, valid.astype(jnp.float32)), key,
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


def _skip(r: RoundUploads, key: str, why: str) -> None:
    """A scope that gets no server update this round: said in the report and the log."""
    r.report.setdefault(key, []).append(why)
    logging.warning("round %d: no server update for %s", r.round_index + 1, why)


def scope_key(r: RoundUploads, s_idx: int) -> jax.Array:
    """The RNG key of a scope's server-side randomness this round."""
    return jax.random.fold_in(jax.random.fold_in(r.key, 1000 + s_idx), r.round_index)


@register_stage
@dataclasses.dataclass
class SecureAggregation(UploadStage):
    """Bonawitz et al. 2017 over each scope's valid clients (`secure_aggregation.secure_sum`):
    each client's vector (weighted update and weight; with DP, its clipped update plus its share
    of the noise) is range-checked on the client before masking; fewer than `min_senders`
    senders get no sum; the decoded mean's quantization error bound and, with DP, the noise the
    senders really added are reported."""

    threshold_fraction: float = 0.6
    dropout_after_upload: float = 0.0
    min_senders: int = 3
    encoding: sa_protocol.RingEncoding = sa_protocol.RingEncoding()
    noise_multiplier: float = 0.0   # > 0: client-level DP noise added by the senders
    clip_norm: float = 1.0
    dp: bool = False
    simulation: str = "sum"  # `secure_aggregation.secure_sum`: its output, or every party
    name = "secure_aggregation"
    transforms = True
    report_keys = ("secagg_senders", "secagg_dropped_after_upload", "secagg_failures",
                   "secagg_skipped", "secagg_quantization_error_bound",
                   "dp_realized_noise_multiplier")
    position = 60

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        if not cfg.secagg:
            return None
        return cls(cfg.secagg_threshold_fraction, cfg.secagg_dropout_after_upload,
                   cfg.secagg_min_senders, cfg.encoding, noise_multiplier,
                   cfg.dp.clip_norm if cfg.dp is not None else 1.0, cfg.dp is not None,
                   cfg.secagg_simulation)

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
            raise ValueError("config.secagg.simulation='aggregate' cannot simulate clients "
                             "that skip their client code (config.attack): use 'sum'")
        senders = int(ok.sum())
        if senders < self.min_senders:
            _skip(r, "secagg_skipped", f"{'+'.join(scope)}: {senders} sender(s), "
                  f"config.secagg.min_senders={self.min_senders}")
            return None
        rng = np.random.default_rng([int(jax.random.randint(key, (), 0, 2 ** 31 - 1)),
                                     r.round_index])
        dropped = int(np.sum(rng.random(senders) < self.dropout_after_upload))
        threshold = max(2, math.ceil(self.threshold_fraction * senders))
        length = tree_size(r.cohorts[scope[0]].template)[0] + 1  # + the weight
        report.setdefault("secagg_bytes", []).append(
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
            total, weight = _weighted_row_sum(stacked, weights), float(jnp.sum(weights))
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
        report = r.report
        ids = np.concatenate([r.cohorts[a].client_ids for a in scope])
        flat = np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1)
                               for a in jax.tree.leaves(stacked)], axis=1)
        w = np.asarray(w, np.float64)
        if ok.sum() < self.min_senders:
            # Too few senders: the "secure" sum would reveal (nearly) one client's update.
            _skip(r, "secagg_skipped", f"{'+'.join(scope)}: {int(ok.sum())} sender(s), "
                  f"config.secagg.min_senders={self.min_senders}")
            return None
        noise_std = 0.0
        if self.dp:  # distributed noise: each client adds its share of the variance
            noise_std = self.noise_multiplier * self.clip_norm / math.sqrt(max(denominator, 1.0))
        rng = np.random.default_rng([int(jax.random.randint(key, (), 0, 2 ** 31 - 1)),
                                     r.round_index])
        bound = self.encoding.max_abs(int(ok.sum()))
        rogue = np.concatenate([r.info[a]["skips_client_code"] for a in scope]).astype(bool)
        # Weights are sent divided by a public scale the server broadcasts, the power of two
        # at or below the round's mean weight: the weighted mean is unchanged, a sample count of
        # thousands fits a 32-bit ring as well as a weight of 1 does, and integer counts stay
        # exact in fixed point (a division by 2^k only shifts bits).
        w = w / 2.0 ** math.floor(math.log2(max(float(w[ok].mean()), 2.0 ** -20)))
        # Every valid client's vector, [its weighted update, its weight]; the honest ones add
        # their noise shares (one draw for all of them: the same stream, row after row, as
        # one draw per client) and check their range before masking.
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
        if len(vectors) < self.min_senders:
            _skip(r, "secagg_skipped", f"{'+'.join(scope)}: {len(vectors)} sender(s) within "
                  f"range, config.secagg.min_senders={self.min_senders}")
            return None
        drop = frozenset(u for u in vectors if rng.random() < self.dropout_after_upload)
        threshold = max(2, math.ceil(self.threshold_fraction * len(vectors)))
        senders = len(vectors)  # clients that drop after uploading have sent their vector
        report.setdefault("secagg_bytes", []).append((senders, sa_protocol.bytes_per_sender(
            next(iter(vectors.values())).shape[0], senders, self.encoding)))
        try:
            result = sa_protocol.secure_sum(vectors, threshold, self.encoding,
                                            int(rng.integers(0, 2 ** 62)),
                                            drop_after_upload=drop,
                                            unchecked=frozenset(unchecked),
                                            simulation=self.simulation)
        except sa_protocol.SecureAggregationError as e:
            report.setdefault("secagg_failures", []).append(str(e))
            r.reject(np.array(sorted(vectors)), "secure aggregation failed")
            return None  # the round's update is lost; the server keeps its state
        total, weight = result.total[:-1], result.total[-1]
        divisor = denominator if self.dp else max(weight, 1e-12)
        self._report_sum(report, len(result.senders), senders - len(unchecked), len(drop),
                         denominator, divisor)
        mean = total / divisor
        zero = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.float32), stacked)
        leaves, treedef = jax.tree.flatten(zero)
        out, start = [], 0
        for leaf in leaves:
            out.append(jnp.asarray(mean[start:start + leaf.size].reshape(leaf.shape),
                                   jnp.float32))
            start += leaf.size
        return jax.tree.unflatten(treedef, out)
