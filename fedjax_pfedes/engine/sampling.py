"""Which clients take part in a round, and how many local epochs each runs.

Uniform sampling starves long-tail clients once there are many of them; the engineering answer is
stratified sampling with quotas — buckets by sample count, participation
history and availability, a share of every round for each bucket — plus a minimum-samples rule
(skip tiny clients or give them fewer epochs) and local epochs adapted to client size. Clients
that keep failing are sampled less.

Coverage sampling (`coverage_sample`) fills the round's label distribution: each next participant
is one whose labels the selection so far lacks most (the design's label-coverage extension).

Every draw depends only on (seed, round) and the `SamplerState` (participation history), which the
checkpoint saves, so a resumed run selects the same clients as an unbroken one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_pfedes.algorithms import local_training

METHODS = ("uniform", "poisson", "stratified", "coverage")
BELOW_MIN = ("skip", "one_epoch")


def participants_per_round(num_clients: int, fraction: float) -> int:
    """m = max(1, round(C * N)) participants per round."""
    return max(1, int(round(fraction * num_clients)))


def uniform_sample(seed: int, round_index: int, num_clients: int, fraction: float) -> np.ndarray:
    """Sorted ids of m clients drawn uniformly without replacement.

    The draw depends only on (seed, round_index), so a resumed run samples the same clients.
    """
    rng = np.random.default_rng([seed, round_index])
    m = participants_per_round(num_clients, fraction)
    return np.sort(rng.choice(num_clients, size=m, replace=False))


@dataclasses.dataclass
class SamplerState:
    """Participation history (saved in checkpoints).

    Attributes:
      selected: [N] rounds each client was selected in.
      completed: [N] rounds each client's update reached the server.
      failure_streak: [N] consecutive selections that ended without an upload.
      stratum_debt: [S] participants each stratum is still owed (stratified quotas).
    """

    selected: np.ndarray
    completed: np.ndarray
    failure_streak: np.ndarray
    stratum_debt: np.ndarray

    @classmethod
    def create(cls, num_clients: int, num_strata: int) -> SamplerState:
        return cls(np.zeros(num_clients, np.int64), np.zeros(num_clients, np.int64),
                   np.zeros(num_clients, np.int64), np.zeros(num_strata, np.float64))

    def record(self, selected: np.ndarray, delivered: np.ndarray) -> None:
        """Updates the history after a round: `delivered` ⊆ `selected` (global ids)."""
        self.record_selected(selected)
        self.record_outcome(delivered, np.setdiff1d(selected, delivered))

    def record_selected(self, clients: np.ndarray) -> None:
        self.selected[clients] += 1

    def record_outcome(self, delivered: np.ndarray, failed: np.ndarray) -> None:
        """Delivered clients reset their failure streak; failed ones extend it."""
        self.completed[delivered] += 1
        self.failure_streak[failed] += 1
        self.failure_streak[delivered] = 0

    def arrays(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)


def reliability_weights(state: SamplerState, decay: float) -> np.ndarray:
    """Sampling weight decay^(consecutive failures): clients that keep failing are picked less."""
    return np.power(decay, state.failure_streak.astype(np.float64))


def size_strata(sizes: np.ndarray, num_buckets: int, availability_class: np.ndarray
                ) -> np.ndarray:
    """Stratum of every client: sample-count quantile bucket x availability class."""
    sizes = np.asarray(sizes)
    if num_buckets > 1:
        edges = np.quantile(sizes, np.linspace(0, 1, num_buckets + 1)[1:-1])
        bucket = np.searchsorted(edges, sizes, side="right")
    else:
        bucket = np.zeros(len(sizes), np.int64)
    return bucket * (int(availability_class.max()) + 1) + availability_class


def weighted_uniform(seed: int, round_index: int, m: int, eligible: np.ndarray,
                     weights: np.ndarray) -> np.ndarray:
    """m eligible clients without replacement, with probability proportional to `weights`.

    With every client eligible and equal weights this is exactly `uniform_sample`."""
    n = len(eligible)
    if eligible.all() and np.all(weights == weights[0]):
        return uniform_sample(seed, round_index, n, m / n) if m <= n else np.arange(n)
    candidates = np.flatnonzero(eligible)
    if len(candidates) == 0:
        return candidates
    p = weights[candidates] / weights[candidates].sum()
    rng = np.random.default_rng([seed, round_index])
    return np.sort(rng.choice(candidates, size=min(m, len(candidates)), replace=False, p=p))


def weighted_poisson(seed: int, round_index: int, fraction: float, eligible: np.ndarray,
                     weights: np.ndarray) -> np.ndarray:
    """Sorted ids of the clients that take part, each eligible client independently with
    probability C x weight (Poisson sampling, as the DP accountant's PoissonSampledDpEvent
    assumes; may be empty). With every client eligible and weight 1 the rate is exactly C;
    otherwise C is an upper bound, i.e. the accounting is conservative."""
    u = np.random.default_rng([seed, round_index, 1]).random(len(eligible))
    return np.flatnonzero(eligible & (u < fraction * weights))


def stratified_sample(seed: int, round_index: int, m: int, eligible: np.ndarray,
                      weights: np.ndarray, strata: np.ndarray, state: SamplerState
                      ) -> np.ndarray:
    """Stratified sampling with quotas.

    Each stratum is owed m x (its share of clients) participants per round and the debt carries
    over: the round's m seats go one at a time to the stratum owed most (ties at random), so
    fractional quotas are met on average and a stratum with no reachable client this round is
    paid back later. Within a stratum the least-selected eligible clients go first (ties at
    random), with failing clients counted as if selected 1 / weight times as often. Seats a
    stratum cannot fill this round go to the clients least selected overall. Updates
    `state.stratum_debt`.
    """
    n = len(eligible)
    rng = np.random.default_rng([seed, round_index, 2])
    num_strata = len(state.stratum_debt)
    members = np.bincount(strata, minlength=num_strata)
    debt = state.stratum_debt + m * members / n
    quota = np.zeros(num_strata, np.int64)
    tie = rng.random(num_strata)
    for _ in range(m):
        quota[np.lexsort((tie, -(debt - quota)))[0]] += 1
    priority = (state.selected + 1) / weights  # lower first
    tie = rng.random(n)
    chosen: list[int] = []
    for s in range(num_strata):
        cand = np.flatnonzero(eligible & (strata == s))
        cand = cand[np.lexsort((tie[cand], priority[cand]))]
        chosen.extend(cand[: quota[s]].tolist())
    taken = np.bincount(strata[np.asarray(chosen, np.int64)], minlength=num_strata)
    short = m - len(chosen)
    if short > 0:
        rest = np.setdiff1d(np.flatnonzero(eligible), chosen)
        rest = rest[np.lexsort((tie[rest], priority[rest]))]
        extra = rest[:short]
        chosen.extend(extra.tolist())
        taken += np.bincount(strata[extra], minlength=num_strata)
    state.stratum_debt = np.clip(debt - taken, -m, m)
    return np.sort(np.asarray(chosen, np.int64))


def local_epochs_per_client(sizes: np.ndarray, epochs: int, adaptive: bool, min_epochs: int,
                            max_epochs: int, min_samples: int, below_min: str) -> np.ndarray:
    """Local epochs of every client.

    adaptive: E_i = clip(round(E * sqrt(median(n) / n_i)), min_epochs, max_epochs) — clients
    with more data run fewer epochs, small ones more but not without bound.
    Below `min_samples` with below_min='one_epoch' a client runs one epoch ('skip' is applied by
    the sampler: such clients are never eligible).
    """
    sizes = np.asarray(sizes, np.float64)
    if adaptive:
        ratio = np.sqrt(np.median(sizes) / np.maximum(sizes, 1))
        e = np.clip(np.round(epochs * ratio), min_epochs, max_epochs).astype(np.int64)
    else:
        e = np.full(len(sizes), epochs, np.int64)
    if min_samples > 0 and below_min == "one_epoch":
        e = np.where(sizes < min_samples, 1, e)
    return e


def planned_steps(sizes: np.ndarray, capacity: np.ndarray, batch_size: int,
                  epochs: np.ndarray, drop_partial_batch: bool = False) -> np.ndarray:
    """Local steps = epochs x ceil(n / B) (floor(n / B) for n >= B when partial batches are
    dropped), with B capped at the cohort's padded length (as `local_training.batch_schedule`)."""
    batch = np.minimum(batch_size, np.asarray(capacity))
    per_epoch = local_training.batches_per_epoch(np.asarray(sizes), batch, drop_partial_batch)
    return np.asarray(epochs) * np.asarray(per_epoch)


def coverage_sample(seed: int, round_index: int, m: int, eligible: np.ndarray,
                    weights: np.ndarray, label_counts: np.ndarray,
                    candidates: int = 0) -> np.ndarray:
    """m eligible clients chosen to cover the label distribution, from a random candidate set.

    First `candidates` eligible clients (0 = 2m) are drawn without replacement with probability
    proportional to `weights`, as `weighted_uniform` does; then m of them are picked greedily:
    each next one is a candidate with the largest coverage gain p_k . max(0, g - q) (p_k its
    label distribution, g the pooled label distribution of all eligible clients, q that of the
    clients picked so far, sample-weighted; ties at random, the first pick at random). The random
    candidate set is the power-of-choice construction (Cho et al., "Client Selection in Federated
    Learning: Convergence Analysis and Power-of-Choice Selection Strategies", 2020) with label
    coverage as the criterion: every client keeps a chance to take part (a full greedy pass over
    all clients, candidates = N, starved some clients in every run here, docs/design.md), and
    candidates = m is uniform sampling.

    The server must know every client's label histogram (`label_counts` [N, C]), which is a
    disclosure of its own, and the choice depends on the clients' data: client-level DP and
    DP-SGD refuse this method (one client's data would change who else is selected, so the
    sensitivity bound of one client's contribution no longer holds).
    """
    pool = weighted_uniform(seed, round_index, coverage_pool_size(m, candidates), eligible,
                            weights)
    if len(pool) <= m:
        return pool
    rng = np.random.default_rng([seed, round_index, 2])
    counts = np.asarray(label_counts, np.float64)
    dist = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    target = counts[eligible].sum(axis=0)
    target = target / max(target.sum(), 1.0)
    pooled = np.zeros(counts.shape[1])
    chosen = []
    for _ in range(m):
        if pooled.sum() == 0:
            gain = np.ones(len(pool))
        else:
            gain = dist[pool] @ np.maximum(target - pooled / pooled.sum(), 0.0)
        best = pool[gain >= gain.max() - 1e-12]
        pick = int(rng.choice(best, p=weights[best] / weights[best].sum()))
        chosen.append(pick)
        pooled += counts[pick]
        pool = pool[pool != pick]
    return np.sort(np.array(chosen, np.int64))


def coverage_pool_size(m: int, candidates: int) -> int:
    """Candidates coverage sampling draws per round: `candidates` (at least m), 0 = 2m."""
    return 2 * m if candidates <= 0 else max(candidates, m)


def label_coverage(label_counts: np.ndarray, selected: np.ndarray) -> float:
    """Share of the classes held by at least one of the `selected` clients."""
    if len(selected) == 0:
        return 0.0
    present = np.asarray(label_counts)[selected].sum(axis=0) > 0
    return float(present.mean())
