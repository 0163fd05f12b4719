"""Counts the rooms of the package: modules over 450 lines, functions over 60, and each method's
declarations (docs/architecture.md, "Room sizes, counted").

  python -m tools.room_sizes
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fedjax_pfedes"


def long_rooms() -> list[str]:
    """'path lines [function lines, ...]' for every module over 450 lines or with a function
    over 60."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        n = len(src.splitlines())
        long = [f"{f.name} {f.end_lineno - f.lineno + 1}" for f in ast.walk(ast.parse(src))
                if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno >= 60]
        if n > 450 or long:
            out.append(f"{path.relative_to(PACKAGE.parent)} {n} {long}")
    return out


def declaration_lines(module: str, math: set[str]) -> int:
    """Non-blank, non-comment lines of `fedjax_pfedes/algorithms/<module>.py` outside its
    docstring, its imports and the functions named in `math` (those that build the
    algorithm)."""
    src = (PACKAGE / "algorithms" / f"{module}.py").read_text()
    tree = ast.parse(src)
    skip: set[int] = set()
    for node in tree.body:
        docstring = isinstance(node, ast.Expr) and node is tree.body[0]
        if docstring or isinstance(node, ast.Import | ast.ImportFrom) or (
                isinstance(node, ast.FunctionDef) and node.name in math):
            skip |= set(range(node.lineno, node.end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if i not in skip and line.strip() and not line.strip().startswith("#"))


def main() -> None:
    rooms = long_rooms()
    print("\n".join(rooms))
    modules = sum(1 for r in rooms if int(r.split()[1]) > 450)
    functions = sum(r.count(",") + 1 for r in rooms if "[]" not in r)
    print(f"{modules} modules over 450 lines, {functions} functions over 60")
    print("declarations: standalone", declaration_lines("standalone", {"standalone"}),
          "| the FedAvg family (4 methods)",
          declaration_lines("fedavg", {"fedavg", "cohort_models", "init_cohort_models"}))


if __name__ == "__main__":
    main()
