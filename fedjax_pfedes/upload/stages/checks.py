"""The server's checks on what arrived: non-finite uploads (`FiniteCheck`) and update norms far
beyond the round's (`NormOutlierCheck`, with `outlier_rule`, where the rule applies)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.upload import validation
from fedjax_pfedes.upload.stages.stage import RoundUploads, UploadStage, register_stage


def outlier_rule(cfg) -> tuple[float, str]:
    """(the norm-outlier factor in force, why) — the median rule is off where it cannot hold:
    under client-level DP (whether one client is counted would depend on the others' data, which
    voids the sensitivity bound; clipping to C bounds every client instead) and under secure
    aggregation (the server never sees an individual norm; a range check before masking applies
    instead)."""
    u = cfg.upload
    if u.norm_outlier_factor <= 0:
        return 0.0, "off (config.upload.norm_outlier_factor=0)"
    if cfg.dp is not None:
        return 0.0, ("off under config.dp.enabled: clipping to config.dp.clip_norm bounds every "
                     "update instead")
    if cfg.secagg is not None:
        return 0.0, ("off under config.secagg.enabled: the server sees no individual norm; "
                     "values are range-checked before masking instead")
    z, hard = u.norm_outlier_z, u.norm_outlier_hard_factor
    return u.norm_outlier_factor, (
        f"updates with norm per local sample > {u.norm_outlier_factor:g} x the round's median"
        + (f" and log-norm > {z:g} robust standard deviations above the round's median "
           "log-norm" if z > 0 else "")
        + (f", or > {hard:g} x the median," if z > 0 and hard > 0 else "")
        + (f" and > {cfg.norm_model_ratio:g} x the norm of the model they update"
           if cfg.norm_model_ratio > 0 else "")
        + " are rejected"
        + ("; a cohort aggregated alone that sent fewer than 3 uploads is judged against the "
           "round's uploads of every cohort" if u.norm_outlier_small_cohorts else ""))


@register_stage
@dataclasses.dataclass
class FiniteCheck(UploadStage):
    """Rejects uploads with NaN/Inf values (when `reject`). When at least half of the round's
    uploads are non-finite, the reason says the broadcast they trained from is the likelier
    culprit (a poisoned or diverged server model makes honest clients fail together)."""

    reject: bool
    reason: str = "non-finite values"
    name = "finite_check"
    position = 10  # on the raw update

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.upload.reject_nonfinite, "non-finite values (client-side check)"
                   if cfg.secagg is not None else "non-finite values")

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
        u = cfg.upload
        return cls(outlier_rule(cfg)[0], cfg.norm_keys, u.norm_outlier_z,
                   u.norm_outlier_hard_factor, cfg.norm_model_ratio,
                   u.norm_outlier_small_cohorts)

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
