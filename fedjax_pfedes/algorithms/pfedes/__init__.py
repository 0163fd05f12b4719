"""pFedES: proxy feature extractor sharing for model-heterogeneous personalized FL.

Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing for Model Heterogeneous
Personalized Federated Learning", AAAI 2025. This module implements the feature-alignment variant
described below (the authors' published schedule is `pfedes_paper.py`):

* Each client k keeps a private backbone F_k, classifier H_k and projection head P_k to a common
  space of dimension d. The server keeps a small proxy feature extractor E_proxy (input
  normalization + small backbone, output d).
* Local step on a batch (x, y): z = F_k(x), logits = H_k(z), e_local = P_k(z),
  e_proxy = stop_gradient(E_proxy(x)); loss = CE(logits, y) + lam * align(e_local, e_proxy) updates
  F_k, P_k, H_k with SGD(lr_local). Then E_proxy takes one SGD step of lr_proxy = ratio * lr_local
  on align(E_proxy(x), stop_gradient(e_local)), with e_local from the same forward pass. For the
  first `warmup_steps` local steps of a client's life F_k is frozen (only P_k and H_k train).
* Only E_proxy is uploaded. The server averages the uploads weighted by local sample counts and
  smooths: new = beta * old + (1 - beta) * average.
"""

from __future__ import annotations

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
)
from fedjax_pfedes.algorithms.pfedes import alignment, client_program, proxy_init
from fedjax_pfedes.algorithms.pfedes.client_program import ClientState  # noqa: F401
from fedjax_pfedes.algorithms.pfedes.hyperparameters import (  # noqa: F401  (the API)
    MULTI_SCALE_BODIES,
    PROXY_LR_RULES,
    SYMMETRIC_ALIGNMENTS,
    PFedESConfig,
    PFedESSection,
    parse_scales,
    proxy_learning_rate,
)
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures


def relative_change(old: dict, new: dict) -> jax.Array:
    """||new - old|| / ||old|| over all leaves (0 when old is all zeros)."""
    norm = optax.tree.norm(old)
    return jnp.where(norm > 0, optax.tree.norm(jax.tree.map(jnp.subtract, new, old))
                     / jnp.maximum(norm, 1e-30), 0.0)


@struct.dataclass
class ServerState:
    """Global E_proxy parameters and the number of completed rounds."""

    proxy_params: dict
    round: jnp.ndarray


def pfedes(cfg: PFedESConfig) -> Algorithm:
    """Builds the pFedES algorithm for a dataset described by `cfg`."""
    weights = cfg.scale_weights()
    scales = len(weights)
    proxy = architectures.proxy_model(cfg.proxy_arch, cfg.proxy_dim, cfg.input_spec, scales)
    align = alignment.multi_scale(alignment.get_alignment(cfg.align, cfg.contrastive_temperature),
                                  weights)
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    lr_proxy = proxy_learning_rate(cfg)
    dummy_x = cfg.input_spec.dummy_batch()

    pretrained = (proxy_init.load(cfg.proxy_init, proxy.init(jax.random.key(0), dummy_x))
                  if cfg.proxy_init else None)

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del archs  # one E_proxy shared by every cohort
        params = (proxy.init(rng, dummy_x) if pretrained is None
                  else jax.tree.map(jnp.asarray, pretrained))
        return ServerState(params, jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.proxy_params

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        average, total = aggregation.weighted_mean(list(groups.values()))
        smoothed = aggregation.momentum_smoothing(state.proxy_params, average,
                                                  cfg.server_momentum)
        new_params = local_training.select_tree(total > 0, smoothed, state.proxy_params)
        return ServerState(new_params, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.client_model(arch, cfg.num_classes, cfg.proxy_dim, cfg.input_spec,
                                           cfg.projection_layernorm, scales)
        return client_program.cohort_program(client_program.Parts(
            cfg, model, proxy, align, local_opt, lr_proxy, dummy_x))

    # With DP-SGD each local step releases two noisy gradients of its batch (private model and
    # E_proxy), both accounted.
    def server_metrics(old: ServerState, new: ServerState) -> dict[str, jax.Array]:
        # How far the server step moved E_proxy this round, relative to its size.
        return {"proxy_relative_change": relative_change(old.proxy_params, new.proxy_params)}

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     dp_sgd_releases_per_step=2, server_metrics=server_metrics,
                     mean_server_step=True,
                     client_report_metrics=("align_loss_at_start", "align_loss_at_end"))

def _build(inputs: BuildInputs) -> Algorithm:
    c = inputs.settings
    return pfedes(PFedESConfig(
        **inputs.local_training(),
        **{**inputs.own(), "proxy_init": proxy_init.resolve(c.proxy_init, c.seed)},
        proxy_dim=c.proxy_dim, dp_sgd=inputs.dp_sgd(),
        align_diagnostics=c.monitor.aggregation_loss))


# Settings that decide which samples form the pool (and so its public share).
POOL_FIELDS = ("data.name", "seed", "data.max_train_samples", "data.global_test_fraction",
               "data.public_fraction")


def pool_of(settings) -> dict:
    """The values of `POOL_FIELDS` in pFedES's view of the config (`BuildInputs.settings`)."""
    out = {}
    for field in POOL_FIELDS:
        value = settings
        for part in field.split("."):
            value = value[part]
        out[field] = value
    return out


def check_proxy_init(settings) -> None:
    """A saved E_proxy must match this run's E_proxy, and when pretrained on this dataset, its
    public share must be the one this run holds out (else clients would own its samples).

    Args:
      settings: pFedES's view of the config (`BuildInputs.settings`).
    """
    path = proxy_init.resolve(settings.proxy_init, settings.seed)
    meta, _ = proxy_init.read(path)
    for field in ("proxy_arch", "proxy_dim"):
        if meta.get(field) != settings[field]:
            raise ConfigError(f"config.proxy_init: '{path}' holds an E_proxy with "
                             f"{field}={meta.get(field)!r}; this run has "
                             f"config.{field}={settings[field]!r}")
    pool = meta.get("pool", {})
    if pool.get("data.name") == settings.data.name:
        differ = {k: v for k, v in pool.items() if pool_of(settings).get(k) != v}
        if differ:
            wanted = ", ".join(f"config.{k}={v!r}" for k, v in differ.items())
            raise ConfigError(f"config.proxy_init: '{path}' was pretrained on the "
                             f"public share of '{settings.data.name}' held out with {wanted}; "
                             "with this run's settings its clients would own some of those "
                             "samples. Set the same values, or pretrain again")


def _check(settings) -> None:
    """The rules of a run's config beyond `PFedESSection`'s ranges and names."""
    if settings.proxy_init:
        check_proxy_init(settings)
    coupled = [f for f in ("stop_gradient_proxy", "stop_gradient_local") if not settings[f]]
    if coupled and settings.align in SYMMETRIC_ALIGNMENTS:
        same = ("config.lam + 1" if coupled == ["stop_gradient_local"]
                else "E_proxy's step x (1 + config.lam)" if coupled == ["stop_gradient_proxy"]
                else "config.lam + 1 and E_proxy's step x (1 + config.lam)")
        raise ConfigError(f"config.{coupled[0]}=False with config.align='{settings.align}' (a "
                         f"symmetric loss) is the design's step with {same}, not a new "
                         "dynamics; use config.align='contrastive', or change lam / "
                         "proxy_lr_ratio")
    if settings.dp_sgd.enabled and not (settings.stop_gradient_proxy
                                        and settings.stop_gradient_local):
        raise ConfigError("config.dp_sgd.enabled needs config.stop_gradient_proxy and "
                         "config.stop_gradient_local (the accountant counts one release per "
                         "side and step)")
    if settings.dp_sgd.enabled and settings.align == "contrastive":
        raise ConfigError("config.dp_sgd.enabled needs a per-example alignment loss: config.align "
                         "'mse' or 'cosine' (InfoNCE couples the examples of a batch)")


register(AlgorithmEntry(
    "pfedes", _build, asynchronous=True, dp_sgd=True, check=_check, proxy_init=True,
    private_optimizer=True, norm_model_ratio=0.0,  # its proxy's updates are ~0.006 of it
    summary="pFedES, feature alignment to a shared proxy extractor (docs/design.md)",
    section=PFedESSection,
    check_data=lambda settings, spec: architectures.check_proxy(settings.proxy_arch,
                                                                 modality=spec.modality),
    reads=("proxy_dim", "dp_sgd.enabled", "monitor.aggregation_loss", *POOL_FIELDS)))
