"""LG-FedAvg: local representations, one global head.

Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020. For model-heterogeneous clients (as in HtFLlib) every client model is
F_k -> P_k (projection to a common dimension d) -> H, and only the head H (d -> classes), whose
shape is the same for every architecture, is averaged over all cohorts by sample counts. Each
round a participant replaces its head with the global one, trains its whole model for E local
epochs, and uploads its head. Evaluation uses each client's own F_k, P_k with the global head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

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
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class LGFedAvgConfig(LocalTrainingConfig):
    """LG-FedAvg's settings: local training and the common feature dimension.

    Attributes:
      dim: the dimension d of the projection the shared head reads (config.proxy_dim).
    """

    dim: int = 128


@struct.dataclass
class ServerState:
    head: dict
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    params: dict
    opt_state: optax.OptState


def with_head(params: dict, head: dict) -> dict:
    """`params` with its 'classifier' subtree replaced by `head`."""
    return {**params, "params": {**params["params"], "classifier": head}}


def global_head_program(arch: str, cfg: LGFedAvgConfig, make_upload) -> CohortProgram:
    """Clients that replace their head with the broadcast global head, train their whole
    `ProjectedClassifier` with CE for E local epochs, and predict with their own F_k, P_k and the
    global head (LG-FedAvg, FedGH). `make_upload(model, params, data, global_head)` -> (upload,
    extra metrics) says what goes up."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    model = architectures.projected_classifier(arch, cfg.num_classes, cfg.dim, cfg.input_spec)

    def init_client(rng: jax.Array) -> ClientState:
        params = model.init(rng, dummy_x)
        return ClientState(params, local_opt.init(params))

    def logits_fn(params, x):
        return model.apply(params, x)[0]

    train_step = local_training.cross_entropy_step(logits_fn, local_opt)

    def client_update(global_head, state: ClientState, data, rng):
        start = with_head(state.params, global_head)
        (params, opt_state), sums, n_active = local_training.run_local_epochs(
            train_step, (start, state.opt_state), data, rng, cfg.local_schedule())
        upload, extra = make_upload(model, params, data, global_head)
        metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                   "local_steps": n_active, **extra}
        return upload, ClientState(params, opt_state), metrics

    def predict(global_head, state: ClientState, x):
        return logits_fn(with_head(state.params, global_head), x)

    return classifier_program(init_client, client_update, predict)


def global_head_server(cfg: LGFedAvgConfig):
    """The server side of a global head (LG-FedAvg, FedGH).

    Args:
      cfg: the method's settings (classes, the common dimension d, the input).

    Returns:
      (init_server, broadcast): the head initialized as the first architecture's
      `ProjectedClassifier` header at round 0, and the same head sent to every cohort.
    """
    dummy_x = cfg.input_spec.dummy_batch()

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        model = architectures.projected_classifier(archs[0], cfg.num_classes, cfg.dim,
                                                   cfg.input_spec)
        return ServerState(model.init(rng, dummy_x)["params"]["classifier"],
                           jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.head

    return init_server, broadcast


def lg_fedavg(cfg: LGFedAvgConfig) -> Algorithm:
    """Builds LG-FedAvg for heterogeneous cohorts."""
    init_server, broadcast = global_head_server(cfg)

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        return ServerState(aggregation.mean_over_cohorts(state.head, groups), state.round + 1)

    def head_upload(model, params, data, global_head):
        del model, data, global_head
        return params["params"]["classifier"], {}

    def cohort_program(arch: str) -> CohortProgram:
        return global_head_program(arch, cfg, head_upload)

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     mean_server_step=True)

def _config(inputs: BuildInputs) -> LGFedAvgConfig:
    return LGFedAvgConfig(**inputs.local_training(), dim=inputs.settings.proxy_dim)


register(AlgorithmEntry(
    "lg_fedavg", lambda inputs: lg_fedavg(_config(inputs)), asynchronous=True,
    private_optimizer=True, reads=("proxy_dim",),
    summary="LG-FedAvg (Liang et al., 2020): local representations, one global head"))
