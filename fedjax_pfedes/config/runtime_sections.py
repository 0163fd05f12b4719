"""`config.system`, `config.asynchronous`, `config.execution`, `config.distributed`: the
simulated clients' reliability and timing, and how the simulation runs on the machine."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from fedjax_pfedes.config.fields import Section, above, at_least, between, one_of, param
from fedjax_pfedes.errors import ConfigError

STALENESS = ("constant", "polynomial", "hinge")
DEADLINE_POLICIES = ("drop", "partial")
# Largest per-round log-normal sigma of a client's step time: beyond it simulated times overflow
# float64 and the clock and summary.json would hold Infinity.
MAX_TIME_JITTER = 5.0


def float_list(text: str, field: str) -> tuple[float, ...]:
    """The numbers of a comma-separated config field ('0.9,0.5').

    Args:
      text: the field's value.
      field: its path for the error message ('config.system.availability').

    Returns:
      The values; ConfigError naming the field when one is no finite number or none is given.
    """
    try:
        values = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{field}: expected numbers separated by commas, got '{text}'") from None
    if not values:
        raise ConfigError(f"{field} is empty")
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{field}: values must be finite, got '{text}'")
    return values


@dataclasses.dataclass(frozen=True)
class SystemSection(Section):
    """`config.system`: unreliable clients (docs/guide/clients.md); the defaults model none."""

    SECTION: ClassVar[str] = "system"

    availability: str = param("1.0", "P(online) per round; '0.9,0.5' = classes, equal shares")
    availability_period: int = param(0, "> 0: reachable only in a window of duty x period",
                                     at_least(0, " (0 = always reachable)"))
    availability_duty: float = param(0.5, "rounds per period (random phase per client)",
                                     between(0, 1, "(]"))
    dropout: float = param(0.0, "P(a selected client fails before uploading)",
                           between(0, 1, "[)"))
    speed_classes: str = param("1.0", "step-time multipliers, e.g. '1,2,4' (equal shares)")
    step_time_s: float = param(0.05, "simulated seconds per local step, fastest class",
                               above(0))
    time_jitter: float = param(
        0.0, "per-round log-normal sigma on a client's step time (exp(3 sigma) is already a "
        "3e6x slow-down at 5)", between(0, MAX_TIME_JITTER, "[]"))
    upload_mbps: str = param("10", "uplink Mbit/s: one value or one per speed class")
    download_mbps: str = param("50", "downlink Mbit/s")
    deadline_s: float = param(0.0, "round deadline in simulated seconds (0 = none)",
                              at_least(0, " (0 = none)"))
    deadline_policy: str = param("drop", "late clients: 'drop' | 'partial' (steps in time)",
                                 one_of(*DEADLINE_POLICIES))
    failure_decay: float = param(0.5, "sampling weight x decay^(consecutive failures)",
                                 between(0, 1, "(]"))

    LISTS: ClassVar[tuple[str, ...]] = ("availability", "speed_classes", "upload_mbps",
                                        "download_mbps")

    def check(self) -> None:
        lists = {f: float_list(getattr(self, f), f"config.system.{f}") for f in self.LISTS}
        if not all(0 < p <= 1 for p in lists["availability"]):
            raise ConfigError(f"config.system.availability: probabilities must be in (0, 1], "
                              f"got {lists['availability']}")
        for field in ("speed_classes", "upload_mbps", "download_mbps"):
            values = lists[field]
            if min(values) <= 0:
                raise ConfigError(f"config.system.{field} must be > 0, got {values}")
            if field != "speed_classes" and len(values) not in (1, len(lists["speed_classes"])):
                raise ConfigError(
                    f"config.system.{field}: give one value or one per speed class "
                    f"({len(lists['speed_classes'])}), got {len(values)}")


@dataclasses.dataclass(frozen=True)
class AsynchronousSection(Section):
    """`config.asynchronous`: buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022):
    the server steps whenever buffer_size updates have arrived in simulated time; one round =
    one server step."""

    SECTION: ClassVar[str] = "asynchronous"

    enabled: bool = param(False, "buffered asynchronous rounds")
    concurrency: int = param(10, "clients training at any time (buffer_size .. the clients)",
                             at_least(1).when_enabled())
    buffer_size: int = param(5, "K updates per server step", at_least(1).when_enabled())
    staleness: str = param("polynomial", "'constant' | 'polynomial' | 'hinge'",
                           one_of(*STALENESS).when_enabled())
    staleness_exponent: float = param(0.5, "polynomial: (1 + tau)^-a",
                                      at_least(0).when_enabled())
    hinge_a: float = param(10.0, "hinge: 1 if tau <= b else 1 / (a (tau - b) + 1)",
                           at_least(0).when_enabled())
    hinge_b: float = param(4.0, "hinge: b", at_least(0).when_enabled())


@dataclasses.dataclass(frozen=True)
class ExecutionSection(Section):
    """`config.execution`: how a cohort's clients run on the devices (same numbers for any)."""

    SECTION: ClassVar[str] = "execution"

    strategy: str = param(
        "auto", "'auto' | 'loop' | 'vmap' | 'shard' | 'scan'. 'auto' picks per cohort: a cost "
        "model prices the applicable ones (execution.cost_model) and only two within its "
        "margin are timed; cached per machine. 'shard' splits each round's participants "
        "over the devices of a mesh: the multi-GPU / TPU strategy (what 'auto' means across "
        "processes). 'scan' runs a round's participants through one compiled lax.scan: the "
        "cross-device strategy. Same numbers for any, up to float reassociation")
    scan_chunk: int = param(1, "'scan': participants vmapped per iteration",
                            at_least(1, integer=True))
    devices: int = param(0, "devices of the 'shard' mesh (0 = all local devices)",
                         at_least(0, " (0 = all)"))
    eval_memory_budget_gb: float = param(
        4.0, "'vmap' / 'shard': memory one vectorized evaluation call may take; a cohort that "
        "needs more is evaluated in chunks of clients (same numbers for any value)", above(0))
    loop_threads: int = param(
        0, "'loop' and 'scan': host threads that train participants at the same time ('scan': "
        "that many lanes of participants, one scanned call each; 0 = this process's CPU cores "
        "on a CPU backend, 1 on an accelerator; same numbers for any value, up to float "
        "reassociation of 'scan''s streamed sums)",
        at_least(0, " (0 = the CPU cores)", integer=True))
    cpu_kernels: str = param(
        "auto", "kernels of the clients' programs on a CPU backend: 'auto' (chosen per cohort "
        "with the strategy; 'xla' across processes) | 'xla' (XLA:CPU's choice: YNNPACK) | "
        "'eigen' (convolutions on XLA's Eigen kernels, YNNPACK for the rest: 'auto' prefers it "
        "on an AVX2 CPU without AVX-512); equal up to float reassociation")
    client_states: str = param(
        "device", "where the clients' private states and data live: 'device' (stacked on the "
        "accelerator) | 'offload' (host memory, gathered per round for the participants: "
        "10,000+ clients, docs/guide/scale.md)")
    client_state_budget_gb: float = param(
        8.0, "'offload': host memory all cohorts' states may take; above it they are "
        "memory-mapped files in client_state_dir", above(0))
    client_state_dir: str = param("", "'offload': folder of those files ('' = "
                                  "<workdir>/client_states)")
    unroll_local_steps: bool = param(
        False, "True: every client runs its cohort's padded schedule as one unrolled scan (the "
        "reference the default rolled loop is tested against)")
    compilation_cache_dir: str = param(
        "default", "JAX's persistent compilation cache: a second identical run loads its "
        "compiled programs ('default' = $XDG_CACHE_HOME or ~/.cache, /fedjax_pfedes/jax; '' "
        "= off)")


@dataclasses.dataclass(frozen=True)
class DistributedSection(Section):
    """`config.distributed`: several processes (hosts) in one run (`jax.distributed`;
    docs/guide/scale.md): start the same command once per process with its own process_id."""

    SECTION: ClassVar[str] = "distributed"

    coordinator_address: str = param(
        "", "'' = one process; 'host:port' of process 0; 'auto' = read the cluster's "
        "environment (TPU pod slice, SLURM)")
    num_processes: int = param(1, "processes of the run", at_least(1))
    process_id: int = param(0, "this process's index (below num_processes)", at_least(0))
    cpu_collectives: str = param("gloo", "between CPU processes: 'gloo' | 'mpi'")
