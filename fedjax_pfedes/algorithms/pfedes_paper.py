"""The published pFedES: a shared image-to-image proxy G in front of each client's own model.

Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing for Model Heterogeneous
Personalized Federated Learning", AAAI 2025 (public code LipingYi/pFedES). The shared G is
conv3x3 C->8, ReLU, conv3x3 8->C, ReLU (443 parameters for RGB). Each client k keeps its
classifier F_k (e.g. CNN-1..CNN-5). On every local batch (x, y), alternating:

1. G frozen: F_k takes one SGD step on (1 - mu) * CE(F_k(x), y) + mu * CE(F_k(G(x)), y).
2. F_k frozen (its new parameters): G takes one SGD step on CE(F_k(G(x)), y).

Only G is uploaded; the server takes the plain sample-weighted average (no momentum). Inference
uses F_k(x) alone. Image data only. Unlike the feature-alignment variant (`pfedes.py`), there is no
projection head and no feature alignment: G is trained through each client's own classifier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes import aggregation, local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram, LocalTrainingConfig
from fedjax_pfedes.algorithms.fedavg import evaluate_classifier
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.models import registry


@dataclasses.dataclass(frozen=True)
class PFedESPaperConfig(LocalTrainingConfig):
    """Hyper-parameters of the published pFedES (mu = 0.5 as published)."""

    mu: float = 0.5
    g_lr_ratio: float = 1.0
    lr_local: float = 0.01
    batch_size: int = 64


@struct.dataclass
class ServerState:
    g_params: dict
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    params: dict
    opt_state: optax.OptState


def pfedes_paper(cfg: PFedESPaperConfig) -> Algorithm:
    """Builds the published pFedES."""
    if cfg.input_spec.modality != "image":
        raise ValueError("config.algorithm='pfedes_paper' needs image data (its proxy G is an "
                         f"image-to-image network); the dataset is {cfg.input_spec.modality}")
    g_model = registry.ImageProxyG(cfg.input_spec)
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    lr_g = cfg.g_lr_ratio * cfg.lr_local
    dummy_x = cfg.input_spec.dummy_batch()

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del archs
        return ServerState(g_model.init(rng, dummy_x), jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.g_params

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        average, total = aggregation.weighted_mean(list(groups.values()))
        new = local_training.select_tree(total > 0, average, state.g_params)
        return ServerState(new, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = registry.classifier_model(arch, cfg.num_classes, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def train_step(carry, batch):
            params, opt_state, g_params = carry
            x, y, mask = batch
            gx = jax.lax.stop_gradient(g_model.apply(g_params, x))  # G frozen in step 1

            def f_loss(p):
                ce_x = local_training.cross_entropy(model.apply(p, x), y, mask)
                ce_gx = local_training.cross_entropy(model.apply(p, gx, True), y, mask)
                return (1.0 - cfg.mu) * ce_x + cfg.mu * ce_gx, ce_x

            f_grads, ce_x = jax.grad(f_loss, has_aux=True)(params)
            updates, opt_state = local_opt.update(f_grads, opt_state, params)
            params = optax.apply_updates(params, updates)

            frozen = jax.lax.stop_gradient(params)  # F_k frozen in step 2

            def g_loss(q):
                logits = model.apply(frozen, g_model.apply(q, x), True)
                return local_training.cross_entropy(logits, y, mask)

            ce_g, g_grads = jax.value_and_grad(g_loss)(g_params)
            g_params = jax.tree.map(lambda q, g: q - lr_g * g, g_params, g_grads)
            return (params, opt_state, g_params), jnp.stack([ce_x, ce_g])

        def client_update(global_g, state: ClientState, data, rng):
            (params, opt_state, local_g), sums, n_active = local_training.run_local_epochs(
                train_step, (state.params, state.opt_state, global_g), data, rng,
                cfg.batch_size, cfg.local_epochs, cfg.unroll_local_steps)
            n = jnp.maximum(n_active, 1.0)
            delta = jax.tree.map(jnp.subtract, local_g, global_g)
            metrics = {"train_ce_loss": sums[0] / n, "train_g_ce_loss": sums[1] / n,
                       "local_steps": n_active, "update_norm": optax.tree.norm(delta)}
            return local_g, ClientState(params, opt_state), metrics

        def evaluate(global_g, state: ClientState, test, global_x, global_y):
            del global_g  # inference uses F_k(x) alone
            return evaluate_classifier(model.apply, state.params, test, global_x, global_y)

        return CohortProgram(init_client, client_update, evaluate)

    return Algorithm("pfedes_paper", init_server, broadcast, broadcast, server_update,
                     cohort_program)

def _build(inputs: BuildInputs) -> Algorithm:
    return pfedes_paper(PFedESPaperConfig(**inputs.local_training(),
                                          **inputs.config.pfedes_paper.to_dict()))


def _check(config) -> None:
    section = config.pfedes_paper
    if not 0 <= section.mu <= 1:
        raise ValueError(f"config.pfedes_paper.mu must be in [0, 1], got {section.mu}")
    if not section.g_lr_ratio > 0:
        raise ValueError(f"config.pfedes_paper.g_lr_ratio must be > 0, got {section.g_lr_ratio}")


register(AlgorithmEntry(
    "pfedes_paper", _build, asynchronous=True, check=_check, modalities=("image",),
    private_optimizer=True,
    summary="published pFedES (Yi et al., AAAI 2025): a shared image-to-image proxy G"))
