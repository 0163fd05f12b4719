"""SCAFFOLD: stochastic controlled averaging, run per architecture cohort.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020.
The server keeps, per cohort, the global model x and a server control variate c; every client keeps
its own control variate c_i (zeros at start, private state). A participant starts from x and takes
K local steps on the corrected gradient g(y) - c_i + c, then refreshes its control with the
paper's option II, c_i+ = c_i - c + (x - y) / (K * lr), and uploads (y, c_i+ - c_i). The server
sets x <- x + lr_g * (weighted mean of y - x) (sample-count weights, as everywhere here; the paper
averages uniformly) and c <- c + (1/N) * sum of the participants' control deltas, N = the cohort's
client count. With zero controls SCAFFOLD is FedAvg exactly.

K is the client's own number of local steps (clients of different sizes take different K). The
paper analyses plain SGD; with local momentum rho the correction enters the gradient before the
momentum buffer, and option II divides by lr * ||a||_1 instead of lr * K, where
||a||_1 = [K - rho (1 - rho^K) / (1 - rho)] / (1 - rho) is the total weight the K momentum steps
give the gradients (FedNova's local-solver norm; = K without momentum). Dividing by K * lr made
the controls ~1/(1 - rho) times too large and the quick start diverge.
Upload size is twice FedAvg's (model + control delta), as in the paper.
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
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram, classifier_program
from fedjax_pfedes.algorithms.fedavg import (
    FedAvgConfig,
    FedAvgSection,
    cohort_models,
    fedavg_config,
    init_cohort_models,
)
from fedjax_pfedes.algorithms.fednova import local_solver_norm
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, local_override, register
from fedjax_pfedes.config.fields import above, param


@dataclasses.dataclass(frozen=True)
class ScaffoldSection(FedAvgSection):
    """`config.scaffold`."""

    SECTION: ClassVar[str] = "scaffold"

    server_lr: float = param(1.0, "global step size lr_g (1 = the averaged model)", above(0))
    local_momentum: float = local_override(
        "local_momentum", 0.0, "control variates correct plain SGD steps; with momentum 0.9 "
        "SCAFFOLD diverged on the quick start (docs/baselines_history.md)")


@struct.dataclass
class ServerState:
    params: dict   # arch -> global model x
    control: dict  # arch -> server control variate c
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    control: dict  # c_i
    rounds: jnp.ndarray


def zeros_like_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.float32), tree)


def server_control_update(control: dict, deltas: dict, weights: jax.Array, num_clients: int
                          ) -> dict:
    """c + (1/N) * sum of the participants' control deltas (padded slots: weight 0)."""
    took_part = (weights > 0).astype(jnp.float32)
    return jax.tree.map(lambda c, d: c + jnp.tensordot(took_part, d, axes=1) / num_clients,
                        control, deltas)


def scaffold(cfg: FedAvgConfig, cohort_sizes: Mapping[str, int]) -> Algorithm:
    """Builds SCAFFOLD per cohort; `cohort_sizes[arch]` is N, the cohort's number of clients.
    `ScaffoldSection.server_lr` is the global step size lr_g (1 = the averaged model)."""
    section = cfg.section if isinstance(cfg.section, ScaffoldSection) else ScaffoldSection()
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    model_of = cohort_models(cfg)

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        missing = [a for a in archs if a not in cohort_sizes]
        if missing:
            raise ValueError(f"SCAFFOLD needs the client count of every cohort; missing {missing}")
        params = init_cohort_models(model_of, rng, archs, cfg)
        control = {a: zeros_like_f32(p) for a, p in params.items()}
        return ServerState(params, control, jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str) -> dict:
        return {"params": state.params[arch], "control": state.control[arch]}

    def upload_template(state: ServerState, arch: str) -> dict:
        # The model's reference is the broadcast model; the control delta is already a delta.
        return {"params": state.params[arch],
                "control_delta": zeros_like_f32(state.control[arch])}

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        params, control = dict(state.params), dict(state.control)
        for arch, (uploads, weights) in groups.items():
            average, total = aggregation.weighted_mean([(uploads["params"], weights)])
            old = state.params[arch]
            new = jax.tree.map(lambda o, a: (o + section.server_lr * (a - o)).astype(o.dtype),
                               old, average)
            params[arch] = local_training.select_tree(total > 0, new, old)
            control[arch] = server_control_update(state.control[arch], uploads["control_delta"],
                                                  weights, cohort_sizes[arch])
        return ServerState(params, control, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = model_of(arch)

        def init_client(rng: jax.Array) -> ClientState:
            return ClientState(zeros_like_f32(model.init(rng, dummy_x)), jnp.zeros((), jnp.int32))

        def client_update(received, state: ClientState, data, rng):
            x, c = received["params"], received["control"]
            correction = jax.tree.map(jnp.subtract, c, state.control)

            def train_step(carry, batch):
                params, opt_state = carry
                bx, by, mask = batch
                ce, grads = jax.value_and_grad(
                    lambda p: local_training.cross_entropy(model.apply(p, bx), by, mask))(params)
                grads = jax.tree.map(lambda g, k: g + k.astype(g.dtype), grads, correction)
                updates, opt_state = local_opt.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), jnp.stack([ce])

            (y, _), sums, n_active = local_training.run_local_epochs(
                train_step, (x, local_opt.init(x)), data, rng, cfg.local_schedule())
            # Option II divides by K * lr for plain SGD; with momentum rho the K steps move the
            # model by lr * ||a||_1 average gradients (FedNova's local-solver norm).
            solver = local_solver_norm(n_active, cfg.local_momentum)
            scale = 1.0 / (jnp.maximum(solver, 1.0) * cfg.lr_local)
            new_control = jax.tree.map(
                lambda ci, cs, xo, yo: ci - cs + (xo - yo).astype(jnp.float32) * scale,
                state.control, c, x, y)
            new_control = local_training.select_tree(n_active > 0, new_control, state.control)
            control_delta = jax.tree.map(jnp.subtract, new_control, state.control)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return ({"params": y, "control_delta": control_delta},
                    ClientState(new_control, state.rounds + 1), metrics)

        def predict(received, state: ClientState, x):
            del state
            return model.apply(received["params"], x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program,
                     state_needs_acceptance=True)

register(AlgorithmEntry(
    "scaffold", lambda inputs: scaffold(fedavg_config(inputs),
                                        inputs.clients_per_arch),
    aggregation="per_cohort", section=ScaffoldSection,
    summary="SCAFFOLD (Karimireddy et al., ICML 2020): control variates, per cohort"))
