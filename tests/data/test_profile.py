"""Data profile numbers against a hand-computed example, its files and its CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from fedjax_pfedes.data.federated import FederatedData
from fedjax_pfedes.data.profile import coefficient_of_variation, kl_divergence, profile_partition
from fedjax_pfedes.data.sources import make_dataset
from fedjax_pfedes.io import plotting


def _hand_example():
    # Pool labels; client 0 trains on rows 0-3 (labels 0,0,0,1), client 1 on rows 4-7 (1,1,2,2).
    y = np.array([0, 0, 0, 1, 1, 1, 2, 2, 0, 2])
    x = np.zeros((10, 1), np.float32)
    central = make_dataset("hand", "tabular", x, y, x[:3], y[:3], num_classes=4)
    return FederatedData(central, [np.arange(0, 4), np.arange(4, 8)],
                         [np.array([8]), np.array([9])])


def test_profile_matches_hand_computation():
    p = profile_partition(_hand_example(), "manual")
    np.testing.assert_array_equal(p.label_counts, [[3, 1, 0, 0], [0, 2, 2, 0]])
    np.testing.assert_array_equal(p.train_sizes, [4, 4])
    np.testing.assert_array_equal(p.test_sizes, [1, 1])
    np.testing.assert_allclose(p.global_distribution, [3 / 8, 3 / 8, 2 / 8, 0])
    # KL(p0 || g) = 3/4 ln((3/4)/(3/8)) + 1/4 ln((1/4)/(3/8)) = 3/4 ln 2 + 1/4 ln(2/3).
    kl0 = 0.75 * np.log(2) + 0.25 * np.log(2 / 3)
    # KL(p1 || g) = 1/2 ln((1/2)/(3/8)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3) + 1/2 ln 2.
    kl1 = 0.5 * np.log(4 / 3) + 0.5 * np.log(2)
    np.testing.assert_allclose(p.kl_to_global, [kl0, kl1], rtol=1e-12)
    np.testing.assert_array_equal(p.classes_covered, [2, 2])
    assert p.size_cv == 0.0
    summary = p.summary()
    assert summary["train_samples"] == 8 and summary["num_classes"] == 4
    json.dumps(summary, default=lambda v: v.tolist())


def test_kl_and_cv_helpers():
    assert kl_divergence([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert kl_divergence([1.0, 0.0], [0.0, 1.0]) == float("inf")
    # sizes 10, 20, 30: population std sqrt(200/3), mean 20.
    assert coefficient_of_variation(np.array([10, 20, 30])) == pytest.approx(
        np.sqrt(200 / 3) / 20)


def test_profile_plots_are_written(tmp_path):
    p = profile_partition(_hand_example(), "manual")
    for draw, name in ((plotting.label_heatmap, "heat.png"), (plotting.size_histogram, "h.png")):
        path = draw(p, str(tmp_path / name))
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_profile_cli_prints_the_table_and_writes_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.profile_data", "--config=configs/tabular_hetero.py",
         f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "breast_cancer, partition 'dirichlet': 10 clients, 2 classes" in proc.stdout
    assert "| KL to global label distribution (nats) |" in proc.stdout
    for name in ("data_profile.json", "label_heatmap.png", "client_sizes.png"):
        assert (tmp_path / name).exists()
    profile = json.load(open(tmp_path / "data_profile.json"))
    assert profile["num_clients"] == 10 and len(profile["per_client"]["kl_to_global"]) == 10
