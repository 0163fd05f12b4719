"""pFedES's config section (`PFedESSection`: each field declared once), its build settings
(`PFedESConfig`) and the rule for E_proxy's learning rate."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import LocalTrainingConfig
from fedjax_pfedes.algorithms.pfedes import alignment
from fedjax_pfedes.config.fields import Section, above, at_least, between, one_of, param
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures

PROXY_LR_RULES = ("effective", "raw")

# Alignment losses with align(a, b) = align(b, a): removing a stop-gradient only rescales lam or
# E_proxy's learning rate (see PFedESConfig), so a run's config check refuses that combination
# (building PFedESConfig directly allows it: the tests compare the two).
SYMMETRIC_ALIGNMENTS = ("mse", "cosine")

# E_proxy bodies with intermediate layers to tap for config.proxy_scales.
MULTI_SCALE_BODIES = ("proxy_cnn",)


def parse_scales(text: str) -> tuple[float, ...]:
    """`config.proxy_scales` ('1.0' or '1.0,0.5,...') as weights; ValueError naming the field."""
    try:
        weights = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise ConfigError(f"config.proxy_scales: '{text}' is not a comma-separated list of "
                          "weights, e.g. '1.0,0.5'") from None
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ConfigError(f"config.proxy_scales: weights must be finite, >= 0 and not all 0; "
                          f"got '{text}'")
    return weights


@dataclasses.dataclass(frozen=True)
class PFedESSection(Section):
    """pFedES's config fields: at the top level of the config (`config.lam`), the flagship's
    (docs/guide/configs.md gives the usual ranges). The common feature dimension d
    (`config.proxy_dim`) is shared with the heterogeneous baselines and lives in the core."""

    SECTION: ClassVar[str] = ""

    lam: float = param(0.5, "weight of the alignment loss (0.1-1.0 usual; 2.0 collapses)",
                       at_least(0))
    align: str = param("mse", "'mse' | 'cosine' | 'contrastive' (InfoNCE)")
    contrastive_temperature: float = param(0.1, "InfoNCE temperature (align='contrastive')",
                                           above(0))
    proxy_arch: str = param("proxy_cnn", "E_proxy's body: image 'proxy_cnn' | 'proxy_mlp', "
                            "tabular 'proxy_mlp', text 'proxy_text'")
    proxy_lr_ratio: float = param(
        0.1, "E_proxy's step relative to the private model's (proxy_lr_rule says how)",
        at_least(0, " (0 = E_proxy frozen)"))
    proxy_lr_rule: str = param(
        "effective", "'effective': a ratio of momentum-adjusted steps, lr_proxy = ratio x "
        "lr_local x (1 - proxy_momentum) / (1 - train.local_momentum) (= lr_local at the "
        "defaults); 'raw': ratio x lr_local, which with local momentum 0.9 made E_proxy's "
        "effective step 1% of the private one", one_of(*PROXY_LR_RULES))
    projection_layernorm: bool = param(False, "LayerNorm after the projection head's ReLU")
    warmup_steps: int = param(0, "first W local steps of a client: backbone frozen",
                              at_least(0))
    server_momentum: float = param(0.5, "beta: new = beta x old + (1 - beta) x average",
                                   between(0, 1, "[)"))
    stop_gradient_proxy: bool = param(
        True, "E_proxy's output is a constant in the local step (the design; finding F5 turns "
        "it off)")
    stop_gradient_local: bool = param(
        True, "the private embedding is a constant in E_proxy's step (the design)")
    proxy_momentum: float = param(
        0.0, "heavy-ball momentum of E_proxy's local SGD (its trace restarts every round, as "
        "E_proxy arrives fresh from the server)", between(0, 1, "[)"))
    proxy_init: str = param(
        "", "start E_proxy from a saved one ('' = random), e.g. one pretrained on the public "
        "share of the data by `launch.pretrain_proxy`; '{seed}' stands for the run's seed")
    proxy_scales: str = param(
        "1.0", "multi-scale alignment: one weight per E_proxy scale ('1.0' = single scale; "
        "'1.0,0.5' also aligns a second projection head with E_proxy's last conv layer)")

    def scale_weights(self) -> tuple[float, ...]:
        """`proxy_scales` as weights."""
        return parse_scales(self.proxy_scales)

    def check(self) -> None:
        alignment.get_alignment(self.align)
        architectures.check_proxy(self.proxy_arch)
        scales = self.scale_weights()
        if len(scales) > 1 and self.proxy_arch not in MULTI_SCALE_BODIES:
            raise ConfigError(f"config.proxy_scales: {len(scales)} scales need a conv E_proxy "
                              f"({list(MULTI_SCALE_BODIES)}), config.proxy_arch is "
                              f"'{self.proxy_arch}'")


@dataclasses.dataclass(frozen=True)
class PFedESConfig(PFedESSection, LocalTrainingConfig):
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
    '1.0' is the single-scale algorithm; with S weights E_proxy also emits features of its S - 1
    last conv layers (`models.registry.ProxyExtractor`), every client gets one projection head
    per scale, and the alignment loss is sum_s w_s align(P_k^s(z), E_proxy^s(x)) on both sides.

    `proxy_init`: path of a saved E_proxy (`launch.pretrain_proxy`; the build resolves the config
    value's `{seed}`, `proxy_init.resolve`) to start from instead of a random initialization
    ('' = random).

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

    proxy_dim: int = 128
    dp_sgd: local_training.DPSGDConfig | None = None
    align_diagnostics: bool = True




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
    raise ConfigError(f"config.proxy_lr_rule must be one of {list(PROXY_LR_RULES)}, got "
                     f"'{cfg.proxy_lr_rule}'")
