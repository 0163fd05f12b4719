"""Client-level differential privacy: clipping, Gaussian noise, and the privacy accountant.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR
2018): every participant's update (its upload minus the broadcast reference) is clipped to L2 norm
<= C; the server adds N(0, (sigma C)^2) to the sum of the clipped updates (each with weight 1) and
divides by the EXPECTED number of participants (the fixed-denominator estimator, so the
denominator reveals nothing about who took part). The unit of privacy is the client (user-level):
one client's whole dataset may change. The accountant composes the rounds with `dp_accounting`
(Google's library) under the neighbouring relation the selection allows:

- sampling 'poisson': each client takes part independently with probability q, the sampler's own
  rate (config.train.client_fraction), not round(qN)/N. Neighbours: add-or-remove one client;
  the clipped sum moves by <= C, so the Gaussian's multiplier is sigma. PoissonSampledDpEvent,
  RDP or PLD.
- sampling 'fixed': exactly m of N clients, uniformly without replacement. Amplification for this
  sampler is proved for replace-one neighbours (Wang, Balle and Kasiviswanathan, "Subsampled
  Renyi Differential Privacy and Analytical Moments Accountant", AISTATS 2019, Theorem 27; the
  bound dp_accounting's SampledWithoutReplacementDpEvent computes), where N is public and one
  client's data is replaced by another's. Replacing one clipped update moves the sum by up to
  2C, so the multiplier handed to the accountant is sigma / 2 (dp_accounting defines it as the
  noise std over the l2-sensitivity under the relation; google/differential-privacy issue 378).
  RDP only: dp_accounting's PLD accountant has no sampling without replacement.
- sampling 'none': the selection is not uniformly random (stratified quotas over public strata,
  availability < 1, drop-outs), so no amplification is claimed. Such a selection does not depend
  on the clients' data (the config checks refuse those that would: sample-count strata,
  coverage sampling, minimum-size skipping, deadlines with failure-decayed weights), so with the
  population fixed, replacing one client's data changes its own clipped update only: every
  round is the plain Gaussian mechanism at sensitivity 2C (multiplier sigma / 2), replace-one.
  Add-or-remove is not claimed here: adding a client to a fixed-size draw changes who else is
  drawn.

`relation_of` names the relation and `sensitivity_factor` its sensitivity in units of C; the
summary writes both, so every reported epsilon says what it protects. Architecture cohorts are
disjoint, so per-cohort aggregation gives every client the same guarantee.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from fedjax_pfedes.config.defaults import DPSection
from fedjax_pfedes.errors import ConfigError

if TYPE_CHECKING:  # imported where used: it pulls in scipy.signal and scipy.optimize, whose
    import dp_accounting  # start-up a run without DP never needs to pay

SAMPLINGS = ("fixed", "poisson", "none")


@dataclasses.dataclass(frozen=True)
class ClientDPConfig(DPSection):
    """`config.dp` as a run accounts it: the section (its fields and ranges, always enabled)
    with the sampling assumption the run's selection rule allows. `noise_multiplier` sigma, or
    (when `target_epsilon` > 0) sigma calibrated so that the run's rounds spend exactly
    `target_epsilon` at `delta`.

    Attributes:
      sampling: 'poisson' | 'fixed' | 'none' (the module's docstring says what each claims).
      sampling_rate: 'poisson': the rate the sampler draws at (config.train.client_fraction).
    """

    sampling: str = "fixed"
    sampling_rate: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "enabled", True)  # in force: every range of the section holds
        super().__post_init__()

    def check(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"config.dp.sampling must be one of {SAMPLINGS}, got "
                             f"'{self.sampling}'")
        if self.sampling == "poisson" and not 0 < self.sampling_rate <= 1:
            raise ConfigError("Poisson sampling needs its rate in (0, 1] "
                             f"(config.train.client_fraction), got {self.sampling_rate}")
        if self.accountant == "pld" and self.sampling == "fixed":
            raise ConfigError("config.dp.accountant='pld' needs config.dp.sampling='poisson' "
                             "(dp_accounting's PLD accountant has no fixed-size sampling); "
                             "use 'rdp' for fixed-size sampling")


def statement(dp: ClientDPConfig) -> dict:
    """What client-level DP's figures protect, for summary.json: the unit, the neighbouring
    relation its epsilon is stated under and the sensitivity that relation gives.

    Args:
      dp: the client-level DP settings in force.

    Returns:
      The `dp_*` fields.
    """
    return {
        "dp_accounting_sampling": dp.sampling,
        "dp_unit": "client (user-level: one client's whole local dataset)",
        "dp_neighbouring_relation": relation_of(dp.sampling),
        "dp_l2_sensitivity": sensitivity_factor(dp.sampling) * dp.clip_norm,
        **({"dp_sampling_rate": dp.sampling_rate} if dp.sampling == "poisson" else {}),
    }


def clip_scale(norm: jax.Array, clip_norm: float) -> jax.Array:
    """The factor that scales an update of L2 norm `norm` to norm <= `clip_norm`."""
    return jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-12))


def clip_update(update, clip_norm: float):
    """(update scaled to L2 norm <= clip_norm, its norm before clipping)."""
    norm = jnp.sqrt(sum(jnp.sum(a.astype(jnp.float32) ** 2) for a in jax.tree.leaves(update)))
    scale = clip_scale(norm, clip_norm)
    return jax.tree.map(lambda a: (a * scale).astype(a.dtype), update), norm


def gaussian_noise_like(tree, rng: jax.Array, std: float | jax.Array):
    """A tree of independent N(0, std^2) values shaped like `tree` (float32)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(treedef, [std * jax.random.normal(k, jnp.shape(a), jnp.float32)
                                        for a, k in zip(leaves, keys, strict=True)])


RELATIONS = {"fixed": "replace_one", "poisson": "add_or_remove_one", "none": "replace_one"}


def relation_of(sampling: str) -> str:
    """The client-level neighbouring relation a sampling's epsilon is stated under."""
    return RELATIONS[sampling]


def sensitivity_factor(sampling: str) -> float:
    """The L2 sensitivity of the clipped sum in units of the clip norm C under the sampling's
    relation: 2 for replace-one (one clipped update swapped for another), 1 for add-or-remove."""
    return 2.0 if relation_of(sampling) == "replace_one" else 1.0


def round_event(cfg: ClientDPConfig, num_clients: int, clients_per_round: int,
                noise_multiplier: float) -> dp_accounting.DpEvent:
    """The DP event of one round whose aggregate carried noise std `noise_multiplier` x C.

    The Gaussian's multiplier is std over the sensitivity under `relation_of(cfg.sampling)`."""
    import dp_accounting
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity_factor(cfg.sampling))
    if cfg.sampling == "none":
        return gaussian
    if cfg.sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(cfg.sampling_rate, gaussian)
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, clients_per_round,
                                                          gaussian)


def make_accountant(kind: str, sampling: str) -> dp_accounting.PrivacyAccountant:
    """An RDP or PLD accountant. dp_accounting's relation argument selects which sampled events
    it accepts (sampling without replacement needs REPLACE_ONE); the sensitivity is already in
    the events' multipliers (`round_event`), so a plain Gaussian is accounted with the
    add-or-remove accountant whatever the relation (the PLD accountant would double it again)."""
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
        round_event(cfg, num_clients, clients_per_round, noise_multiplier), rounds))
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
            round_event(cfg, num_clients, clients_per_round, sigma), count))
    return float(accountant.get_epsilon(cfg.delta))


# The noise multipliers calibration searches between: below the lower end the noise protects
# nothing a user would call private, above the upper end it drowns any update (std 1000 C on a
# sum of updates of norm <= C each).
CALIBRATION_RANGE = (1e-3, 1e3)


def calibrate_noise_multiplier(cfg: ClientDPConfig, num_clients: int, clients_per_round: int,
                               rounds: int) -> float:
    """The smallest sigma (to dp_accounting's tolerance) with epsilon(rounds) <= target.

    Args:
      cfg: the DP settings (`target_epsilon` > 0, the sampling and its relation).
      num_clients: N, the population.
      clients_per_round: m, participants per round (fixed-size sampling).
      rounds: rounds the budget must last.

    Returns:
      The noise multiplier sigma (noise std sigma x C on the clipped sum).

    Raises:
      ValueError: naming config.dp.target_epsilon when the target lies outside what sigma in
        `CALIBRATION_RANGE` can give (a target so large that no noise is needed, or so small
        that the noise would drown every update).
    """
    import dp_accounting

    def event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            round_event(cfg, num_clients, clients_per_round, sigma), rounds)

    low, high = CALIBRATION_RANGE
    target = cfg.target_epsilon
    rdp = dataclasses.replace(cfg, accountant="rdp")  # fast at any sigma; PLD is not
    eps_low = epsilon(rdp, low, num_clients, clients_per_round, rounds)  # >= PLD's
    if eps_low <= target:
        raise ConfigError(
            f"config.dp.target_epsilon={target:g} is reached already with noise multiplier "
            f"{low:g} (epsilon {eps_low:.3g} over {rounds} rounds): such a budget protects "
            "nothing; choose a smaller target or set config.dp.noise_multiplier directly")
    eps_high = epsilon(cfg, high, num_clients, clients_per_round, rounds)
    if eps_high > target:
        raise ConfigError(
            f"config.dp.target_epsilon={target:g} needs a noise multiplier above {high:g} "
            f"(noise std > {high:g} x config.dp.clip_norm on the sum; epsilon at {high:g}: "
            f"{eps_high:.3g}): the noise would drown every update; raise the target, or sample "
            "more clients per round / run fewer rounds")

    def search(c: ClientDPConfig, lower: float, upper: float) -> float:
        return float(dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(c.accountant, c.sampling), event, target, c.delta,
            dp_accounting.ExplicitBracketInterval(lower, upper)))

    sigma_rdp = search(rdp, low, high)
    if cfg.accountant == "rdp":
        return sigma_rdp
    # PLD is tighter than RDP: its sigma lies below RDP's. Search just below it (PLD at small
    # sigma takes minutes); where even a quarter of it suffices, RDP's sigma is kept (valid,
    # since PLD's epsilon at it is below the target).
    try:
        return search(cfg, max(low, sigma_rdp / 4), sigma_rdp)
    except (ValueError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError):
        return sigma_rdp


def resolve_noise_multiplier(cfg: ClientDPConfig, num_clients: int, clients_per_round: int,
                             rounds: int) -> float:
    if cfg.target_epsilon > 0:
        return calibrate_noise_multiplier(cfg, num_clients, clients_per_round, rounds)
    return cfg.noise_multiplier
