"""Model zoo: pooling semantics, published layer sizes, input normalization, registry errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fedjax_pfedes.models import registry
from fedjax_pfedes.models.layers import InputNormalization, max_pool_2x2


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (1, 7, 9, 2), (3, 28, 28, 16)])
def test_reshape_max_pool_equals_flax_max_pool(shape):
    x = jax.random.normal(jax.random.key(0), shape)
    np.testing.assert_array_equal(max_pool_2x2(x), nn.max_pool(x, (2, 2), (2, 2), "VALID"))


def _count(tree):
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("arch,conv2,fc1", [("cnn1", 32, 2000), ("cnn2", 16, 2000),
                                            ("cnn3", 32, 1000), ("cnn4", 32, 800),
                                            ("cnn5", 32, 500)])
def test_published_cnn_sizes_on_cifar_shapes(arch, conv2, fc1):
    model = registry.client_model(arch, 10, 128, [0.5] * 3, [0.25] * 3)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    # 32 -conv5-> 28 -pool-> 14 -conv5-> 10 -pool-> 5: flatten 5*5*conv2.
    expected_backbone = ((5 * 5 * 3 * 16 + 16) + (5 * 5 * 16 * conv2 + conv2)
                         + (25 * conv2 * fc1 + fc1) + (fc1 * 500 + 500))
    assert _count(params["backbone"]) == expected_backbone
    assert _count(params["classifier"]) == 500 * 10 + 10
    assert _count(params["projection"]) == 500 * 128 + 128


@pytest.mark.parametrize("arch", ["convnet3", "convnet5", "vit", "mlp", "cnn1"])
def test_every_client_model_returns_logits_and_projected_features(arch):
    model = registry.client_model(arch, 7, 16, [0.1], [0.3])
    x = jnp.ones((4, 28, 28, 1))
    logits, e_local = model.apply(model.init(jax.random.key(0), x), x)
    assert logits.shape == (4, 7) and e_local.shape == (4, 16)
    assert np.all(np.asarray(e_local) >= 0)  # Linear + ReLU projection


def test_input_normalization_puts_both_pixel_ranges_on_one_scale():
    x01 = jax.random.uniform(jax.random.key(1), (5, 8, 8, 3))
    norm = InputNormalization(mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))
    out01 = norm.apply({}, x01)
    out255 = norm.apply({}, x01 * 255.0)
    np.testing.assert_allclose(out01, out255, rtol=1e-5, atol=1e-5)
    expected = (np.asarray(x01) - np.array([0.4, 0.5, 0.6])) / np.array([0.2, 0.25, 0.3])
    np.testing.assert_allclose(out01, expected, rtol=1e-5, atol=1e-5)


def test_unknown_model_names_are_rejected_with_the_field():
    with pytest.raises(ValueError, match=r"config.clients.architectures: unknown model 'resnet'"):
        registry.client_model("resnet", 10, 8, [0.0], [1.0])
    with pytest.raises(ValueError, match=r"config.proxy_arch: unknown proxy extractor"):
        registry.proxy_model("big", 8, [0.0], [1.0])
