"""JAX's persistent compilation cache, on by default (`config.execution.compilation_cache_dir`).

The second identical run, and every member of a hyper-parameter sweep after the first (same
shapes, different float values that enter as arguments), load their executables from disk instead
of compiling them. The cache is keyed by the program, the compiler options and the JAX/XLA
version, so a stale entry is never used. It is trusted code: do not point it at a folder others
can write to (the JAX documentation's warning).
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from fedjax_pfedes.errors import ConfigError

# Every compiled program is written, however quick its compilation (JAX's own default skips
# those under 1 s): a run compiles dozens of small programs (row writes, upload checks,
# buffers), and loading one is faster than compiling it (docs/performance_history.md,
# "Second runs").
MIN_COMPILE_TIME_S = 0.0


def user_cache_dir() -> str:
    """$XDG_CACHE_HOME/fedjax_pfedes, or ~/.cache/fedjax_pfedes: what this package keeps per
    user and machine (the compilation cache's default home, `execution.machine_rates`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fedjax_pfedes")


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/fedjax_pfedes/jax, or ~/.cache/fedjax_pfedes/jax."""
    return os.path.join(user_cache_dir(), "jax")


def configure_cache(path: str) -> str | None:
    """Points JAX's persistent cache at `path` ('default': `default_cache_dir()`; '' turns it
    off); returns the folder used. Takes effect for compilations after the call, also when the
    process compiled before."""
    path = default_cache_dir() if path == "default" else (os.path.expanduser(path) if path
                                                           else "")
    current = jax.config.jax_compilation_cache_dir or ""
    if path == current:
        return path or None
    if path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"config.execution.compilation_cache_dir: cannot create '{path}' "
                             f"({e.strerror}); give a writable folder or '' to turn the cache "
                             "off") from None
    jax.config.update("jax_compilation_cache_dir", path or None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    compilation_cache.reset_cache()  # re-read the setting at the next compilation
    return path or None
