"""How much one client's upload reveals: a gradient-inversion attack and its image quality.

The attack is "Inverting Gradients" (Geiping et al., NeurIPS 2020), the optimization-based
successor of DLG (Zhu et al., "Deep Leakage from Gradients", NeurIPS 2019): the server knows the
model and the client's labels (the paper's threat model; iDLG recovers single labels from the
last layer anyway) and searches for inputs whose gradient has the highest cosine similarity with
the observed one, with a total-variation prior. The observed upload is a FedSGD-style update
(one local step, upload = -lr * gradient, so the gradient is known up to scale) of the whole client
model — the most revealing upload a federated method can send.

Three views of the same client:
- `none`: the client's own gradient;
- `dp`: clipped to C and noised with N(0, (sigma C)^2) (the client-level DP release of one client);
- `secagg`: only the sum of this client's and other clients' gradients (secure aggregation).
Reconstruction quality is PSNR and SSIM against the client's real image, in [0, 1] pixels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pfedes.algorithms import local_training


@dataclasses.dataclass(frozen=True)
class AttackConfig:
    steps: int = 400
    learning_rate: float = 0.1
    tv_weight: float = 1e-3
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    secagg_clients: int = 2


def gradient(model, params, x, y):
    """The client's gradient of the mean cross-entropy on (x, y)."""
    mask = jnp.ones(y.shape[0], bool)
    return jax.grad(lambda p: local_training.cross_entropy(model.apply(p, x), y, mask))(params)


def _flat(tree) -> jnp.ndarray:
    return jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(tree)])


def total_variation(x: jnp.ndarray) -> jnp.ndarray:
    """Mean absolute difference between neighbouring pixels (images [B, H, W, C])."""
    return (jnp.mean(jnp.abs(x[:, 1:] - x[:, :-1])) + jnp.mean(jnp.abs(x[:, :, 1:] - x[:, :, :-1])))


def invert(model, params, observed, y, shape, rng: jax.Array, cfg: AttackConfig) -> jnp.ndarray:
    """Images in [0, 1] whose gradient best matches `observed` (cosine + TV prior, Adam)."""
    target = _flat(observed)
    opt = optax.adam(cfg.learning_rate)

    def loss(z):
        x = jax.nn.sigmoid(z)  # keeps pixels in [0, 1]
        g = _flat(gradient(model, params, x, y))
        cos = jnp.dot(g, target) / (jnp.linalg.norm(g) * jnp.linalg.norm(target) + 1e-12)
        return 1.0 - cos + cfg.tv_weight * total_variation(x)

    @jax.jit
    def run(z0):
        def step(carry, _):
            z, state = carry
            g = jax.grad(loss)(z)
            updates, state = opt.update(g, state, z)
            return (optax.apply_updates(z, updates), state), None

        (z, _), _ = jax.lax.scan(step, (z0, opt.init(z0)), None, length=cfg.steps)
        return jax.nn.sigmoid(z)

    return run(0.5 * jax.random.normal(rng, shape))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for images in [0, 1]."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray, window: int = 7) -> float:
    """Mean SSIM (Wang et al., IEEE TIP 2004) over channels with a uniform window, [0, 1] range."""
    from scipy.ndimage import uniform_filter

    c1, c2 = 0.01 ** 2, 0.03 ** 2
    vals = []
    for ch in range(a.shape[-1]):
        x, y = np.asarray(a[..., ch], np.float64), np.asarray(b[..., ch], np.float64)
        mx, my = uniform_filter(x, window), uniform_filter(y, window)
        vx = uniform_filter(x * x, window) - mx * mx
        vy = uniform_filter(y * y, window) - my * my
        cxy = uniform_filter(x * y, window) - mx * my
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
        vals.append(s.mean())
    return float(np.mean(vals))


def observed_uploads(model, params, images: np.ndarray, labels: np.ndarray, victim: int,
                     rng: jax.Array, cfg: AttackConfig) -> dict[str, tuple[object, np.ndarray]]:
    """What the server sees of client `victim` (one image per client) under each protection,
    with the labels the attacker assumes: its own for `none` and `dp`; under `secagg` the labels
    of all summed clients (the attacker reconstructs one image per summed client, the strongest
    variant)."""
    grads = [gradient(model, params, jnp.asarray(images[i:i + 1]), jnp.asarray(labels[i:i + 1]))
             for i in range(len(images))]
    own = grads[victim]
    clipped, _ = _clip(own, cfg.clip_norm)
    leaves, treedef = jax.tree.flatten(clipped)
    keys = jax.random.split(rng, len(leaves))
    noisy = jax.tree.unflatten(treedef, [
        a + cfg.noise_multiplier * cfg.clip_norm * jax.random.normal(k, a.shape)
        for a, k in zip(leaves, keys, strict=True)])
    others = [i for i in range(len(images)) if i != victim][: cfg.secagg_clients - 1]
    summed = jax.tree.map(lambda *xs: sum(xs), own, *[grads[i] for i in others])
    return {"none": (own, labels[victim:victim + 1]),
            "dp": (noisy, labels[victim:victim + 1]),
            "secagg": (summed, labels[[victim, *others]])}


def _clip(tree, clip_norm):
    norm = jnp.sqrt(sum(jnp.sum(a ** 2) for a in jax.tree.leaves(tree)))
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda a: a * scale, tree), norm
