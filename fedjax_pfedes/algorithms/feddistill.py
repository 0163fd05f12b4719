"""FedDistill (federated distillation): clients share per-class average logits, not parameters.

Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", NeurIPS 2018 workshop; the loss follows HtFLlib's
FedDistill. Every client keeps its own classifier of any architecture. A local step minimizes
CE(logits, y) + lam * mean_c (logits - global_logits[y])^2 over the samples whose class has a
global average (mean over the classes' logit dimensions). After E local epochs a participant
uploads the mean logit vector of each class over its training data and the per-class counts; the
server's vector for class c is the count-weighted mean over the clients that hold c (classes
nobody has uploaded keep their previous vector). Clients predict with their own model.

Only `num_classes` x `num_classes` numbers (+ counts) travel per client, whatever the model.
Config: `config.feddistill.lam`.
"""

from __future__ import annotations

import dataclasses
import math
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
from fedjax_pfedes.algorithms.fedproto import class_prototypes
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Range, Section, param
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class FedDistillSection(Section):
    """`config.feddistill`."""

    SECTION: ClassVar[str] = "feddistill"

    lam: float = param(1.0, "weight of the per-class logit distillation (0 = Standalone "
                       "training with logit uploads)",
                       Range(lambda v: math.isfinite(v) and v >= 0, "finite and >= 0"))


@dataclasses.dataclass(frozen=True)
class FedDistillConfig(FedDistillSection, LocalTrainingConfig):
    """Local training (`BuildInputs.local_training`) and `config.feddistill`."""


@struct.dataclass
class ServerState:
    logits: jnp.ndarray     # [classes, classes]: global mean logit vector per class
    available: jnp.ndarray  # [classes] bool: some client has uploaded this class
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    params: dict
    opt_state: optax.OptState


def distillation_loss(logits: jnp.ndarray, y: jnp.ndarray, mask: jnp.ndarray,
                      global_logits: jnp.ndarray, available: jnp.ndarray) -> jnp.ndarray:
    """Mean over real samples with an available class of mean_c (logits - global[y])^2."""
    has = mask & available[y]
    per_sample = jnp.mean((logits - global_logits[y]) ** 2, axis=-1)
    return local_training.masked_mean(per_sample, has)


def feddistill(cfg: FedDistillConfig) -> Algorithm:
    """Builds FedDistill for heterogeneous cohorts."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    k = cfg.num_classes

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del rng, archs
        return ServerState(jnp.zeros((k, k), jnp.float32), jnp.zeros((k,), bool),
                           jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"logits": state.logits, "available": state.available}

    def upload_template(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"logits": state.logits, "counts": jnp.zeros((k,), jnp.float32)}

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        mean, total = aggregation.class_weighted_mean(
            [(u["logits"], u["counts"], w) for u, w in groups.values()])
        seen = total > 0
        return ServerState(jnp.where(seen[:, None], mean, state.logits),
                           state.available | seen, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.classifier_model(arch, k, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def client_update(global_logits, state: ClientState, data, rng):
            targets, available = global_logits["logits"], global_logits["available"]

            def train_step(carry, batch):
                params, opt_state = carry
                x, y, mask = batch

                def loss_fn(p):
                    logits = model.apply(p, x)
                    ce = local_training.cross_entropy(logits, y, mask)
                    kd = distillation_loss(logits, y, mask, targets, available)
                    return ce + cfg.lam * kd, jnp.stack([ce, kd])

                grads, stats = jax.grad(loss_fn, has_aux=True)(params)
                updates, opt_state = local_opt.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), stats

            (params, opt_state), sums, n_active = local_training.run_local_epochs(
                train_step, (state.params, state.opt_state), data, rng, cfg.local_schedule())
            mask = jnp.arange(data.y.shape[0]) < data.sizes
            class_logits, counts = class_prototypes(model.apply(params, data.x), data.y, mask, k)
            n = jnp.maximum(n_active, 1.0)
            metrics = {"train_ce_loss": sums[0] / n, "train_distill_loss": sums[1] / n,
                       "local_steps": n_active}
            return ({"logits": class_logits, "counts": counts},
                    ClientState(params, opt_state), metrics)

        def predict(global_logits, state: ClientState, x):
            del global_logits
            return model.apply(state.params, x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program)


def _build(inputs: BuildInputs) -> Algorithm:
    return feddistill(FedDistillConfig(**inputs.local_training(), **inputs.own()))


register(AlgorithmEntry(
    "feddistill", _build, aggregation="custom",
    section=FedDistillSection, private_optimizer=True,
    summary="FedDistill (Jeong et al., 2018): per-class average logits, distilled locally"))
