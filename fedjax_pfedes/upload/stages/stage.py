"""What an upload stage is: `UploadStage` (its client and server halves), the round's uploads
it works on (`RoundUploads`), and the registry the pipeline builds its chain from
(`register_stage`, `STAGES`, `declared_fields`). The package's docstring says how they fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.config.fields import Section, defaults_of


@dataclasses.dataclass
class RoundUploads:
    """One round's uploads as the server-side stages see them (host side, updated in place).

    Attributes:
      round_index: 0-based round.
      cohorts: architecture -> `pipeline.CohortUploads` (ids, sizes, template, real slots).
      scopes: groups of architectures aggregated together (one per cohort for per-cohort
        methods, one for all cohorts for shared-tree methods).
      members: architecture -> clients in the cohort.
      key: the round's upload RNG key.
      valid: architecture -> [slots] whether the slot still counts (stages reject by clearing).
      sent: architecture -> stacked updates as decoded by the server (float32); None when no
        stage transforms (`UploadPipeline.active`: the uploads reach the algorithm as they
        arrived, so only the client halves' facts are computed).
      info: architecture -> per-client facts from the client halves ('finite', 'norm').
      weights: architecture -> [slots] aggregation weights (set by the weighting stage).
      aggregates: architecture -> the update the server applies to every real slot, or None
        when the algorithm averages the decoded uploads itself.
      report: the round's report entries (skipped scopes, protocol figures); those a stage
        declares in `report_keys` go into the round's record.
      reject: (ids, reason) -> None; records rejections (the caller clears `valid`).
      expected_in_scope: members -> expected participants among them (fixed DP denominator).
      wire_bytes: (senders, bytes each sent) of the scopes whose uploads went over the wire in
        another form than the encoded update (secure aggregation's dense masked vectors).
    """

    round_index: int
    cohorts: dict[str, Any]
    scopes: list[list[str]]
    members: dict[str, int]
    key: jax.Array
    valid: dict[str, np.ndarray]
    sent: dict[str, Any]
    info: dict[str, dict[str, np.ndarray]]
    report: dict[str, Any]
    reject: Callable[[np.ndarray, str], None]
    expected_in_scope: Callable[[int], float]
    weights: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    aggregates: dict[str, Any] | None = None
    wire_bytes: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def scope_arrays(self, scope: list[str]):
        """(stacked sent [slots, ...], valid [slots], weights [slots]) over a scope's cohorts."""
        stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[self.sent[a] for a in scope])
        ok = np.concatenate([self.valid[a] for a in scope])
        w = jnp.concatenate([self.weights[a] for a in scope])
        return stacked, ok, w

    def streamed(self, scope: list[str]) -> bool:
        """Whether any of the scope's cohorts was summed as it trained (`upload.streaming`):
        its clipped updates' sum instead of stacked updates (`scope_sum`). Under
        `execution.strategy='auto'` one cohort may stream and another stack."""
        return any(self.cohorts[a].reduced is not None for a in scope)

    def scope_sum(self, scope: list[str]) -> Any:
        """The sum of the scope's valid clipped updates, float32: a streamed cohort's sum
        (`StreamingClippedSum`) as it is, a stacked cohort's valid rows added up."""
        return _sum_trees([
            self.cohorts[a].reduced["sum"] if self.cohorts[a].reduced is not None
            else weighted_row_sum(self.sent[a], jnp.asarray(self.valid[a], jnp.float32))
            for a in scope])

    def skip_scope(self, scope: list[str]) -> Any:
        """No server update from `scope` this round: zero weights, a zero aggregate."""
        for a in scope:
            self.weights[a] = jnp.zeros_like(self.weights[a])
        return jax.tree.map(lambda t: jnp.zeros(jnp.shape(t), jnp.float32),
                            self.cohorts[scope[0]].template)


@jax.jit
def weighted_row_sum(stacked, weights):
    """sum_i weights[i] x row i of every leaf of `stacked` (one program per shape)."""
    return jax.tree.map(lambda a: jnp.tensordot(weights, a, axes=1), stacked)


@jax.jit
def _sum_trees(trees: list):
    """The leaf-wise sum of equally shaped trees, in one program."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


def skip_scope(r: RoundUploads, key: str, why: str) -> None:
    """A scope that gets no server update this round: said in the report and the log."""
    r.report.setdefault(key, []).append(why)
    logging.warning("round %d: no server update for %s", r.round_index + 1, why)


def scope_key(r: RoundUploads, s_idx: int) -> jax.Array:
    """The RNG key of a scope's server-side randomness this round."""
    return jax.random.fold_in(jax.random.fold_in(r.key, 1000 + s_idx), r.round_index)


class UploadStage:
    """A stage that does nothing; subclasses override the halves they need.

    A malicious client runs its own code: it skips every client half, except those the server
    enforces on what it receives (`server_enforced`: checks and clipping the server can apply
    because it sees individual uploads, i.e. without secure aggregation). `skipped` is what the
    server sees of a stage a client skipped (by default: the update as it is)."""

    name = "identity"
    transforms = False
    client_keyed = False  # its client half keeps a per-client state or draws a key
    report_keys: tuple[str, ...] = ()
    position = 0  # where in the chain (`register_stage`): lower runs first
    # The stage's own config section (a `config.fields.Section` subclass with its `SECTION`
    # name, its fields declared with `param`), or None (the shipped stages read `config.upload`,
    # `config.dp`, `config.secagg`). It joins the default config; a run builds it once (its
    # ranges and its `check` run then) and the stage reads it as `cfg.section(ThatSection)`.
    section: ClassVar[type[Section] | None] = None

    @classmethod
    def fields(cls) -> dict[str, Any]:
        """The stage's own config fields at their defaults, as {dotted path: default}."""
        if cls.section is None:
            return {}
        return {f"{cls.section.SECTION}.{k}": v for k, v in defaults_of(cls.section).items()}

    @classmethod
    def from_config(cls, cfg, noise_multiplier: float) -> UploadStage | None:
        """The stage a run's `settings.PipelineConfig` asks for, or None (not in this chain).

        Args:
          cfg: the run's `PipelineConfig`.
          noise_multiplier: the client-level DP noise multiplier in force (0 without DP).

        Returns:
          A configured stage, or None.
        """
        del cfg, noise_multiplier
        return None

    def server_enforced(self, secagg: bool) -> bool:
        del secagg
        return False

    def skipped(self, delta, info):
        return delta, info

    def init_state(self, template, members: int):
        del template, members
        return None

    def client(self, delta, memory, key, info):
        del key
        return delta, memory, info

    def server(self, r: RoundUploads) -> None:
        del r


STAGES: list[type[UploadStage]] = []


def register_stage(cls: type[UploadStage]) -> type[UploadStage]:
    """Adds a stage class to the chain `pipeline.build_stages` builds (in `position` order).

    Args:
      cls: an `UploadStage` subclass with a `position` and a `from_config`.

    Returns:
      `cls` (use as a class decorator). A second class under a registered `name` raises.
    """
    if not (isinstance(cls, type) and issubclass(cls, UploadStage)):
        raise ValueError(f"register_stage: expected a subclass of UploadStage, got "
                        f"{cls!r} ({type(cls).__name__})")
    where = f"register_stage({cls.__name__})"
    if not isinstance(cls.name, str) or not cls.name or (
            cls.name == UploadStage.name and cls is not UploadStage):
        raise ValueError(f"{where}: the stage needs a name of its own (class attribute "
                         f"`name`), got {cls.name!r}")
    if not isinstance(cls.position, int | float) or isinstance(cls.position, bool):
        raise ValueError(f"{where}: position must be a number (lower runs first), got "
                         f"{cls.position!r}")
    taken = {c.name: c for c in STAGES}
    if cls.name in taken and taken[cls.name] is not cls:
        raise ValueError(f"upload stage '{cls.name}' is registered twice")
    _check_stage_fields(cls, where)
    if cls not in STAGES:
        STAGES.append(cls)
        STAGES.sort(key=lambda c: c.position)
    return cls


def _check_stage_fields(cls: type[UploadStage], where: str) -> None:
    """A stage's own section must be a named `Section` whose name no other part of the config
    (the core's, a method's, another stage's) uses."""
    if not callable(cls.fields) or getattr(cls.fields, "__func__", None) is not (
            UploadStage.fields.__func__):
        raise ValueError(f"{where}: a stage declares its config fields as a `section` (a "
                         "fedjax_pfedes.Section subclass), not as `fields`")
    section = cls.section
    if section is None:
        return
    if not (isinstance(section, type) and issubclass(section, Section)
            and dataclasses.is_dataclass(section)):
        raise ValueError(f"{where}: section must be a dataclass deriving from "
                         f"fedjax_pfedes.Section, got {section!r}")
    name = section.SECTION
    if not name or "." in name:
        raise ValueError(f"{where}: its section needs a SECTION name of its own (one word), "
                         f"got {name!r}")
    core = algorithm_registry.core_paths()
    if name in core["leaves"] or name in core["sections"]:
        raise ValueError(f"{where}: section 'config.{name}' collides with the core config's")
    for m in algorithm_registry.entries().values():
        if any(path == name or path.startswith(name + ".") for path in m.fields):
            raise ValueError(f"{where}: section 'config.{name}' is declared by the method "
                             f"'{m.name}' too")
    for other in STAGES:
        if other is not cls and other.section is not None and other.section.SECTION == name:
            raise ValueError(f"{where}: section 'config.{name}' is declared by the stage "
                             f"'{other.name}' too")


def declared_fields() -> dict[str, Any]:
    """Every registered stage's own config fields with their defaults (dotted paths).

    Returns:
      {path: default}.
    """
    return {path: default for cls in STAGES for path, default in cls.fields().items()}


def own_sections() -> list[type[Section]]:
    """The registered stages' own section classes, in chain order."""
    return [cls.section for cls in STAGES if cls.section is not None]
