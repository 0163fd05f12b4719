"""Client-level differential privacy: clipping, Gaussian noise, and the privacy accountant.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR
2018): every participant's update (its upload minus the broadcast reference) is clipped to L2 norm
<= C; the server adds N(0, (sigma C)^2) to the sum of the clipped updates (each with weight 1) and
divides by the EXPECTED number of participants (the fixed-denominator estimator, so the
denominator reveals nothing about who took part). One round is a sampled Gaussian mechanism with
sensitivity C; the accountant composes the rounds with `dp_accounting` (Google's library):

- sampling 'poisson': each client takes part independently with probability q = C_frac
  (PoissonSampledDpEvent; add-or-remove-one neighbours); RDP or PLD accounting.
- sampling 'fixed': exactly m of N clients, uniformly without replacement
  (SampledWithoutReplacementDpEvent; replace-one neighbours); RDP accounting only
  (dp_accounting's PLD accountant does not support it).
- sampling 'none': selection is not uniformly random (stratified quotas, availability < 1,
  drop-outs or deadlines with failure-decayed weights, clients skipped below a minimum size), so
  no amplification by subsampling is claimed: every round is accounted as the plain Gaussian
  mechanism (add-or-remove-one neighbours), an upper bound whatever the sampler did.

The guarantee is per client (user-level): a client's whole dataset may change. Architecture
cohorts are disjoint, so per-cohort aggregation gives every client the same guarantee.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # imported where used: it pulls in scipy.signal and scipy.optimize (~1.8 s
    import dp_accounting  # at start-up here), which a run without DP never needs

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed", "poisson", "none")


@dataclasses.dataclass(frozen=True)
class ClientDPConfig:
    """`noise_multiplier` sigma, or (when `target_epsilon` > 0) sigma calibrated so that
    `rounds` rounds spend exactly `target_epsilon` at `delta`."""

    clip_norm: float
    noise_multiplier: float = 0.0
    target_epsilon: float = 0.0
    delta: float = 1e-5
    accountant: str = "rdp"
    sampling: str = "fixed"

    def __post_init__(self):
        if self.clip_norm <= 0:
            raise ValueError(f"config.dp.clip_norm must be > 0, got {self.clip_norm}")
        if self.noise_multiplier < 0:
            raise ValueError(f"config.dp.noise_multiplier must be >= 0, got "
                             f"{self.noise_multiplier}")
        if self.target_epsilon < 0:
            raise ValueError(f"config.dp.target_epsilon must be >= 0 (0 = use "
                             f"noise_multiplier), got {self.target_epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"config.dp.delta must be in (0, 1), got {self.delta}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"config.dp.accountant must be one of {ACCOUNTANTS}, got "
                             f"'{self.accountant}'")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"config.dp.sampling must be one of {SAMPLINGS}, got "
                             f"'{self.sampling}'")
        if self.accountant == "pld" and self.sampling == "fixed":
            raise ValueError("config.dp.accountant='pld' needs config.dp.sampling='poisson' "
                             "(dp_accounting's PLD accountant has no fixed-size sampling); "
                             "use 'rdp' for fixed-size sampling")


def clip_update(update, clip_norm: float):
    """(update scaled to L2 norm <= clip_norm, its norm before clipping)."""
    norm = jnp.sqrt(sum(jnp.sum(a.astype(jnp.float32) ** 2) for a in jax.tree.leaves(update)))
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda a: (a * scale).astype(a.dtype), update), norm


def gaussian_noise_like(tree, rng: jax.Array, std: float | jax.Array):
    """A tree of independent N(0, std^2) values shaped like `tree` (float32)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(treedef, [std * jax.random.normal(k, jnp.shape(a), jnp.float32)
                                        for a, k in zip(leaves, keys, strict=True)])


def round_event(num_clients: int, clients_per_round: int, noise_multiplier: float,
                sampling: str) -> dp_accounting.DpEvent:
    """The DP event of one round."""
    import dp_accounting
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling == "none":
        return gaussian
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(clients_per_round / num_clients, gaussian)
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, clients_per_round,
                                                          gaussian)


def make_accountant(kind: str, sampling: str) -> dp_accounting.PrivacyAccountant:
    import dp_accounting
    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if sampling == "fixed"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if kind == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)


def epsilon(cfg: ClientDPConfig, noise_multiplier: float, num_clients: int,
            clients_per_round: int, rounds: int) -> float:
    """epsilon at cfg.delta after `rounds` rounds (0 rounds: 0; sigma = 0: inf)."""
    import dp_accounting
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = make_accountant(cfg.accountant, cfg.sampling)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        round_event(num_clients, clients_per_round, noise_multiplier, cfg.sampling), rounds))
    return float(accountant.get_epsilon(cfg.delta))


def epsilon_of_rounds(cfg: ClientDPConfig, noise_multipliers, num_clients: int,
                      clients_per_round: int) -> float:
    """epsilon at cfg.delta after rounds that released aggregates with the given noise
    multipliers (one per round; None = the round released nothing). Rounds are composed as
    they happened: a secure-aggregation round with fewer senders than expected carries less
    noise than configured and costs more."""
    import dp_accounting
    released = collections.Counter(s for s in noise_multipliers if s is not None)
    if not released:
        return 0.0
    if min(released) == 0:
        return math.inf
    accountant = make_accountant(cfg.accountant, cfg.sampling)
    for sigma, count in sorted(released.items()):
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            round_event(num_clients, clients_per_round, sigma, cfg.sampling), count))
    return float(accountant.get_epsilon(cfg.delta))


def calibrate_noise_multiplier(cfg: ClientDPConfig, num_clients: int, clients_per_round: int,
                               rounds: int) -> float:
    """The smallest sigma (to dp_accounting's tolerance) with epsilon(rounds) <= target."""
    import dp_accounting
    def event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            round_event(num_clients, clients_per_round, sigma, cfg.sampling), rounds)

    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(cfg.accountant, cfg.sampling), event, cfg.target_epsilon,
        cfg.delta, dp_accounting.LowerEndpointAndGuess(0.1, 1.0)))


def resolve_noise_multiplier(cfg: ClientDPConfig, num_clients: int, clients_per_round: int,
                             rounds: int) -> float:
    if cfg.target_epsilon > 0:
        return calibrate_noise_multiplier(cfg, num_clients, clients_per_round, rounds)
    return cfg.noise_multiplier
