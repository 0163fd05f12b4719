"""On-device augmentation (`fedjax_pfedes/data/augmentation.py`): each transform against its
definition, by hand; the same batches under the rolled loop, the unrolled scan, loop and vmap;
and the config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.data import augmentation
from fedjax_pfedes.data.federated import ClientArrays

H, W, C = 6, 5, 2


def _images(n=3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.05, 1.0, size=(n, H, W, C))  # no zero pixel: padding is recognizable
    return jnp.asarray((x * 255).round().astype(np.uint8) if dtype == np.uint8 else
                       x.astype(dtype))


def _candidates(image):
    """Every crop of the zero-padded image at an offset in [0, 8]^2, and its mirror."""
    padded = np.pad(np.asarray(image), ((4, 4), (4, 4), (0, 0)))
    out = []
    for dy in range(9):
        for dx in range(9):
            crop = padded[dy:dy + H, dx:dx + W]
            out += [crop, crop[:, ::-1]]
    return out


def test_crop_flip_gives_one_of_the_81_padded_crops_or_its_mirror():
    x = _images()
    for k in range(20):
        got = np.asarray(augmentation.augment(x, jax.random.key(k), "crop_flip", (0.5, 0.5)))
        for i in range(len(x)):
            assert any(np.array_equal(got[i], c) for c in _candidates(x[i])), (k, i)


def test_crop_offsets_and_flips_are_uniform_and_fair():
    """Over 2000 draws: the offsets' mean is 4 per axis, flips happen half the time."""
    x = jnp.asarray(np.arange(H * W, dtype=np.float32).reshape(1, H, W, 1) + 1.0)
    keys = jax.random.split(jax.random.key(0), 2000)
    got = np.asarray(jax.vmap(lambda k: augmentation.augment(x, k, "crop_flip", (0.0,)))(keys))
    # Recover each draw's offset and flip by matching it against every candidate.
    original = np.asarray(x[0, :, :, 0])
    dys, flips = [], []
    for g in got[:, 0, :, :, 0]:
        for dy in range(9):
            for dx in range(9):
                crop = np.pad(original, 4)[dy:dy + H, dx:dx + W]
                if np.array_equal(g, crop):
                    dys.append(dy), flips.append(0)
                elif np.array_equal(g, crop[:, ::-1]):
                    dys.append(dy), flips.append(1)
    assert len(dys) == 2000
    assert np.mean(dys) == pytest.approx(4.0, abs=0.2)
    assert np.mean(flips) == pytest.approx(0.5, abs=0.04)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_erasing_fills_one_rectangle_with_the_mean_half_the_time(dtype):
    """The published code's RandomErasing(scale=(0.04, 0.2), ratio=(0.5, 2)) on a normalized
    image, value 0: here the raw-pixel mean."""
    x = jnp.asarray(np.full((1, 32, 32, 3), 1.0, np.float32) if dtype == np.float32 else
                    np.full((1, 32, 32, 3), 255, np.uint8))
    mean = (0.25, 0.5, 0.75)
    fill = np.round(np.array(mean) * 255).astype(np.uint8) if dtype == np.uint8 else \
        np.array(mean, np.float32)
    keys = jax.random.split(jax.random.key(1), 400)
    erased_share, applied = [], 0
    erase = jax.jit(augmentation._erase)
    for k in keys:
        out = np.asarray(erase(x[0], k, jnp.asarray(fill)))
        hit = np.all(out == fill, axis=-1)
        untouched = np.all(out == np.asarray(x[0]), axis=-1)
        assert np.all(hit | untouched)
        if hit.any():
            applied += 1
            rows, cols = np.flatnonzero(hit.any(1)), np.flatnonzero(hit.any(0))
            assert hit[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].all()  # one rectangle
            height, width = rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1
            assert 0.5 / 1.3 <= height / width <= 2.0 * 1.3  # ratio in [0.5, 2], rounded
            erased_share.append(hit.mean())
    assert applied / 400 == pytest.approx(0.5, abs=0.08)
    # area share ~ U(0.04, 0.2): mean 0.12, rounding to whole pixels aside
    assert 0.10 < np.mean(erased_share) < 0.14
    assert 0.03 <= min(erased_share) and max(erased_share) <= 0.23


def test_the_published_recipe_pads_its_crop_with_the_mean():
    """flip_erase_crop crops last, padding with 0 after normalization: the mean in raw pixels."""
    x = jnp.full((1, H, W, 2), 0.9, jnp.float32)
    keys = jax.random.split(jax.random.key(2), 200)
    values = set()
    for k in keys:
        out = np.asarray(augmentation.augment(x, k, "flip_erase_crop", (0.25, 0.5)))
        values |= {tuple(round(float(c), 4) for c in v) for v in out.reshape(-1, 2)}
    assert values <= {(0.9, 0.9), (0.25, 0.5)}  # image, or the mean (padding or erased)
    assert (0.25, 0.5) in values


def _step(carry, batch):
    x = batch[0]
    return carry + jnp.sum(x.reshape(x.shape[0], -1) * jnp.arange(H * W * C), axis=1).sum(), \
        jnp.zeros(1)


def test_the_same_augmented_batches_under_rolled_unrolled_loop_and_vmap():
    rng = np.random.default_rng(3)
    x = rng.uniform(0.1, 1, size=(2, 11, H, W, C)).astype(np.float32)
    data = ClientArrays(jnp.asarray(x), jnp.zeros((2, 11), jnp.int32),
                        jnp.asarray([11, 6], jnp.int32))
    keys = jax.random.split(jax.random.key(5), 2)

    def run(unroll, client, key, kind="flip_erase_crop"):
        plan = local_training.LocalSchedule(4, 2, unroll, False, kind, (0.3, 0.6))
        return local_training.run_local_epochs(_step, jnp.float32(0), client, key, plan)[0]

    rolled = jax.jit(jax.vmap(lambda c, k: run(False, c, k)))(data, keys)
    unrolled = jax.jit(jax.vmap(lambda c, k: run(True, c, k)))(data, keys)
    one = [jax.jit(run, static_argnums=0)(False, jax.tree.map(lambda a, i=i: a[i], data),
                                           keys[i]) for i in range(2)]
    np.testing.assert_allclose(rolled, unrolled, rtol=1e-6)
    np.testing.assert_allclose(rolled, one, rtol=1e-6)
    plain = jax.jit(jax.vmap(lambda c, k: run(False, c, k, "none")))(data, keys)
    assert not np.allclose(rolled, plain)  # augmentation changed the batches


def test_augment_is_checked_naming_the_field():
    from configs import quickstart
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    config = quickstart.get_config()
    config.train.augment = "mixup"
    with pytest.raises(ConfigError, match="config.train.augment must be one of"):
        validate_config(config)
    with pytest.raises(ValueError, match="config.train.augment='crop_flip' is for images"):
        augmentation.check("crop_flip", "tabular")
