"""FedProto: clients share class prototypes instead of model parameters.

Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022.
Every client model is F_k -> P_k (to a common dimension d) -> H_k, all private. A local step
minimizes CE(H_k(e), y) + lam * mean_d (e - global_prototype[y])^2 (the authors' MSE;
mean over the samples whose class has a global prototype), e = P_k(F_k(x)). After E local epochs
a participant uploads its class prototypes (mean e per class over its training data) and
per-class counts; the server's
prototype of class c is the count-weighted mean over clients holding c (classes nobody has
uploaded keep their previous prototype). Inference, as in the paper, assigns each sample to the
nearest global prototype (over classes that have one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import (
    Algorithm,
    CohortProgram,
    LocalTrainingConfig,
    classifier_program,
)
from fedjax_pfedes.algorithms.lg_fedavg import ClientState
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Section, at_least, param
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class FedProtoSection(Section):
    """`config.fedproto`."""

    SECTION: ClassVar[str] = "fedproto"

    lam: float = param(1.0, "weight of the prototype term mean_d (e - global prototype[y])^2",
                       at_least(0))


@dataclasses.dataclass(frozen=True)
class FedProtoConfig(FedProtoSection, LocalTrainingConfig):
    """FedProto's settings: its section, local training and

    Attributes:
      dim: the dimension d of the prototype space (config.proxy_dim).
    """

    dim: int = 128


def _config(inputs: BuildInputs) -> FedProtoConfig:
    return FedProtoConfig(**inputs.local_training(), **inputs.own(),
                          dim=inputs.settings.proxy_dim)


@struct.dataclass
class ServerState:
    prototypes: jnp.ndarray  # [classes, d]
    available: jnp.ndarray   # [classes] bool: some client has uploaded this class
    round: jnp.ndarray


def class_prototypes(embeddings: jnp.ndarray, labels: jnp.ndarray, mask: jnp.ndarray,
                     num_classes: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Mean embedding per class over the real samples, and the per-class counts."""
    onehot = jax.nn.one_hot(labels, num_classes) * mask[:, None].astype(jnp.float32)
    counts = onehot.sum(axis=0)
    sums = onehot.T @ embeddings.astype(jnp.float32)
    return sums / jnp.maximum(counts, 1.0)[:, None], counts


def nearest_prototype(embeddings: jnp.ndarray, prototypes: jnp.ndarray, available: jnp.ndarray
                      ) -> jnp.ndarray:
    """Index of the closest available prototype (squared Euclidean distance) per sample."""
    return jnp.argmax(prototype_logits(embeddings, prototypes, available), axis=-1)


def prototype_logits(embeddings: jnp.ndarray, prototypes: jnp.ndarray, available: jnp.ndarray
                     ) -> jnp.ndarray:
    """Negative squared distances to the available prototypes (-inf-like for missing classes):
    argmax is the nearest prototype, softmax gives the CE reported as test_ce_loss."""
    d2 = jnp.sum((embeddings[:, None, :] - prototypes[None]) ** 2, axis=-1)
    return jnp.where(available[None], -d2, -1e9)


def fedproto(cfg: FedProtoConfig) -> Algorithm:
    """Builds FedProto for heterogeneous cohorts."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del rng, archs
        return ServerState(jnp.zeros((cfg.num_classes, cfg.dim), jnp.float32),
                           jnp.zeros((cfg.num_classes,), bool), jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"prototypes": state.prototypes, "available": state.available}

    def upload_template(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"prototypes": state.prototypes,
                "counts": jnp.zeros((cfg.num_classes,), jnp.float32)}

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        mean, total = aggregation.class_weighted_mean(
            [(u["prototypes"], u["counts"], w) for u, w in groups.values()])
        seen = total > 0
        return ServerState(jnp.where(seen[:, None], mean, state.prototypes),
                           state.available | seen, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.projected_classifier(arch, cfg.num_classes, cfg.dim, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def client_update(global_protos, state: ClientState, data, rng):
            protos, available = global_protos["prototypes"], global_protos["available"]

            def train_step(carry, batch):
                params, opt_state = carry
                x, y, mask = batch

                def loss_fn(p):
                    logits, e = model.apply(p, x)
                    ce = local_training.cross_entropy(logits, y, mask)
                    has = mask & available[y]
                    # Mean over the d dimensions, as the authors' code (nn.MSELoss); the sum
                    # over d made the term d times larger and the quick start diverge.
                    dist = jnp.mean((e - protos[y]) ** 2, axis=-1)
                    return ce + cfg.lam * local_training.masked_mean(dist, has), ce

                grads, ce = jax.grad(loss_fn, has_aux=True)(params)
                updates, opt_state = local_opt.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), jnp.stack([ce])

            (params, opt_state), sums, n_active = local_training.run_local_epochs(
                train_step, (state.params, state.opt_state), data, rng, cfg.local_schedule())
            _, e = model.apply(params, data.x)
            mask = jnp.arange(data.y.shape[0]) < data.sizes
            local_protos, counts = class_prototypes(e, data.y, mask, cfg.num_classes)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return ({"prototypes": local_protos, "counts": counts},
                    ClientState(params, opt_state), metrics)

        def predict(global_protos, state: ClientState, x):
            """Negative squared distances of x's embeddings to the global prototypes."""
            _, e = model.apply(state.params, x)
            return prototype_logits(e, global_protos["prototypes"], global_protos["available"])

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program,
                     norm_keys=("prototypes",))

register(AlgorithmEntry(
    "fedproto", lambda inputs: fedproto(_config(inputs)), aggregation="custom",
    section=FedProtoSection, private_optimizer=True, reads=("proxy_dim",),
    summary="FedProto (Tan et al., AAAI 2022): class prototypes instead of parameters"))
