"""FedNova: normalized averaging, run per architecture cohort.

Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020. Clients of different sizes take different numbers of local steps
tau_i (here tau_i = E * ceil(n_i / B)), so FedAvg's average over-weights the directions of clients
that ran longer. FedNova has each participant upload its normalized update
d_i = (x - y_i) / a_i with a_i = ||a_i||_1 of the paper's local-solver vector: a_i = tau_i for
plain SGD, and for SGD with momentum rho
a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho).
The server applies x <- x - lr_g * tau_eff * sum_i p_i d_i with p_i = n_i / sum n (sample counts)
and tau_eff = sum_i p_i a_i. When every participant has the same a_i this is FedAvg exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram, classifier_program
from fedjax_pfedes.algorithms.fedavg import (
    ClientState,
    FedAvgConfig,
    FedAvgSection,
    cohort_models,
    fedavg_config,
    init_cohort_models,
)
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, register
from fedjax_pfedes.config.fields import above, param


@dataclasses.dataclass(frozen=True)
class FedNovaSection(FedAvgSection):
    """`config.fednova`."""

    SECTION: ClassVar[str] = "fednova"

    server_lr: float = param(1.0, "global step size lr_g (1 = the normalized average)",
                             above(0))


@struct.dataclass
class ServerState:
    params: dict  # arch -> global model
    round: jnp.ndarray


def local_solver_norm(steps: jax.Array, momentum: float) -> jax.Array:
    """||a_i||_1 for `steps` local SGD steps with heavy-ball `momentum` (FedNova, section 4)."""
    steps = jnp.asarray(steps, jnp.float32)
    if momentum == 0:
        return steps
    rho = momentum
    return (steps - rho * (1.0 - rho ** steps) / (1.0 - rho)) / (1.0 - rho)


def normalized_aggregate(old: dict, normalized: dict, solver_norms: jax.Array,
                         weights: jax.Array, server_lr: float = 1.0) -> tuple[dict, jax.Array]:
    """x - lr_g * tau_eff * sum_i p_i d_i; returns (new model, total weight)."""
    mean_d, total = aggregation.weighted_mean([(normalized, weights)])
    p = weights.astype(jnp.float32) / jnp.where(total > 0, total, 1.0)
    tau_eff = jnp.sum(p * solver_norms)
    new = jax.tree.map(lambda o, d: (o - server_lr * tau_eff * d).astype(o.dtype), old, mean_d)
    return new, total


def fednova(cfg: FedAvgConfig) -> Algorithm:
    """Builds FedNova per cohort (`FedNovaSection.server_lr` is the global step size lr_g)."""
    section = cfg.section if isinstance(cfg.section, FedNovaSection) else FedNovaSection()
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    model_of = cohort_models(cfg)

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        return ServerState(init_cohort_models(model_of, rng, archs, cfg),
                           jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str) -> dict:
        return state.params[arch]

    def upload_template(state: ServerState, arch: str) -> dict:
        # Both fields are already updates: their reference is zero.
        return {"normalized_update": jax.tree.map(jnp.zeros_like, state.params[arch]),
                "solver_norm": jnp.zeros((), jnp.float32)}

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        params = dict(state.params)
        for arch, (uploads, weights) in groups.items():
            old = state.params[arch]
            new, total = normalized_aggregate(old, uploads["normalized_update"],
                                              uploads["solver_norm"], weights,
                                              section.server_lr)
            params[arch] = local_training.select_tree(total > 0, new, old)
        return ServerState(params, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = model_of(arch)
        train_step = local_training.cross_entropy_step(model.apply, local_opt)

        def init_client(rng: jax.Array) -> ClientState:
            del rng
            return ClientState(jnp.zeros((), jnp.int32))

        def client_update(x, state: ClientState, data, rng):
            (y, _), sums, n_active = local_training.run_local_epochs(
                train_step, (x, local_opt.init(x)), data, rng, cfg.local_schedule())
            a = local_solver_norm(n_active, cfg.local_momentum)
            safe_a = jnp.maximum(a, 1e-12)
            normalized = jax.tree.map(lambda xo, yo: (xo - yo) / safe_a, x, y)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return ({"normalized_update": normalized, "solver_norm": a},
                    ClientState(state.rounds + 1), metrics)

        def predict(global_params, state: ClientState, x):
            del state
            return model.apply(global_params, x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program,
                     norm_keys=("normalized_update",))

register(AlgorithmEntry(
    "fednova", lambda inputs: fednova(fedavg_config(inputs)), aggregation="per_cohort",
    section=FedNovaSection,
    summary="FedNova (Wang et al., NeurIPS 2020): normalized averaging, per cohort"))
