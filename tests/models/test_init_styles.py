"""PyTorch-style initialization (`fedjax_pfedes/models/init_styles.py`) against PyTorch's
documented defaults, counted by hand: Linear and Conv2d weights and biases ~ U(-1/sqrt(fan_in),
1/sqrt(fan_in)), embeddings ~ N(0, 1), other collections untouched."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.models import init_styles


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
        h = nn.Conv(16, (5, 5), name="conv")(x)            # fan_in 3 * 5 * 5 = 75
        h = nn.BatchNorm(use_running_average=False, name="bn")(h)
        h = nn.Dense(300, name="fc")(h.reshape(h.shape[0], -1)[:, :400])  # fan_in 400
        return h + nn.Embed(50, 300, name="emb")(ids).sum(1)


def _variables():
    x, ids = jnp.zeros((2, 8, 8, 3)), jnp.zeros((2, 4), jnp.int32)
    return Net().init(jax.random.key(0), x, ids)


def test_pytorch_style_draws_within_the_documented_bounds():
    v = init_styles.reinitialize(_variables(), jax.random.key(1), "pytorch")
    p = v["params"]
    for layer, fan_in in (("conv", 75), ("fc", 400)):
        bound = 1 / np.sqrt(fan_in)
        for leaf in ("kernel", "bias"):
            w = np.asarray(p[layer][leaf])
            # within the bound, and spread over it (Flax's biases start at 0)
            assert np.abs(w).max() <= bound and np.abs(w).max() > 0.5 * bound, (layer, leaf)
        k = np.asarray(p[layer]["kernel"])
        assert k.std() == pytest.approx(bound / np.sqrt(3), rel=0.1)  # std of U(-b, b)
    emb = np.asarray(p["emb"]["embedding"])
    assert emb.mean() == pytest.approx(0.0, abs=0.02) and emb.std() == pytest.approx(1.0, 0.03)
    np.testing.assert_array_equal(p["bn"]["scale"], 1.0)          # norm layers as PyTorch's
    assert "batch_stats" in v                                      # other collections kept
    again = init_styles.reinitialize(_variables(), jax.random.key(1), "pytorch")
    jax.tree.map(np.testing.assert_array_equal, v, again)          # deterministic


def test_flax_style_is_the_identity_and_unknown_styles_are_refused():
    v = _variables()
    assert init_styles.reinitialize(v, jax.random.key(1), "flax") is v
    with pytest.raises(ValueError, match="init style must be one of"):
        init_styles.reinitialize(v, jax.random.key(1), "keras")


def test_pfedes_paper_checks_its_init_field():
    from configs import quickstart
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    config = quickstart.get_config()
    config.algorithm, config.data.name = "pfedes_paper", "digits"
    config.pfedes_paper.init = "torch"
    with pytest.raises(ConfigError, match="config.pfedes_paper.init must be one of"):
        validate_config(config)
