"""The commands README.md and docs/ give (`python -m MODULE --flag ...`, in bash blocks and in
inline code) name modules that exist and flags those modules define: a reader who copies one
gets the run it describes, not an unknown-flag error. The history pages (`*_history.md`) keep
commands as they were run and are left out."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "guide").glob("*.md"))]
CURRENT = [p for p in PAGES if not p.name.endswith("_history.md")]
OURS = ("launch", "benchmarks", "tools")  # the project's own command lines
NOT_MODULES = {"launch.NAME"}  # README's placeholder for any launcher
# Flags a module reads by prefix rather than declares: launch.sweep's --sweep.FIELD=v1,v2,...
PREFIX_FLAGS = {"launch.sweep": {"sweep"}}


def commands(page: pathlib.Path) -> list[tuple[str, str]]:
    """(module, its arguments) of every `-m MODULE ...` command on `page`: each line of a bash
    block (continuations joined, comments and `;`/`&&`/`|` splitting it) and each inline code
    span."""
    text = page.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").split("\n"):
            for part in re.split(r";|&&|\|", line.split(" #")[0]):
                found += re.findall(r"-m\s+([A-Za-z_][\w.]*)(.*)", part)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose):
        found += re.findall(r"-m\s+([A-Za-z_][\w.]*)(.*)", span.replace("\\\n", " "), re.S)
    return [(module.rstrip("."), args) for module, args in found]


def documented() -> dict[str, list[tuple[str, str]]]:
    """module -> [(page, arguments)] over the current pages, the project's modules only."""
    by_module: dict[str, list[tuple[str, str]]] = {}
    for page in CURRENT:
        for module, args in commands(page):
            if module.split(".")[0] in OURS and module not in NOT_MODULES:
                by_module.setdefault(module, []).append((page.name, args))
    return by_module


def defined_flags(module: str) -> frozenset[str]:
    """The flag names `module` accepts: absl's `--helpfull` (booleans also as --noNAME), or,
    for an argparse command line, every --NAME of its help and its subcommands' helps."""
    def helped(*args):
        run = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                             text=True, cwd=ROOT, timeout=300)
        return run.stdout + run.stderr
    out = helped("--helpfull")
    names = set(re.findall(r"^\s+--(?:\[no\])?([A-Za-z_][\w-]*)", out, re.M))
    names |= {"no" + n for n in re.findall(r"^\s+--\[no\]([A-Za-z_][\w-]*)", out, re.M)}
    if not names:  # argparse: usage lines, and the subcommands it lists
        out = helped("--help")
        subcommands = re.findall(r"\{([\w,]+)\}", out)
        for sub in (subcommands[0].split(",") if subcommands else []):
            out += helped(sub, "--help")
        names = set(re.findall(r"--([A-Za-z_][\w-]*)", out))
    return frozenset(names | PREFIX_FLAGS.get(module, set()))


def test_the_pages_name_commands_at_all():
    found = documented()
    assert {"launch.main", "launch.compare", "benchmarks.defaults"} <= set(found), found.keys()
    # a page's commands are found in bash blocks and in inline code spread over lines
    assert ("launch.main", " --config=configs/quickstart.py --workdir=runs/quickstart") in \
        commands(ROOT / "README.md")
    assert any(m == "benchmarks.defaults" for m, _ in commands(ROOT / "README.md"))


def test_every_documented_module_exists():
    missing = {module: sorted({page for page, _ in uses})
               for module, uses in documented().items()
               if importlib.util.find_spec(module) is None}
    assert not missing, f"docs name modules that do not exist: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(documented()))
def test_every_documented_flag_is_defined(module):
    given = [(page, flag, args.strip()[:120]) for page, args in documented()[module]
             for flag in re.findall(r"(?<![\w-])--([A-Za-z_][\w-]*)", args)]
    if not given:
        return  # e.g. `python -m tools.room_sizes`: nothing to check
    known = defined_flags(module)
    assert known, f"{module} printed no flags"
    unknown = [g for g in given if g[1] not in known]
    assert not unknown, f"{module}: flags the docs give that it does not define: {unknown}"
