"""Gradient-inversion check: metrics against references, what the server sees, the command."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models import architectures
from fedjax_pfedes.studies.gradient_inversion import (
    AttackConfig,
    gradient,
    invert,
    observed_uploads,
    psnr,
    ssim,
)


def test_psnr_and_ssim_against_hand_values():
    a = np.zeros((8, 8, 1))
    b = np.full((8, 8, 1), 0.1)
    assert psnr(a, b) == np.float64(20.0)  # MSE 0.01 -> 20 dB
    rng = np.random.default_rng(0)
    x = rng.random((16, 16, 1))
    assert ssim(x, x) == np.float64(1.0)
    assert ssim(x, rng.random((16, 16, 1))) < 0.2


def test_server_views_are_the_gradient_its_noisy_clip_and_the_sum():
    spec = InputSpec("image", (8, 8, 1), "float32", (0.5,), (0.25,))
    model = architectures.classifier_model("mlp_small", 3, spec)
    rng = np.random.default_rng(0)
    images = rng.random((3, 8, 8, 1)).astype(np.float32)
    labels = np.array([0, 2, 1], np.int32)
    params = model.init(jax.random.key(0), jnp.asarray(images[:1]))
    cfg = AttackConfig(clip_norm=1e-3, noise_multiplier=0.0, secagg_clients=3)
    views = observed_uploads(model, params, images, labels, 1, jax.random.key(1), cfg)
    grads = [gradient(model, params, jnp.asarray(images[i:i + 1]),
                              jnp.asarray(labels[i:i + 1])) for i in range(3)]
    jax.tree.map(np.testing.assert_allclose, views["none"][0], grads[1])
    norm = np.sqrt(sum(float(jnp.sum(a ** 2)) for a in jax.tree.leaves(views["dp"][0])))
    np.testing.assert_allclose(norm, 1e-3, rtol=1e-4)
    jax.tree.map(lambda s, a, b, c: np.testing.assert_allclose(s, a + b + c, rtol=1e-5,
                                                               atol=1e-7),
                 views["secagg"][0], grads[1], grads[0], grads[2])
    np.testing.assert_array_equal(views["secagg"][1], [2, 0, 1])


def test_inverting_an_unprotected_mlp_upload_beats_a_random_guess():
    spec = InputSpec("image", (8, 8, 1), "float32", (0.5,), (0.25,))
    model = architectures.classifier_model("mlp_small", 3, spec)
    rng = np.random.default_rng(3)
    image = rng.random((1, 8, 8, 1)).astype(np.float32)
    params = model.init(jax.random.key(0), jnp.asarray(image))
    g = gradient(model, params, jnp.asarray(image), jnp.array([1]))
    out = invert(model, params, g, jnp.array([1]), image.shape, jax.random.key(2),
                         AttackConfig(steps=150, tv_weight=0.0))
    random_guess = psnr(rng.random(image.shape), image)
    assert psnr(np.asarray(out), image) > random_guess + 5


@pytest.mark.slow
def test_leakage_command_writes_table_and_figure(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "launch.leakage", "--config=configs/quickstart.py",
         f"--workdir={tmp_path}", "--victims=1", "--steps=5"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "leakage.md").read_text()
    for row in ("no protection", "clip C=", "secure aggregation of 2 clients"):
        assert row in table
    assert (tmp_path / "leakage.png").stat().st_size > 0
