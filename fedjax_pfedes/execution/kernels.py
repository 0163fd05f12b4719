"""The CPU kernel libraries a client program can be compiled with (`config.execution.cpu_kernels`):
XLA:CPU's own choice ('xla') or its Eigen-based kernels ('eigen'). Which is faster depends on
the CPU and the layers (docs/performance.md); the two agree up to float reassociation."""

from __future__ import annotations

import jax

from fedjax_pfedes.errors import ConfigError

CPU_KERNELS = ("xla", "eigen")
KERNEL_SETTINGS = CPU_KERNELS + ("auto",)  # what config.execution.cpu_kernels accepts


def kernel_options(cpu_kernels: str) -> dict[str, str]:
    """XLA compiler options of the client programs (local update, evaluation) for
    `config.execution.cpu_kernels`: 'xla' (none: XLA:CPU's own choice, which in jaxlib 0.10
    hands convolutions and matrix products to YNNPACK fusions) or 'eigen' (YNNPACK fusions off:
    XLA's Eigen-based kernels). Which is faster depends on the CPU and the layers
    (docs/performance.md); the two agree up to float reassociation. Empty off the CPU backend."""
    if cpu_kernels not in CPU_KERNELS:
        raise ConfigError(f"config.execution.cpu_kernels must be one of {list(CPU_KERNELS)} "
                         f"('auto' picks one per cohort, `kernel_candidates`), got "
                         f"{cpu_kernels!r}")
    if cpu_kernels == "xla" or jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def kernel_candidates(cpu_kernels: str) -> tuple[str, ...]:
    """The kernel choices a run compiles for `config.execution.cpu_kernels`: the one given, or
    for 'auto' both of `CPU_KERNELS` on a CPU backend (timed per cohort, `execution.choice`) and
    'xla' elsewhere (the option only exists for XLA:CPU)."""
    if cpu_kernels == "auto":
        return CPU_KERNELS if jax.default_backend() == "cpu" else ("xla",)
    kernel_options(cpu_kernels)  # refuses a name it does not know
    return (cpu_kernels,)
