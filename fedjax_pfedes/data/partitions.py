"""Splitting a labelled pool across clients: IID, Dirichlet(alpha) label skew, pathological
n-classes, log-normal quantity skew and natural groups (e.g. writers).

Every function returns one sorted index array per client; the arrays are disjoint and every call is
deterministic given its `seed`. IID, Dirichlet and quantity skew assign every sample; pathological
leaves out the classes no client holds and natural leaves out the groups that were not chosen.
"""

from __future__ import annotations

import numpy as np

from fedjax_pfedes.errors import ConfigError


def iid_partition(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffles the pool and deals it into `num_clients` parts whose sizes differ by at most one."""
    _check_num_clients(labels, num_clients)
    perm = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, min_samples: int,
                        seed: int) -> list[np.ndarray]:
    """Label-skewed split: each class is spread over clients with proportions ~ Dirichlet(alpha).

    Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification", 2019. Instead of resampling until every client has `min_samples` (which can
    loop for ever for small alpha), clients below the minimum take random samples from the client
    that currently holds the most, so the call always finishes in one pass.

    Raises:
      ValueError: naming the field when `num_clients * min_samples` exceeds the pool.
    """
    _check_num_clients(labels, num_clients)
    if alpha <= 0:
        raise ConfigError(f"config.data.dirichlet_alpha must be > 0, got {alpha}")
    if min_samples * num_clients > len(labels):
        raise ConfigError(
            f"config.data.min_samples_per_client={min_samples} x config.data.num_clients="
            f"{num_clients} exceeds the {len(labels)} training samples")
    rng = np.random.default_rng(seed)
    owner = np.empty(len(labels), np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        shares = rng.dirichlet(np.full(num_clients, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for k, part in enumerate(np.split(idx, cuts)):
            owner[part] = k
    sizes = np.bincount(owner, minlength=num_clients)
    for k in np.flatnonzero(sizes < min_samples):
        while sizes[k] < min_samples:
            donor = int(np.argmax(sizes))
            take = min(min_samples - sizes[k], sizes[donor] - min_samples)
            moved = rng.choice(np.flatnonzero(owner == donor), size=take, replace=False)
            owner[moved] = k
            sizes[donor] -= take
            sizes[k] += take
    return [np.flatnonzero(owner == k) for k in range(num_clients)]


def pathological_partition(labels: np.ndarray, num_clients: int, classes_per_client: int,
                           seed: int, share_low: float = 0.4, share_high: float = 0.6
                           ) -> list[np.ndarray]:
    """Each client holds `classes_per_client` classes, as in the published pFedES split.

    Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing for Model Heterogeneous
    Personalized Federated Learning", AAAI 2025 (and its public code): every client draws its
    class set uniformly at random, independently of the other clients and of the architecture
    it runs (over 100 clients with 2 of 10 classes that gives ~40 distinct pairs, where dealing
    classes round-robin gave 5, the same pair for every client of one architecture cohort).
    Where the draw leaves a class without a holder, the most widely held class of a random
    client is swapped for it, so every class is held by >= 1 client whenever
    num_clients x classes_per_client >= the number of classes. Each (client, class) pair draws a
    share ~ U(share_low, share_high) and a class's samples are divided among its holders in
    proportion to those shares. Samples of classes that no client holds are left unassigned.
    """
    _check_num_clients(labels, num_clients)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise ConfigError(f"config.data.classes_per_client must be in [1, {len(classes)}], "
                         f"got {classes_per_client}")
    if not 0 < share_low <= share_high:
        raise ConfigError(f"class shares need 0 < low <= high, got ({share_low}, {share_high})")
    rng = np.random.default_rng(seed)
    holds = np.zeros((num_clients, len(classes)), bool)
    for k in range(num_clients):
        holds[k, rng.choice(len(classes), classes_per_client, replace=False)] = True
    for missing in rng.permutation(np.flatnonzero(~holds.any(axis=0))):
        count = holds.sum(axis=0)
        if count.max() < 2:
            break  # too few clients to hold every class
        # a random client holding a class held most often gives it up for the missing one
        crowded = int(rng.choice(np.flatnonzero(count == count.max())))
        donor = int(rng.choice(np.flatnonzero(holds[:, crowded])))
        holds[donor, crowded], holds[donor, missing] = False, True
    shares = np.where(holds, rng.uniform(share_low, share_high, holds.shape), 0.0)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for ci, c in enumerate(classes):
        holders = np.flatnonzero(holds[:, ci])
        if len(holders) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        fractions = shares[holders, ci] / shares[holders, ci].sum()
        cuts = np.round(np.cumsum(fractions)[:-1] * len(idx)).astype(int)
        for k, part in zip(holders, np.split(idx, cuts), strict=True):
            parts[k].append(part)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def quantity_skew_partition(labels: np.ndarray, num_clients: int, sigma: float,
                            min_samples: int, seed: int) -> list[np.ndarray]:
    """IID labels, client sizes skewed: size shares ~ LogNormal(0, sigma), normalized.

    Li et al., "Federated Learning on Non-IID Data Silos: An Experimental Study", ICDE 2022
    (quantity skew). Every client first gets `min_samples`; the rest of the pool is divided in
    proportion to the log-normal draws (largest remainders get the leftover samples), so sizes sum
    exactly to the pool. sigma = 0 gives equal sizes.
    """
    _check_num_clients(labels, num_clients)
    if sigma < 0:
        raise ConfigError(f"config.data.quantity_sigma must be >= 0, got {sigma}")
    if min_samples * num_clients > len(labels):
        raise ConfigError(
            f"config.data.min_samples_per_client={min_samples} x config.data.num_clients="
            f"{num_clients} exceeds the {len(labels)} training samples")
    rng = np.random.default_rng(seed)
    shares = rng.lognormal(0.0, sigma, num_clients)
    shares /= shares.sum()
    free = len(labels) - min_samples * num_clients
    exact = shares * free
    sizes = np.floor(exact).astype(np.int64)
    leftover = free - int(sizes.sum())
    sizes[np.argsort(-(exact - sizes), kind="stable")[:leftover]] += 1
    sizes += min_samples
    perm = rng.permutation(len(labels))
    return [np.sort(part) for part in np.split(perm, np.cumsum(sizes)[:-1])]


def natural_partition(groups: np.ndarray | None, num_clients: int, seed: int
                      ) -> list[np.ndarray]:
    """One client per natural group (e.g. an EMNIST writer); `num_clients` groups chosen at random.

    Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018. With as many clients as
    groups every sample is assigned; with fewer, the samples of unchosen groups are left out.
    """
    if groups is None:
        raise ConfigError("config.data.partition='natural' needs a dataset with natural groups "
                         "(e.g. 'femnist', or an .npz file with a groups_train array)")
    names = np.unique(groups)
    if not 1 <= num_clients <= len(names):
        raise ConfigError(f"config.data.num_clients={num_clients}: the natural partition has "
                         f"{len(names)} groups; choose 1..{len(names)} clients")
    chosen = np.sort(np.random.default_rng(seed).permutation(len(names))[:num_clients])
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], names)
    bounds = np.append(starts, len(groups))
    return [np.sort(order[bounds[g]:bounds[g + 1]]) for g in chosen]


def local_train_test_split(labels: np.ndarray, client_indices: list[np.ndarray],
                           test_fraction: float, seed: int) -> tuple[list[np.ndarray],
                                                                     list[np.ndarray]]:
    """Splits each client's samples into local train / local test, stratified by class.

    The local test split therefore has the client's own classes (the personalized evaluation of
    pFedES). A class with a single sample at a client stays in its train split.
    """
    if not 0 < test_fraction < 1:
        raise ConfigError(f"config.data.local_test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for idx in client_indices:
        tr, te = [], []
        for c in np.unique(labels[idx]):
            members = rng.permutation(idx[labels[idx] == c])
            n_test = int(np.floor(test_fraction * len(members) + 0.5)) if len(members) > 1 else 0
            te.append(members[:n_test])
            tr.append(members[n_test:])
        train.append(np.sort(np.concatenate(tr)) if tr else np.zeros(0, np.int64))
        test.append(np.sort(np.concatenate(te)) if te else np.zeros(0, np.int64))
    return train, test


def _check_num_clients(labels: np.ndarray, num_clients: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"config.data.num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ConfigError(f"config.data.num_clients={num_clients} exceeds the {len(labels)} "
                         "training samples: every client needs at least one sample")
