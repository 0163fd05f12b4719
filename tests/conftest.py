"""Test tiers: end-to-end tests carry an explicit `@pytest.mark.slow`, and collection checks it.

A test must be marked `slow` when it, a fixture it uses, or a helper of its module that either
calls (two levels deep) runs whole experiments or processes: `run_experiment`,
`fedjax_pfedes.run`, `run_grid`, `submit_grid`, `run_in` (studies.run_pool's), `subprocess`,
or the notebook; an unmarked one stops the
collection naming it. Other tests may be marked slow too. `python -m pytest tests -m "not slow"`
is the fast tier (unit tests of every module against independent references);
`python -m pytest tests` runs everything (CI).
"""

import inspect
import os
import re

import pytest

# " run_in(": studies.run_pool's, called by name (not the benchmark peers' `flower_loop.run_in(`)
SLOW_CALLS = ("run_experiment(", "fedjax_pfedes.run(", "run_grid(", "submit_grid(", " run_in(",
              "subprocess.", "NotebookClient(")


def _source(func) -> str:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _calls_slow(source: str, module, depth: int = 2) -> bool:
    if any(call in source for call in SLOW_CALLS):
        return True
    if depth == 0 or module is None:
        return False
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", source)):
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == module.__name__:
            if _calls_slow(_source(helper), module, depth - 1):
                return True
    return False


def _is_slow(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    funcs = [getattr(item, "function", None)]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        funcs += [d.func for d in defs]
    return any(_calls_slow(_source(f), module) for f in funcs if f is not None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end runs (excluded by -m 'not slow')")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # `-n`: each worker its own persistent compilation cache (runs it starts too):
        # JAX writes cache entries non-atomically, so two processes must not share a folder.
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        os.environ["XDG_CACHE_HOME"] = os.path.join(base, f"fedjax_pfedes_tests_{worker}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = sorted({item.nodeid.split("[")[0] for item in items
                       if item.get_closest_marker("slow") is None and _is_slow(item)})
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) run whole experiments or processes but are not marked "
            f"@pytest.mark.slow: {', '.join(unmarked)}")
