"""Pretraining E_proxy on the public share of the data (`config.data.public_fraction`).

Supervised: E_proxy followed by a linear classifier head, trained with SGD on cross-entropy over
the public samples, which no client owns (`data.public`). Only E_proxy is kept; the head is a
probe whose accuracy on the global test set is reported. A run then starts from it with
`config.proxy_init` (`algorithms/pfedes/__init__.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from tqdm.auto import tqdm

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.pfedes import parse_scales, pool_of, proxy_init
from fedjax_pfedes.data.sources import CentralDataset
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class PretrainSettings:
    """How E_proxy is pretrained (flags of `launch.pretrain_proxy`)."""

    epochs: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64

    def __post_init__(self):
        for name, ok in (("epochs", self.epochs >= 1), ("lr", self.lr > 0),
                         ("momentum", 0 <= self.momentum < 1),
                         ("batch_size", self.batch_size >= 1)):
            if not ok:
                raise ConfigError(f"--{name}={getattr(self, name)} is out of range")


def pretrain_proxy(view: ml_collections.FrozenConfigDict, settings: PretrainSettings,
                   central: CentralDataset, pool: tuple[np.ndarray, np.ndarray],
                   show_progress: bool = True) -> tuple[Any, dict]:
    """Trains E_proxy (config.proxy_arch, config.proxy_dim) with a linear head on the public
    share.

    Args:
      view: pFedES's view of the run's config (`engine.sections.method_settings(config,
        'pfedes')`: proxy_arch, proxy_dim, proxy_scales, seed and the pool's fields), the
        config validated against `central`.
      settings: epochs, learning rate, momentum and batch size of the pretraining.
      central: the dataset (its input spec, class count and global test set).
      pool: the public share (x, y), held out of every client's data
        (`fedjax_pfedes.engine.build.load_validated_pool` returns `central` and `pool`).
      show_progress: a progress bar over epochs.

    Returns:
      (E_proxy parameters, a report with accuracies and sample counts).
    """
    x, y = pool
    if len(y) == 0:
        raise ConfigError("config.data.public_fraction is 0: there is no public data to pretrain "
                          "E_proxy on (e.g. --config.data.public_fraction=0.1)")
    spec = central.input_spec
    scales = len(parse_scales(view.proxy_scales))
    proxy = architectures.proxy_model(view.proxy_arch, view.proxy_dim, spec, scales)
    head = nn.Dense(central.num_classes)
    k_proxy, k_head = jax.random.split(jax.random.fold_in(jax.random.key(view.seed), 31))
    params = (proxy.init(k_proxy, spec.dummy_batch()),
              head.init(k_head, jnp.zeros((1, view.proxy_dim))))
    optimizer = local_training.sgd(settings.lr, settings.momentum)
    opt_state = optimizer.init(params)

    def logits_of(p, xb):  # the probe reads E_proxy's usual output (scale 0)
        e = proxy.apply(p[0], xb)
        return head.apply(p[1], e[:, 0] if scales > 1 else e)

    @jax.jit
    def step(p, s, xb, yb):
        loss, grads = jax.value_and_grad(lambda q: jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(logits_of(q, xb), yb)))(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    @jax.jit
    def correct(p, xb, yb):
        return jnp.sum(jnp.argmax(logits_of(p, xb), -1) == yb)

    def accuracy(p, xs, ys):
        hits = sum(int(correct(p, xs[i:i + 512], ys[i:i + 512])) for i in range(0, len(ys), 512))
        return hits / max(len(ys), 1)

    rng = np.random.default_rng([view.seed, 31])
    batch = min(settings.batch_size, len(y))
    losses = []
    bar = tqdm(range(settings.epochs), desc="pretraining E_proxy", disable=not show_progress)
    for _ in bar:
        order = rng.permutation(len(y))
        epoch_losses = []
        for i in range(0, len(order) - batch + 1, batch):  # full batches: one compiled shape
            rows = order[i:i + batch]
            params, opt_state, loss = step(params, opt_state, jnp.asarray(x[rows]),
                                           jnp.asarray(y[rows]))
            epoch_losses.append(float(loss))
        losses.append(float(np.mean(epoch_losses)))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if not np.isfinite(losses[-1]):
            raise ConfigError(f"pretraining diverged at epoch {len(losses)} (loss "
                              f"{losses[-1]}); lower --lr")
    report = {
        "public_samples": int(len(y)),
        "epochs": settings.epochs,
        "loss_per_epoch": losses,
        "public_accuracy": accuracy(params, x, y),
        "global_test_accuracy_linear_probe": accuracy(params, central.x_test, central.y_test),
        "settings": dataclasses.asdict(settings),
    }
    return params[0], report


def save_pretrained(path: str, view: ml_collections.FrozenConfigDict, params: Any,
                    report: dict) -> None:
    """Writes the E_proxy file `config.proxy_init` reads, with what it is and was trained on.

    Args:
      path: the file to write.
      view: pFedES's view of the run's config, as `pretrain_proxy` takes it.
      params: E_proxy's parameters.
      report: what `pretrain_proxy` reports.
    """
    proxy_init.save(path, params, {
        "proxy_arch": view.proxy_arch, "proxy_dim": view.proxy_dim,
        "pool": pool_of(view), "report": report})
