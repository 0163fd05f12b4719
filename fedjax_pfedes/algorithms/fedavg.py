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

SERVER_OPTIMIZERS = ("none", "sgd_momentum", "adam")


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(LocalTrainingConfig):
    """Hyper-parameters of the FedAvg family.

    Attributes:
      prox_mu: FedProx's proximal weight (0 = FedAvg).
      server_optimizer: 'none' (new = average), 'sgd_momentum' (FedAvgM) or 'adam' (FedAdam).
      server_lr, server_momentum, adam_b1, adam_b2, adam_eps: the server optimizer's settings.
    """

    prox_mu: float = 0.0
    server_optimizer: str = "none"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    adam_b1: float = 0.9
    adam_b2: float = 0.99
    adam_eps: float = 1e-3
    name: str = "fedavg"
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


def server_optimizer(cfg: FedAvgConfig) -> optax.GradientTransformation | None:
    """The optax optimizer applied to the pseudo-gradient (None: plain averaging)."""
    if cfg.server_optimizer == "none":
        return None
    if cfg.server_optimizer == "sgd_momentum":
        return optax.sgd(cfg.server_lr, momentum=cfg.server_momentum)
    if cfg.server_optimizer == "adam":
        return optax.adam(cfg.server_lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps)
    raise ValueError(f"server optimizer must be one of {SERVER_OPTIMIZERS}, got "
                     f"'{cfg.server_optimizer}'")


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
    server_opt = server_optimizer(cfg)
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
                grads = jax.tree.map(lambda g, d: g + cfg.prox_mu * d, grads, drift)
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

    return Algorithm(cfg.name, init_server, broadcast, broadcast, server_update, cohort_program,
                     aggregation="per_cohort", mean_server_step=True)


# Server optimizer of each FedAvg-family name.
SERVER_OPTIMIZER_OF = {"fedavg": "none", "fedprox": "none", "fedavgm": "sgd_momentum",
                     "fedadam": "adam"}


def fedavg_config(inputs: BuildInputs, name: str) -> FedAvgConfig:
    """`FedAvgConfig` of a per-cohort method from `config.train` and the method's section
    (`config.fedprox`, `config.fedavgm`, `config.fedadam`, `config.scaffold`, `config.fednova`)."""
    c = inputs.settings
    kw = {}
    if name == "fedprox":
        kw = dict(prox_mu=c.fedprox.mu)
    elif name == "fedavgm":
        kw = dict(server_lr=c.fedavgm.server_lr, server_momentum=c.fedavgm.server_momentum)
    elif name == "fedadam":
        kw = dict(server_lr=c.fedadam.server_lr, adam_b1=c.fedadam.b1, adam_b2=c.fedadam.b2,
                  adam_eps=c.fedadam.eps)
    elif name in ("scaffold", "fednova"):
        kw = dict(server_lr=c[name].server_lr)
    return FedAvgConfig(**inputs.local_training(),
                        server_optimizer=SERVER_OPTIMIZER_OF.get(name, "none"), name=name,
                        dp_sgd=inputs.dp_sgd(), **kw)


def check_section(settings, name: str) -> None:
    """Range checks of a FedAvg-family method's config section (ValueError naming the field).

    Args:
      settings: the method's view of the config (`BuildInputs.settings`).
      name: the method, whose section is checked.
    """
    section = settings[name] if name in settings else {}
    for key, value in section.items():
        field = f"config.{name}.{key}"
        if key in ("server_lr", "eps") and not value > 0:
            raise ValueError(f"{field} must be > 0, got {value}")
        if key in ("mu",) and not value >= 0:
            raise ValueError(f"{field} must be >= 0, got {value}")
        if key in ("server_momentum", "b1", "b2") and not 0 <= value < 1:
            raise ValueError(f"{field} must be in [0, 1), got {value}")


# The config fields of each FedAvg-family method (`config.<name>.*`) with their defaults.
FIELDS = {
    "fedavg": {},
    "fedprox": {"fedprox.mu": 0.01},  # mu/2 * ||w - w_global||^2
    # FedAvgM / FedAdam server learning rates. With lr 1.0 both diverged on the quick start
    # (docs/baselines.md): 0.1 with momentum 0.9 is a steady-state step of 1.
    "fedavgm": {"fedavgm.server_lr": 0.1,
                "fedavgm.server_momentum": 0.9},  # server heavy-ball momentum
    "fedadam": {"fedadam.server_lr": 0.01,  # Reddi et al. 2021 tune it in [1e-3, 1]
                "fedadam.b1": 0.9, "fedadam.b2": 0.99, "fedadam.eps": 1e-3},
}

_PAPERS = {
    "fedavg": "FedAvg (McMahan et al., AISTATS 2017), one global model per cohort",
    "fedprox": "FedProx (Li et al., MLSys 2020): FedAvg + proximal term",
    "fedavgm": "FedAvgM (Hsu et al., 2019): server momentum",
    "fedadam": "FedAdam (Reddi et al., ICLR 2021): server Adam",
}
for _name in SERVER_OPTIMIZER_OF:
    register(AlgorithmEntry(
        _name, lambda inputs, name=_name: fedavg(fedavg_config(inputs, name)),
        aggregation="per_cohort", asynchronous=True, dp_sgd=True,
        check=lambda settings, name=_name: check_section(settings, name),
        summary=_PAPERS[_name], fields=FIELDS[_name]))
