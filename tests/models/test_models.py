"""Model zoo: pooling semantics, published layer sizes, input normalization, registry errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models import architectures
from fedjax_pfedes.models.architectures import PROXY_BODIES
from fedjax_pfedes.models.backbones import BACKBONES
from fedjax_pfedes.models.layers import InputNormalization, max_pool_2x2

IMAGE_RGB = InputSpec("image", (32, 32, 3), "float32", (0.5,) * 3, (0.25,) * 3)
IMAGE_GRAY = InputSpec("image", (28, 28, 1), "float32", (0.1,), (0.3,))
TABULAR = InputSpec("tabular", (5,), "float32", (0.0,) * 5, (1.0,) * 5)
TEXT = InputSpec("text", (12,), "int32", vocab_size=50)


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (1, 7, 9, 2), (3, 28, 28, 16)])
def test_reshape_max_pool_equals_flax_max_pool(shape):
    x = jax.random.normal(jax.random.key(0), shape)
    np.testing.assert_array_equal(max_pool_2x2(x), nn.max_pool(x, (2, 2), (2, 2), "VALID"))


def _reference_pool(x):
    """2x2 VALID max pooling written independently: crop, reshape, reduce (JAX's own gradient,
    which shares the gradient of a window among its tied maxima)."""
    *lead, h, w, c = x.shape
    x = x[..., : h // 2 * 2, : w // 2 * 2, :].reshape(*lead, h // 2, 2, w // 2, 2, c)
    return x.max(axis=(-4, -2))


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (1, 7, 9, 2), (3, 28, 28, 16), (4, 2, 6, 6, 5)])
def test_max_pool_gradient_equals_autodiff_of_a_reshape_and_max_with_ties(shape):
    """Bit for bit, ties included (a constant region, as MNIST's background gives after a
    convolution's bias and a ReLU), on odd sizes (dropped rows get no gradient) and with a
    leading client axis, plainly and vmapped."""
    x = np.array(jax.random.normal(jax.random.key(1), shape))
    x[..., :4, :, :] = 0.25  # windows of four equal values
    x[..., 4:, ::3, :] = 0.0
    x = jnp.asarray(x)
    g = jax.random.normal(jax.random.key(2), _reference_pool(x).shape)
    expected = jax.vjp(_reference_pool, x)[1](g)[0]
    pooled, pullback = jax.vjp(max_pool_2x2, x)  # training's forward pass (the corners)
    np.testing.assert_array_equal(pooled, _reference_pool(x))
    np.testing.assert_array_equal(pullback(g)[0], expected)
    np.testing.assert_array_equal(jax.jit(lambda x, g: jax.vjp(max_pool_2x2, x)[1](g)[0])(x, g),
                                  expected)
    vmapped = jax.vmap(lambda x, g: jax.vjp(max_pool_2x2, x)[1](g)[0])(x, g)
    np.testing.assert_array_equal(vmapped, expected)


def test_max_pool_gradient_of_a_tied_window_is_shared_by_hand():
    x = jnp.array([[1.0, 1.0], [0.5, 1.0]]).reshape(1, 2, 2, 1)
    grad = jax.grad(lambda x: 6.0 * max_pool_2x2(x).sum())(x)
    np.testing.assert_array_equal(grad.reshape(2, 2), [[2.0, 2.0], [0.0, 2.0]])


def _count(tree):
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("arch,conv2,fc1", [("cnn1", 32, 2000), ("cnn2", 16, 2000),
                                            ("cnn3", 32, 1000), ("cnn4", 32, 800),
                                            ("cnn5", 32, 500)])
def test_published_cnn_sizes_on_cifar_shapes(arch, conv2, fc1):
    model = architectures.client_model(arch, 10, 128, IMAGE_RGB)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    # 32 -conv5-> 28 -pool-> 14 -conv5-> 10 -pool-> 5: flatten 5*5*conv2.
    expected_backbone = ((5 * 5 * 3 * 16 + 16) + (5 * 5 * 16 * conv2 + conv2)
                         + (25 * conv2 * fc1 + fc1) + (fc1 * 500 + 500))
    assert _count(params["backbone"]) == expected_backbone
    assert _count(params["classifier"]) == 500 * 10 + 10
    assert _count(params["projection"]) == 500 * 128 + 128


def _spec_and_input(modality):
    if modality == "image":
        return IMAGE_GRAY, jnp.ones((4, 28, 28, 1))
    if modality == "tabular":
        return TABULAR, jnp.ones((4, 5))
    ids = np.zeros((4, 12), np.int32)
    ids[0, :7] = np.arange(2, 9)
    ids[1, :12] = 3
    ids[2, :1] = 49  # row 3 stays all padding (a padded sample)
    return TEXT, jnp.asarray(ids)


@pytest.mark.parametrize("arch", sorted(a for a in BACKBONES if not BACKBONES[a].batch_norm))
def test_every_client_model_returns_logits_and_projected_features(arch):
    modality = BACKBONES[arch].modalities[-1]
    spec, x = _spec_and_input(modality)
    model = architectures.client_model(arch, 7, 16, spec)
    logits, e_local = model.apply(model.init(jax.random.key(0), spec.dummy_batch()), x)
    assert logits.shape == (4, 7) and e_local.shape == (4, 16)
    assert np.all(np.isfinite(np.asarray(logits)))  # also for the all-padding text row
    assert np.all(np.asarray(e_local) >= 0)  # Linear + ReLU projection


def test_batch_norm_backbones_are_refused_by_the_projected_models():
    spec, _ = _spec_and_input("image")
    with pytest.raises(ValueError, match="config.clients.architectures: 'convnet3_bn' has "
                                         "BatchNorm layers.*fedbn"):
        architectures.client_model("convnet3_bn", 7, 16, spec)
    with pytest.raises(ValueError, match="BatchNorm"):
        architectures.projected_classifier("convnet3_bn", 7, 16, spec)


@pytest.mark.parametrize("arch", sorted(PROXY_BODIES))
def test_every_proxy_extractor_maps_its_modality_to_d(arch):
    spec, x = _spec_and_input(PROXY_BODIES[arch].modalities[-1])
    proxy = architectures.proxy_model(arch, 9, spec)
    out = proxy.apply(proxy.init(jax.random.key(0), spec.dummy_batch()), x)
    assert out.shape == (4, 9) and np.all(np.isfinite(np.asarray(out)))


def test_text_models_ignore_padding_tokens():
    """Appending padding must not change a bag or CNN text model's output (masked pooling)."""
    short = jnp.asarray([[5, 9, 17, 0, 0, 0]], jnp.int32)
    longer = jnp.asarray([[5, 9, 17, 0, 0, 0, 0, 0, 0]], jnp.int32)
    for arch in ("embedbag", "text_cnn"):
        model = architectures.client_model(arch, 3, 8, TEXT)
        params = model.init(jax.random.key(0), short)
        np.testing.assert_allclose(model.apply(params, short)[0], model.apply(params, longer)[0],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~4 s
def test_text_transformer_output_does_not_depend_on_tokens_behind_padding_mask():
    model = architectures.client_model("text_transformer", 3, 8, TEXT)
    a = jnp.asarray([[5, 9, 17, 0, 0, 0]], jnp.int32)
    params = model.init(jax.random.key(0), a)
    """Padded positions must not reach real ones through attention: the same model on the
    sequence with its padding cut off (positions aligned) gives the same output."""
    logits_full = model.apply(params, a)[0]
    trimmed = {"params": dict(params["params"])}
    backbone = dict(trimmed["params"]["backbone"])
    backbone["pos_embed"] = backbone["pos_embed"][:, :3]
    trimmed["params"]["backbone"] = backbone
    logits_trim = model.apply(trimmed, a[:, :3])[0]
    np.testing.assert_allclose(logits_full, logits_trim, rtol=1e-4, atol=1e-5)


def test_image_normalization_puts_uint8_and_both_float_ranges_on_one_scale():
    x01 = jax.random.uniform(jax.random.key(1), (5, 8, 8, 3))
    spec = InputSpec("image", (8, 8, 3), "float32", (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    norm = InputNormalization(spec)
    out01 = norm.apply({}, x01)
    out255 = norm.apply({}, x01 * 255.0)
    x_uint8 = np.round(np.asarray(x01) * 255).astype(np.uint8)
    out_uint8 = norm.apply({}, jnp.asarray(x_uint8))
    np.testing.assert_allclose(out01, out255, rtol=1e-5, atol=1e-5)
    expected = (np.asarray(x01) - np.array([0.4, 0.5, 0.6])) / np.array([0.2, 0.25, 0.3])
    np.testing.assert_allclose(out01, expected, rtol=1e-5, atol=1e-5)
    expected_uint8 = (x_uint8 / 255.0 - np.array([0.4, 0.5, 0.6])) / np.array([0.2, 0.25, 0.3])
    np.testing.assert_allclose(out_uint8, expected_uint8, rtol=1e-5, atol=1e-5)


def test_tabular_normalization_standardizes_without_range_detection():
    x = np.array([[1000.0, 2.0], [3000.0, 4.0]], np.float32)  # large values stay large
    spec = InputSpec("tabular", (2,), "float32", (2000.0, 3.0), (1000.0, 1.0))
    np.testing.assert_allclose(InputNormalization(spec).apply({}, jnp.asarray(x)),
                               [[-1.0, -1.0], [1.0, 1.0]])


def test_unknown_model_names_are_rejected_with_the_field():
    with pytest.raises(ValueError, match=r"config.clients.architectures: unknown model 'resnet'"):
        architectures.client_model("resnet", 10, 8, IMAGE_GRAY)
    with pytest.raises(ValueError, match=r"config.proxy_arch: unknown proxy extractor"):
        architectures.proxy_model("big", 8, IMAGE_GRAY)


def test_model_of_another_modality_is_rejected_with_the_alternatives():
    with pytest.raises(ValueError, match=r"model 'cnn1' takes image inputs but the dataset is "
                                         r"text; text models: \['embedbag'"):
        architectures.client_model("cnn1", 4, 8, TEXT)
    with pytest.raises(ValueError, match=r"proxy extractor 'proxy_cnn' takes image inputs but "
                                         r"the dataset is tabular"):
        architectures.proxy_model("proxy_cnn", 8, TABULAR)


def test_client_model_and_proxy_see_the_same_inputs_whatever_the_client_pixel_range():
    """Clients storing uint8 [0, 255], float [0, 255] or float [0, 1] pixels get identical
    outputs from their model and from E_proxy (one normalization, seed section 3.1)."""
    spec = InputSpec("image", (28, 28, 1), "uint8", (0.13,), (0.31,))
    pixels = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 1)).astype(np.uint8)
    views = [jnp.asarray(pixels), jnp.asarray(pixels, jnp.float32),
             jnp.asarray(pixels / 255.0, jnp.float32)]
    model = architectures.client_model("convnet3", 10, 8, spec)
    proxy = architectures.proxy_model("proxy_cnn", 8, spec)
    model_params = model.init(jax.random.key(0), spec.dummy_batch())
    proxy_params = proxy.init(jax.random.key(1), spec.dummy_batch())
    reference_logits, _ = model.apply(model_params, views[0])
    reference_proxy = proxy.apply(proxy_params, views[0])
    for x in views[1:]:
        np.testing.assert_allclose(model.apply(model_params, x)[0], reference_logits,
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(proxy.apply(proxy_params, x), reference_proxy,
                                   rtol=1e-4, atol=1e-5)
