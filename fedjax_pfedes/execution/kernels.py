"""The CPU kernel libraries a client program can be compiled with (`config.execution.cpu_kernels`):
XLA:CPU's own choice ('xla': YNNPACK for convolutions, matrix products and reductions) or XLA's
Eigen-based convolutions with YNNPACK for the rest ('eigen'). Which is faster depends on the CPU
and the layers (docs/performance.md); the two agree up to float reassociation."""

from __future__ import annotations

import jax

from fedjax_pfedes.errors import ConfigError

CPU_KERNELS = ("xla", "eigen")
KERNEL_SETTINGS = CPU_KERNELS + ("auto",)  # what config.execution.cpu_kernels accepts
# The YNNPACK fusions 'eigen' keeps (XLA:CPU's default set less its convolutions, which then
# run on XLA's Eigen kernels).
_YNN_WITHOUT_CONVOLUTIONS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"


def kernel_options(cpu_kernels: str) -> dict[str, str]:
    """XLA compiler options of the client programs (local update, evaluation) for
    `config.execution.cpu_kernels`: 'xla' (none: XLA:CPU's own choice, which in jaxlib 0.10
    hands convolutions, matrix products and reductions to YNNPACK fusions) or 'eigen' (the
    convolutions on XLA's Eigen-based kernels, YNNPACK for the rest). Which is faster depends on
    the CPU and the layers (docs/performance.md); the two agree up to float reassociation.
    Empty off the CPU backend."""
    if cpu_kernels not in CPU_KERNELS:
        raise ConfigError(f"config.execution.cpu_kernels must be one of {list(CPU_KERNELS)} "
                         f"('auto' picks one per cohort, `kernel_candidates`), got "
                         f"{cpu_kernels!r}")
    if cpu_kernels == "xla" or jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": _YNN_WITHOUT_CONVOLUTIONS}


def kernel_candidates(cpu_kernels: str) -> tuple[str, ...]:
    """The kernel choices a run compiles for `config.execution.cpu_kernels`: the one given, or
    for 'auto' both of `CPU_KERNELS` on a CPU backend (timed per cohort, `execution.choice`) and
    'xla' elsewhere (the option only exists for XLA:CPU)."""
    if cpu_kernels == "auto":
        return CPU_KERNELS if jax.default_backend() == "cpu" else ("xla",)
    kernel_options(cpu_kernels)  # refuses a name it does not know
    return (cpu_kernels,)
