"""Standalone: every client trains its own model on its own data and never communicates.

The lower reference of personalized FL (e.g. Tan et al., "Towards Personalized Federated
Learning", IEEE TNNLS 2022): what a client reaches without federation. Each client's model and
local optimizer state persist across rounds; "a round" is E local epochs for the sampled
clients; nothing is uploaded or downloaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram, classifier_program
from fedjax_pfedes.algorithms.fedavg import FedAvgConfig, fedavg_config
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, register
from fedjax_pfedes.models import architectures


@struct.dataclass
class ServerState:
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    params: dict
    opt_state: optax.OptState


def standalone(cfg: FedAvgConfig) -> Algorithm:
    """Builds Standalone training (uses the local-training fields of `cfg`)."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del rng, archs
        return ServerState(jnp.zeros((), jnp.int32))

    def nothing(state: ServerState, arch: str = "") -> dict:
        del state, arch
        return {}

    def server_update(state: ServerState, groups) -> ServerState:
        del groups
        return ServerState(state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.classifier_model(arch, cfg.num_classes, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        train_step = local_training.cross_entropy_step(model.apply, local_opt)

        def client_update(broadcast, state: ClientState, data, rng):
            del broadcast
            (params, opt_state), sums, n_active = local_training.run_local_epochs(
                train_step, (state.params, state.opt_state), data, rng, cfg.local_schedule())
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return {}, ClientState(params, opt_state), metrics

        def predict(broadcast, state: ClientState, x):
            del broadcast
            return model.apply(state.params, x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, nothing, nothing, server_update, cohort_program)

register(AlgorithmEntry(
    "standalone", lambda inputs: standalone(fedavg_config(inputs)),
    aggregation="none", private_optimizer=True,
    summary="Standalone: every client trains alone"))
