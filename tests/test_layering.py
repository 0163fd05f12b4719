"""The package's layers, checked on its source: every import points down, no circles, no
import of the application (`configs/`, the checkout's `launch/`), one name per module.

  python -m pytest tests/test_layering.py   # the check
  python tests/test_layering.py             # the layers and each module's imports, printed
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "fedjax_pfedes"

# Lowest first: a module may import its own layer and the ones before it.
LAYERS = (
    ("leaves", ("errors", "tree_util", "aggregation", "markdown", "config")),
    ("data", ("data",)),
    ("models", ("models",)),
    ("algorithms", ("algorithms",)),
    ("upload", ("upload",)),
    ("execution", ("execution",)),
    ("io", ("io",)),
    ("engine", ("engine",)),
    ("studies", ("studies",)),
    ("public API", ("",)),  # fedjax_pfedes/__init__.py
    ("command lines", ("launch",)),  # fedjax_pfedes/launch/: over the public API
)


def modules(package: str = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every module of `package`."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: pathlib.Path, name: str) -> set[str]:
    """Every module `path` imports (at any depth of its code), as dotted names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def graph(packages: tuple[str, ...] = (PACKAGE,)) -> dict[str, set[str]]:
    """Module → the modules of `packages` it imports (names that are not modules dropped)."""
    mods = {m: p for package in packages for m, p in modules(package).items()}
    return {m: {d for d in imports(p, m) if d in mods and d != m} for m, p in mods.items()}


# Everything in the checkout that Python imports: the package, its command lines and configs,
# the benchmarks and the tools.
TREE = (PACKAGE, "launch", "configs", "benchmarks", "tools")


def layer_of(module: str) -> int:
    """Index into LAYERS of a package module."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    top = rest.split(".")[0]
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"{module} is in no layer: add its folder to tests/test_layering.py")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _is_ancestor_package(importer: str, imported: str) -> bool:
    """`from fedjax_pfedes.algorithms import x` names the parent package on its way down."""
    return importer.startswith(imported + ".")


def test_the_package_has_no_import_circle():
    edges = {m: {d for d in ds if not _is_ancestor_package(m, d)} for m, ds in graph().items()}
    assert cycles(edges) == []


def test_the_whole_tree_has_no_import_circle():
    # benchmarks/ and tools/ included: their shared works live in benchmarks/works.py
    edges = {m: {d for d in ds if not _is_ancestor_package(m, d)}
             for m, ds in graph(TREE).items()}
    assert len(edges) > len(graph())  # the benchmarks and tools were found
    assert cycles(edges) == []


def test_every_import_points_down_the_layers():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in graph().items() for d in deps
              if not _is_ancestor_package(m, d) and layer_of(d) > layer_of(m)]
    assert upward == []


def test_the_package_never_imports_the_application():
    wrong = [f"{m} imports {d}" for m, p in modules().items() for d in imports(p, m)
             if d.split(".")[0] in ("configs", "launch", "tests", "benchmarks")]
    assert wrong == []


def test_each_module_name_is_used_once_across_the_package():
    names = collections.defaultdict(list)
    for m, p in modules(PACKAGE).items():
        if p.name != "__init__.py":
            names[m.rsplit(".", 1)[-1]].append(m)
    assert {n: ms for n, ms in names.items() if len(ms) > 1} == {}


def test_the_checkouts_launch_modules_only_run_the_packages_command_lines():
    """`launch/NAME.py` (run from a checkout, not installed) imports
    `fedjax_pfedes.launch.NAME.console` and nothing else; every command line of the package has
    one, and a console script in pyproject.toml."""
    import tomllib

    shims = {m.rsplit(".", 1)[-1]: p for m, p in modules("launch").items()
             if p.name != "__init__.py"}
    commands = {m.rsplit(".", 1)[-1] for m, p in modules().items()
                if m.startswith(f"{PACKAGE}.launch.") and "def console()" in p.read_text()}
    assert set(shims) == commands
    for name, path in shims.items():
        assert imports(path, f"launch.{name}") == {f"{PACKAGE}.launch.{name}",
                                                   f"{PACKAGE}.launch.{name}.console"}, path
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(v.split(":")[0].rsplit(".", 1)[-1] for v in scripts.values()) == \
        sorted(commands)
    assert all(v.endswith(":console") for v in scripts.values())


def test_only_the_package_is_installed():
    """pyproject.toml installs `fedjax_pfedes` alone: `launch` and `configs` as top-level
    packages in site-packages would shadow a user's own modules of those names."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    assert found["include"] == [f"{PACKAGE}*"]


def test_the_checks_see_a_circle_and_an_upward_import():
    # the checks above on a graph with a known circle and a known upward edge
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of(f"{PACKAGE}.engine.rounds") > layer_of(f"{PACKAGE}.upload.stages")
    assert layer_of(f"{PACKAGE}.errors") == 0


if __name__ == "__main__":
    g = graph()
    for i, (layer, members) in enumerate(LAYERS):
        print(f"{i} {layer}: {', '.join(m or '__init__' for m in members)}")
        for m in sorted(x for x in g if layer_of(x) == i):
            inside = sorted(d[len(PACKAGE) + 1:] for d in g[m] if not _is_ancestor_package(m, d))
            print(f"    {m[len(PACKAGE) + 1:] or '__init__'}: {', '.join(inside) or '-'}")
