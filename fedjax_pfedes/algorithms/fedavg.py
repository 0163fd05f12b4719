"""The FedAvg family, run per architecture cohort: FedAvg, FedProx, FedAvgM and FedAdam.

- FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
  Data", AISTATS 2017. Participants start from the cohort's global model, run E local epochs of SGD
  and upload their model; the server takes the sample-weighted mean.
- FedProx: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020. The local
  loss adds mu/2 * ||w - w_global||^2; mu = 0 is FedAvg exactly.
- FedAvgM / FedAdam: Hsu et al. 2019 and Reddi et al., "Adaptive Federated Optimization", ICLR
  2021. The server treats old - average as a pseudo-gradient for an optax optimizer (SGD with
  momentum, or Adam).

Models of different architectures cannot be averaged, so in a heterogeneous population each cohort
is its own federation ("FedAvg per cohort", the baseline of finding F2 in docs/design.md): the
server keeps one global model per cohort. A client's personalized accuracy is its cohort's global
model on its local test split. The local optimizer state is fresh every round and never uploaded.
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
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Section, above, at_least, between, param
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class FedAvgSection(Section):
    """`config.fedavg`: FedAvg has no fields of its own; the family's base: plain averaging
    (no server optimizer) and no proximal term. Each member's section derives from it."""

    SECTION: ClassVar[str] = "fedavg"

    def server_optimizer(self) -> optax.GradientTransformation | None:
        """The optax optimizer applied to the pseudo-gradient (None: new = average)."""
        return None

    def proximal_weight(self) -> float:
        """FedProx's mu (0: FedAvg's local loss)."""
        return 0.0


@dataclasses.dataclass(frozen=True)
class FedProxSection(FedAvgSection):
    """`config.fedprox`."""

    SECTION: ClassVar[str] = "fedprox"

    mu: float = param(0.01, "proximal weight: the local loss adds mu/2 ||w - w_global||^2 "
                      "(0 = FedAvg)", at_least(0))

    def proximal_weight(self) -> float:
        return self.mu


@dataclasses.dataclass(frozen=True)
class FedAvgMSection(FedAvgSection):
    """`config.fedavgm`: server SGD with heavy-ball momentum on the pseudo-gradient."""

    SECTION: ClassVar[str] = "fedavgm"

    server_lr: float = param(0.1, "server learning rate (0.1 with momentum 0.9 is a steady-state "
                             "step of 1; at convergence on the quick start 0.3 was tuned best and "
                             "0.9 fell apart, docs/baselines.md)", above(0))
    server_momentum: float = param(0.9, "server heavy-ball momentum", between(0, 1, "[)"))

    def server_optimizer(self) -> optax.GradientTransformation:
        return optax.sgd(self.server_lr, momentum=self.server_momentum)


@dataclasses.dataclass(frozen=True)
class FedAdamSection(FedAvgSection):
    """`config.fedadam`: server Adam on the pseudo-gradient (Reddi et al. 2021)."""

    SECTION: ClassVar[str] = "fedadam"

    server_lr: float = param(0.01, "server learning rate (Reddi et al. 2021 tune it in "
                             "[1e-3, 1])", above(0))
    b1: float = param(0.9, "Adam's first-moment decay", between(0, 1, "[)"))
    b2: float = param(0.99, "Adam's second-moment decay", between(0, 1, "[)"))
    eps: float = param(1e-3, "Adam's epsilon (adaptivity)", above(0))

    def server_optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.server_lr, b1=self.b1, b2=self.b2, eps=self.eps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FedAvgConfig(LocalTrainingConfig):
    """Settings of the FedAvg family's build.

    Attributes:
      section: the method's own section: its server optimizer and proximal weight (FedAvg's
        own, no fields, for FedAvg, Standalone and FedBN); SCAFFOLD and FedNova read their
        `server_lr` from theirs.
      dp_sgd: sample-level DP-SGD, or None.
    """

    section: Section = FedAvgSection()
    dp_sgd: local_training.DPSGDConfig | None = None


@struct.dataclass
class ServerState:
    """One global model (and server-optimizer state) per architecture cohort."""

    params: dict
    opt_state: dict
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    """FedAvg clients keep nothing between rounds but the count of rounds they took part in."""

    rounds: jnp.ndarray


def cohort_models(cfg: FedAvgConfig):
    """arch -> its `Classifier`, built once per architecture (FedAvg, SCAFFOLD, FedNova)."""
    models = {}

    def model_of(arch: str) -> architectures.Classifier:
        if arch not in models:
            models[arch] = architectures.classifier_model(arch, cfg.num_classes, cfg.input_spec)
        return models[arch]

    return model_of


def init_cohort_models(model_of, rng: jax.Array, archs: tuple[str, ...], cfg: FedAvgConfig
                       ) -> dict:
    """One freshly initialized global model per cohort (key folded with the cohort index)."""
    dummy_x = cfg.input_spec.dummy_batch()
    return {a: model_of(a).init(jax.random.fold_in(rng, i), dummy_x) for i, a in enumerate(archs)}


def fedavg(cfg: FedAvgConfig) -> Algorithm:
    """Builds FedAvg (or FedProx / FedAvgM / FedAdam, by `cfg`) run per cohort."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    server_opt = cfg.section.server_optimizer()
    prox_mu = cfg.section.proximal_weight()
    model_of = cohort_models(cfg)

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        params = init_cohort_models(model_of, rng, archs, cfg)
        opt_state = {a: server_opt.init(p) if server_opt else () for a, p in params.items()}
        return ServerState(params, opt_state, jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str) -> dict:
        return state.params[arch]

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        params, opt_state = dict(state.params), dict(state.opt_state)
        for arch, group in groups.items():
            average, total = aggregation.weighted_mean([group])
            old = state.params[arch]
            if server_opt is None:
                new, new_opt = average, opt_state[arch]
            else:
                pseudo_gradient = jax.tree.map(jnp.subtract, old, average)
                updates, new_opt = server_opt.update(pseudo_gradient, opt_state[arch], old)
                new = optax.apply_updates(old, updates)
            # A cohort without participants this round keeps its model and optimizer state.
            params[arch] = local_training.select_tree(total > 0, new, old)
            opt_state[arch] = local_training.select_tree(total > 0, new_opt, opt_state[arch])
        return ServerState(params, opt_state, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = model_of(arch)

        def init_client(rng: jax.Array) -> ClientState:
            del rng
            return ClientState(jnp.zeros((), jnp.int32))

        def client_update(global_params, state: ClientState, data, rng):
            def ce_loss(p, batch):
                x, y, mask = batch
                ce = local_training.cross_entropy(model.apply(p, x), y, mask)
                return ce, ce

            def train_step(carry, batch):
                params, opt_state = carry
                if cfg.dp_sgd is None:
                    grads, ce = jax.grad(ce_loss, has_aux=True)(params, batch)
                else:  # the proximal term does not touch data: it is added after DP-SGD
                    grads, ce = local_training.private_gradient(ce_loss, params, batch[:3],
                                                                batch[2], batch[3], cfg.dp_sgd)
                drift = jax.tree.map(jnp.subtract, params, global_params)
                grads = jax.tree.map(lambda g, d: g + prox_mu * d, grads, drift)
                updates, opt_state = local_opt.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), jnp.stack([ce])

            carry = (global_params, local_opt.init(global_params))
            (params, _), sums, n_active = local_training.run_local_epochs(
                train_step, carry, data, rng, cfg.local_schedule(),
                step_keys=cfg.dp_sgd is not None)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return params, ClientState(state.rounds + 1), metrics

        def predict(global_params, state: ClientState, x):
            del state
            return model.apply(global_params, x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     mean_server_step=True)


def fedavg_config(inputs: BuildInputs) -> FedAvgConfig:
    """`FedAvgConfig` of a per-cohort method: `config.train`'s local training and the method's
    own section (`BuildInputs.section`; FedAvg's for a method without one)."""
    section = inputs.section if isinstance(inputs.section, FedAvgSection) else FedAvgSection()
    return FedAvgConfig(**inputs.local_training(), section=section, dp_sgd=inputs.dp_sgd())


_PAPERS = {
    FedAvgSection: "FedAvg (McMahan et al., AISTATS 2017), one global model per cohort",
    FedProxSection: "FedProx (Li et al., MLSys 2020): FedAvg + proximal term",
    FedAvgMSection: "FedAvgM (Hsu et al., 2019): server momentum",
    FedAdamSection: "FedAdam (Reddi et al., ICLR 2021): server Adam",
}
for _section, _summary in _PAPERS.items():
    register(AlgorithmEntry(
        _section.SECTION,
        lambda inputs: fedavg(fedavg_config(inputs)),
        aggregation="per_cohort", asynchronous=True, dp_sgd=True, summary=_summary,
        section=_section if dataclasses.fields(_section) else None))
