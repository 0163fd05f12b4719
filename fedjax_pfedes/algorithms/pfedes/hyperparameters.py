"""pFedES's hyper-parameters (`PFedESConfig`) and the rule for E_proxy's learning rate."""

from __future__ import annotations

import dataclasses

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import LocalTrainingConfig


@dataclasses.dataclass(frozen=True)
class PFedESConfig(LocalTrainingConfig):
    """Hyper-parameters of pFedES (defaults inside the ranges of docs/guide/configs.md).

    `stop_gradient_proxy` / `stop_gradient_local` (both True in the design, docs/design.md):
    whether E_proxy's output is a constant target in the local step, and whether the private
    embedding is a constant target in E_proxy's step. Turned off, the gradient of that step's
    loss also reaches the other side's parameters in the same step, as autodiff without a
    `detach` does (finding F5 asks what that does): E_proxy then also descends
    lam * align(e_local, E_proxy(x)) at its own learning rate, and the private model also
    descends align(E_proxy(x), e_local) at the local one. For a symmetric alignment loss
    (align(a, b) = align(b, a): 'mse', 'cosine') that is no new dynamics, only a rescaling:
    without `stop_gradient_local` the private model descends CE + (lam + 1) align, without
    `stop_gradient_proxy` E_proxy's step is (1 + lam) times larger. Those combinations are
    refused (`SYMMETRIC_ALIGNMENTS`); InfoNCE ('contrastive') is asymmetric (row-wise softmax
    over the other side's batch), and there the coupled step is a different update.

    `proxy_scales`: alignment weight of each E_proxy scale (the design's multi-scale extension):
    (1.0,) is the single-scale algorithm; with S weights E_proxy also emits features of its S - 1
    last conv layers (`models.registry.ProxyExtractor`), every client gets one projection head
    per scale, and the alignment loss is sum_s w_s align(P_k^s(z), E_proxy^s(x)) on both sides.

    `proxy_init`: path of a saved E_proxy (`launch.pretrain_proxy`; `{seed}` in the config value
    stands for the run's seed, `proxy_init.resolve`) to start from instead of a
    random initialization ('' = random).

    `align_diagnostics`: report `align_loss_at_start` / `align_loss_at_end` (two extra forward
    passes of the private model and of E_proxy on a batch of rows per client and round, about
    2/3 of one local step's arithmetic; `config.monitor.aggregation_loss` switches them).

    `proxy_momentum`: heavy-ball momentum of E_proxy's local SGD (trace reset every round, as
    E_proxy arrives fresh from the server).

    `proxy_lr_rule`: what `proxy_lr_ratio` is a ratio of. The design states E_proxy's step as
    0.1x the private model's. With heavy-ball momentum m an SGD step of learning rate lr moves
    the parameters by lr / (1 - m) per unit gradient once its trace has built up (the effective
    step; Polyak 1964, also Goh, "Why momentum really works", Distill 2017). 'effective' (the
    default): E_proxy's effective step is proxy_lr_ratio x the private model's, i.e. its
    learning rate is `proxy_lr_ratio * lr_local * (1 - proxy_momentum) / (1 - local_momentum)`
    (= lr_local at m = 0.9 and ratio 0.1). 'raw': `proxy_lr_ratio * lr_local` whatever the
    momenta, the rule before this option existed: with m = 0.9 on the private model and none on
    E_proxy its effective step is 0.01x the private one and E_proxy hardly moves.
    """

    lam: float = 0.5
    align: str = "mse"
    contrastive_temperature: float = 0.1
    proxy_dim: int = 128
    proxy_arch: str = "proxy_cnn"
    proxy_lr_ratio: float = 0.1
    projection_layernorm: bool = False
    warmup_steps: int = 0
    server_momentum: float = 0.5
    dp_sgd: local_training.DPSGDConfig | None = None
    stop_gradient_proxy: bool = True
    stop_gradient_local: bool = True
    proxy_momentum: float = 0.0
    proxy_lr_rule: str = "effective"
    proxy_init: str = ""
    proxy_scales: tuple[float, ...] = (1.0,)
    align_diagnostics: bool = True


PROXY_LR_RULES = ("effective", "raw")

# Alignment losses with align(a, b) = align(b, a): removing a stop-gradient only rescales lam or
# E_proxy's learning rate (see PFedESConfig), so `_check` refuses that combination.
SYMMETRIC_ALIGNMENTS = ("mse", "cosine")


def proxy_learning_rate(cfg: PFedESConfig) -> float:
    """E_proxy's local SGD learning rate under `cfg.proxy_lr_rule` (see `PFedESConfig`).

    Args:
      cfg: the method's hyper-parameters.

    Returns:
      The learning rate of E_proxy's local steps.
    """
    if cfg.proxy_lr_rule == "raw":
        return cfg.proxy_lr_ratio * cfg.lr_local
    if cfg.proxy_lr_rule == "effective":
        return (cfg.proxy_lr_ratio * cfg.lr_local * (1.0 - cfg.proxy_momentum)
                / (1.0 - cfg.local_momentum))
    raise ValueError(f"config.proxy_lr_rule must be one of {list(PROXY_LR_RULES)}, got "
                     f"'{cfg.proxy_lr_rule}'")
