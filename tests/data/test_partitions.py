"""Partition invariants, checked directly on the index arrays."""

import numpy as np
import pytest

from fedjax_pfedes.data import partitions
from fedjax_pfedes.data.federated import stack_clients


def _labels(n_per_class=100, classes=10):
    return np.repeat(np.arange(classes), n_per_class)


def _assert_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "a sample is missing or assigned twice"
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def test_iid_covers_every_sample_once_with_balanced_sizes():
    y = _labels()
    parts = partitions.iid_partition(y, 7, seed=0)
    _assert_exact_cover(parts, len(y))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("alpha", [0.05, 0.3, 10.0])
def test_dirichlet_covers_every_sample_and_respects_minimum(alpha):
    y = _labels()
    parts = partitions.dirichlet_partition(y, 20, alpha, min_samples=30, seed=1)
    _assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 30


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not():
    y = _labels(200)

    def mean_classes(alpha):
        parts = partitions.dirichlet_partition(y, 10, alpha, min_samples=1, seed=0)
        return np.mean([np.count_nonzero(np.bincount(y[p], minlength=10) >= 5) for p in parts])

    assert mean_classes(0.05) < 4 < 9 < mean_classes(100.0)


def test_dirichlet_finishes_when_minimum_fills_the_pool_exactly():
    y = _labels(50)  # 500 samples
    parts = partitions.dirichlet_partition(y, 50, 0.01, min_samples=10, seed=3)
    assert [len(p) for p in parts] == [10] * 50


def test_dirichlet_impossible_minimum_names_the_fields():
    with pytest.raises(ValueError, match="min_samples_per_client"):
        partitions.dirichlet_partition(_labels(10), 20, 0.5, min_samples=10, seed=0)


def test_pathological_gives_each_client_its_number_of_classes():
    y = _labels(600)
    parts = partitions.pathological_partition(y, 100, 2, seed=0)
    _assert_exact_cover(parts, len(y))
    for p in parts:
        assert len(np.unique(y[p])) == 2
    holders = np.zeros(10, int)
    for p in parts:
        holders[np.unique(y[p])] += 1
    assert holders.min() >= 1 and holders.sum() == 200


@pytest.mark.parametrize("seed", range(5))
def test_pathological_class_sets_are_drawn_at_random_independently_of_the_architecture(seed):
    """The published split: 100 clients x 2 of 10 classes, CNN-1..5 assigned k mod 5. Dealing
    classes round-robin gave 5 distinct pairs, one per architecture cohort; a random draw gives
    ~40, every cohort sees (nearly) every class, and a chi-square test finds no dependence
    between a client's architecture and the classes it holds."""
    from scipy import stats

    from fedjax_pfedes.engine.cohorts import assign_architectures

    y = _labels(500)
    parts = partitions.pathological_partition(y, 100, 2, seed=seed)
    sets = [tuple(np.unique(y[p])) for p in parts]
    assert len(set(sets)) >= 30
    archs = assign_architectures("cnn1,cnn2,cnn3,cnn4,cnn5", 100)
    table = np.zeros((5, 10), int)
    for arch, classes in zip(archs, sets, strict=True):
        table[int(arch[-1]) - 1, list(classes)] += 1
    assert ((table > 0).sum(axis=1) >= 8).all(), table
    assert stats.chi2_contingency(table).pvalue > 0.01, table


def test_pathological_shares_stay_within_the_uniform_bounds():
    # A class's h holders split it in proportion to shares in [0.4, 0.6]: each gets between
    # 0.4 / (0.4 + 0.6 (h - 1)) and 0.6 / (0.6 + 0.4 (h - 1)) of it.
    y = _labels(1000)
    parts = partitions.pathological_partition(y, 10, 2, seed=5)
    holders = np.zeros(10, int)
    for p in parts:
        holders[np.unique(y[p])] += 1
    for p in parts:
        for c in np.unique(y[p]):
            frac = np.count_nonzero(y[p] == c) / 1000
            h = holders[c]
            assert 0.4 / (0.4 + 0.6 * (h - 1)) - 1e-3 <= frac <= 0.6 / (0.6 + 0.4 * (h - 1)) + 1e-3


def test_pathological_leaves_unheld_classes_unassigned():
    y = _labels(10)
    parts = partitions.pathological_partition(y, 2, 2, seed=0)  # 4 of 10 classes are held
    held = np.concatenate(parts)
    assert len(np.unique(y[held])) == 4
    assert len(held) == 40 and len(np.unique(held)) == 40


def test_local_split_is_disjoint_stratified_and_same_classes():
    y = _labels(100)
    parts = partitions.pathological_partition(y, 10, 2, seed=0)
    train, test = partitions.local_train_test_split(y, parts, 0.2, seed=0)
    for p, tr, te in zip(parts, train, test, strict=True):
        assert len(np.intersect1d(tr, te)) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), p)
        assert set(np.unique(y[te])) == set(np.unique(y[tr]))
        assert abs(len(te) - 0.2 * len(p)) <= 2


def test_stack_clients_pads_with_zeros_and_records_sizes():
    x = np.arange(10, dtype=np.float32).reshape(10, 1) + 1
    y = np.arange(10)
    arrays = stack_clients(x, y, [np.array([0, 1, 2]), np.array([5])])
    np.testing.assert_array_equal(arrays.sizes, [3, 1])
    np.testing.assert_array_equal(arrays.x[:, :, 0], [[1, 2, 3], [6, 0, 0]])
    np.testing.assert_array_equal(arrays.y, [[0, 1, 2], [5, 0, 0]])


def test_dirichlet_finishes_for_500_clients_alpha_0_1_and_100_classes():
    y = _labels(500, classes=100)  # 50,000 samples, CIFAR-100 sized
    parts = partitions.dirichlet_partition(y, 500, 0.1, min_samples=20, seed=0)
    _assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 20
    again = partitions.dirichlet_partition(y, 500, 0.1, min_samples=20, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@pytest.mark.parametrize("sigma", [0.0, 0.5, 2.0])
def test_quantity_skew_covers_every_sample_and_respects_minimum(sigma):
    y = _labels(100)
    parts = partitions.quantity_skew_partition(y, 30, sigma, min_samples=5, seed=2)
    _assert_exact_cover(parts, len(y))
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5
    if sigma == 0.0:
        assert sizes.max() - sizes.min() <= 1


def test_quantity_skew_sizes_follow_the_lognormal_shares():
    y = _labels(1000)  # 10,000 samples
    parts = partitions.quantity_skew_partition(y, 50, 1.0, min_samples=0, seed=4)
    shares = np.random.default_rng(4).lognormal(0.0, 1.0, 50)
    expected = shares / shares.sum() * len(y)
    np.testing.assert_allclose([len(p) for p in parts], expected, atol=1.0)

    def cv(sigma):
        sizes = [len(p) for p in partitions.quantity_skew_partition(y, 50, sigma, 0, seed=4)]
        return np.std(sizes) / np.mean(sizes)

    assert cv(0.1) < cv(0.5) < cv(1.5)


def test_quantity_skew_impossible_minimum_names_the_fields():
    with pytest.raises(ValueError, match="min_samples_per_client=10 x config.data.num_clients"):
        partitions.quantity_skew_partition(_labels(10), 20, 1.0, min_samples=10, seed=0)


def test_natural_partition_gives_one_group_per_client():
    groups = np.array([3, 1, 3, 2, 1, 1, 7, 2, 3, 7])
    parts = partitions.natural_partition(groups, 4, seed=0)
    _assert_exact_cover(parts, len(groups))
    assert sorted(len(np.unique(groups[p])) for p in parts) == [1, 1, 1, 1]
    assert sorted(int(groups[p[0]]) for p in parts) == [1, 2, 3, 7]
    fewer = partitions.natural_partition(groups, 2, seed=1)
    chosen = np.concatenate(fewer)
    assert len(np.unique(chosen)) == len(chosen)  # disjoint
    for p in fewer:  # each chosen writer brings all of its samples
        np.testing.assert_array_equal(p, np.flatnonzero(groups == groups[p[0]]))


def test_natural_partition_errors_name_the_fields():
    with pytest.raises(ValueError, match="needs a dataset with natural groups"):
        partitions.natural_partition(None, 3, seed=0)
    with pytest.raises(ValueError, match=r"num_clients=5: the natural partition has 4 groups"):
        partitions.natural_partition(np.array([0, 1, 2, 3]), 5, seed=0)


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological", "quantity_skew",
                                       "natural"])
def test_partition_dataset_is_deterministic_and_disjoint(partition):
    from fedjax_pfedes.data.federated import partition_dataset
    from fedjax_pfedes.data.sources import make_dataset

    y = _labels(40)
    x = np.zeros((len(y), 2), np.float32)
    central = make_dataset("t", "tabular", x, y, x[:4], y[:4], 10,
                           groups_train=np.arange(len(y)) % 10)
    a = partition_dataset(central, 10, partition, seed=7, min_samples_per_client=5)
    b = partition_dataset(central, 10, partition, seed=7, min_samples_per_client=5)
    for split in ("train_indices", "test_indices"):
        for u, v in zip(getattr(a, split), getattr(b, split), strict=True):
            np.testing.assert_array_equal(u, v)
    everything = np.concatenate(a.train_indices + a.test_indices)
    assert len(everything) == len(np.unique(everything)) == len(y)  # all 10 classes/groups held


def test_the_validation_split_comes_from_training_rows_and_never_reads_the_test_split():
    from fedjax_pfedes.data.federated import partition_dataset
    from fedjax_pfedes.data.sources import make_dataset

    y = _labels(40)
    x = np.zeros((len(y), 2), np.float32)
    central = make_dataset("t", "tabular", x, y, x[:4], y[:4], 10)
    plain = partition_dataset(central, 10, "iid", seed=3, min_samples_per_client=5)
    tuned = partition_dataset(central, 10, "iid", seed=3, min_samples_per_client=5,
                              validation=True)
    for k in range(10):
        train, test = set(plain.train_indices[k]), set(plain.test_indices[k])
        fit, val = set(tuned.train_indices[k]), set(tuned.test_indices[k])
        assert fit | val == train and not fit & val and val  # carved out of training rows
        assert not (fit | val) & test                        # the test split is never read
        assert 0 < len(val) <= 0.3 * len(train)  # class-stratified, rounded per class
