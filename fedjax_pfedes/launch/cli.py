"""Command-line plumbing shared by the `launch` programs: every user error is one line on stderr
and exit status 2 — an unknown, misspelled or renamed config field, a value of the wrong type, a
missing or broken config file — never a traceback."""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import NoReturn

import ml_collections
from absl import app, flags

from fedjax_pfedes.io import storage

# JAX's start-up notes (no TPU library, where the compilation cache lives) are INFO lines that
# absl prints on stderr; above an error they hide the one line that matters.
for _name in ("jax._src.xla_bridge", "jax._src.compilation_cache"):
    logging.getLogger(_name).setLevel(logging.WARNING)

# Fields that moved when the one `config.baseline` section was split per method.
RENAMED_FIELDS = {
    "baseline.prox_mu": "fedprox.mu",
    "baseline.server_lr": "scaffold.server_lr / config.fednova.server_lr",
    "baseline.fedavgm_lr": "fedavgm.server_lr",
    "baseline.server_momentum": "fedavgm.server_momentum",
    "baseline.fedadam_lr": "fedadam.server_lr",
    "baseline.adam_b1": "fedadam.b1",
    "baseline.adam_b2": "fedadam.b2",
    "baseline.adam_eps": "fedadam.eps",
    "baseline.paper_mu": "pfedes_paper.mu",
    "baseline.paper_g_lr_ratio": "pfedes_paper.g_lr_ratio",
    "baseline.proto_lambda": "fedproto.lam",
    "baseline.shared_arch": "clients.shared_arch",
    "baseline.fml_alpha": "fml.alpha",
    "baseline.fml_beta": "fml.beta",
    "baseline.kd_energy_start": "fedkd.energy_start",
    "baseline.kd_energy_end": "fedkd.energy_end",
    "baseline.gh_server_lr": "fedgh.server_lr",
    "baseline.gh_server_epochs": "fedgh.server_epochs",
    "baseline.mrl_sub_dim": "fedmrl.sub_dim",
}


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2 (bad input, not a crash)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def config_file_problem(path: str) -> str:
    """Why the config file at `path` cannot be loaded, in one line."""
    if not path:
        return "--config is required, e.g. --config=configs/quickstart.py"
    if not os.path.isfile(path):
        return f"--config={path}: no such file"
    try:
        compile(open(path, encoding="utf-8").read(), path, "exec")
    except SyntaxError as e:
        return f"--config={path}: syntax error on line {e.lineno}: {e.msg}"
    except (OSError, UnicodeDecodeError) as e:
        return f"--config={path}: cannot be read ({e})"
    return f"--config={path}: cannot be loaded (does it define get_config()?)"


def _flag_value(argv: list[str], name: str) -> str:
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with every user error as one line and exit status 2: an unknown or
    misspelled config key, a value of the wrong type, a missing or broken config file."""
    moved = renamed_field(argv)
    if moved:
        fail(moved)
    try:
        return flags.FLAGS(argv)
    except SystemExit as e:
        if e.code in (None, 0) and _flag_value(argv, "config"):  # the config file's own exit
            fail(f"--config={_flag_value(argv, 'config')}: the file exited (SystemExit"
                 f"({e.code!r})) instead of returning a config from get_config()")
        raise
    except KeyError as e:  # ml_collections: unknown key, with its "Did you mean" hint
        fail(f"unknown config field: {e.args[0] if e.args else e}")
    except flags.Error as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - the config file's own code raised: report, no trace
        unknown = unknown_override(argv, e)
        if unknown:
            fail(unknown)
        fail(f"{config_file_problem(_flag_value(argv, 'config'))} ({type(e).__name__}: {e})")


def unknown_override(argv: list[str], error: Exception) -> str | None:
    """The `--config.<path>=...` flag of `argv` whose last part is the key `error` (an
    AttributeError or KeyError of ml_collections) names, as a one-line error; None otherwise."""
    if not isinstance(error, (AttributeError, KeyError)) or not error.args:
        return None
    # "'key'\nDid you mean ...", or that text's repr when ml_collections re-raises it as an
    # AttributeError of a nested field ("\\'key\\'\\nDid you mean ...")
    found = re.match(r"""[\s'"\\]*([A-Za-z_]\w*)""", str(error.args[0]))
    key = found.group(1) if found else ""
    for a in argv:
        if a.startswith("--config."):
            path = a[len("--config."):].split("=", 1)[0]
            parts = path.split(".")
            if parts[-1] == key:
                parent = ".".join(["config", *parts[:-1]])
                return (f"unknown config field: --config.{path} ({parent} has no field "
                        f"'{key}'; configs/quickstart.py lists the fields)")
    return None


def renamed_field(argv: list[str]) -> str | None:
    """The first `--config.<old name>` of `argv`, as an error naming the new field."""
    for a in argv:
        if a.startswith("--config."):
            key = a[len("--config."):].split("=", 1)[0]
            if key in RENAMED_FIELDS:
                return f"--config.{key} is now --config.{RENAMED_FIELDS[key]}"
            if key.startswith("baseline."):
                return (f"--config.{key}: config.baseline was split into one section per "
                        "method (config.fedprox, config.fml, ...; configs/quickstart.py)")
    return None


def loaded_config(config_flag):
    """The config of a `DEFINE_config_file` flag, or one line and exit 2 if it cannot load."""
    path = _flag_value(sys.argv, "config")
    try:
        config = config_flag.value
        if config is None:
            fail(config_file_problem(""))
        if type(config).__name__ == "_ErrorConfig":  # config_flags' deferred load error
            config.to_dict()
        if not isinstance(config, ml_collections.ConfigDict):
            fail(f"--config={path}: get_config() must return an ml_collections.ConfigDict "
                 f"(e.g. fedjax_pfedes.default_config()), returned {type(config).__name__}")
        config.to_dict()  # config_flags defers a load error to the first access
    except SystemExit as e:
        if e.code in (None, 0):
            fail(f"--config={path}: the file exited (SystemExit({e.code!r})) instead of "
                 "returning a config from get_config()")
        raise
    except Exception:  # noqa: BLE001 - whatever the file raised, one line names it
        fail(config_file_problem(path))
    return config


SWEEP_PREFIX = "--sweep."  # launch.sweep: --sweep.FIELD=v1,v2,...


def split_sweep_flags(argv: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    """argv without the --sweep.FIELD=v1,v2 flags, and {FIELD: values}; exit 2 naming a
    malformed one."""
    rest, swept = [], {}
    for a in argv:
        if not a.startswith(SWEEP_PREFIX):
            rest.append(a)
            continue
        field, eq, text = a[len(SWEEP_PREFIX):].partition("=")
        if not eq or not field:
            fail(f"{a}: expected --sweep.FIELD=v1,v2,... (e.g. --sweep.lam=0.1,0.5)")
        try:
            swept[field] = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            fail(f"--sweep.{field}: '{text}' is not a comma-separated list of numbers")
    return rest, swept


def run(main, required: tuple[str, ...] = (), flags_parser=parse_flags,
        takes_words: bool = False) -> None:
    """Runs `main(argv)` as a command line whose flag errors are one line (`parse_flags`),
    whose stray words (anything after the flags that is not a `--name=value`) are refused the
    same way, never ignored, and whose disk faults (full, read-only, failing) are one line
    naming the file, exit 2. Ctrl-C is one line too (a run's says where it resumes), exit 130.

    Args:
      main: the program, given argv (the program's name only, unless `takes_words`: a stray
        word has exited 2).
      required: flags it cannot run without (e.g. 'config').
      flags_parser: argv -> the rest after the flags (`parse_flags`, or a program's own that
        ends in it, as `launch.sweep`'s).
      takes_words: the program reads words after its flags itself (`launch.report`'s run
        directory) and checks them.
    """
    if required:
        flags.mark_flags_as_required(list(required))

    def checked_main(argv: list[str]) -> None:
        if len(argv) > 1 and not takes_words:
            fail(f"unexpected arguments {argv[1:]}: flags are --name=value")
        try:
            main(argv)
        except OSError as e:  # a full disk, a read-only or failing file system: one line
            if not storage.is_storage_fault(e):
                raise
            fail(f"writing {storage.file_of(e) or 'the output'} failed: {storage.cause(e)}")
        except KeyboardInterrupt as e:  # Ctrl-C: one line (where to resume), the shell's 130
            print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
            sys.exit(130)

    app.run(checked_main, flags_parser=flags_parser)


def output_folder(flag: str, path: str, label: str = "") -> str:
    """Creates the folder an output flag names before any work is done, or one line and exit 2
    when it is a file, cannot be created or cannot be written.

    Args:
      flag: the flag's name, for the message (e.g. 'workdir').
      path: the folder.
      label: how the message names it, when not `--flag=path` (e.g. the folder of a file flag).

    Returns:
      `path`, an existing writable folder.
    """
    label = label or f"--{flag}={path}"
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{label} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        fail(f"{label} cannot be created ({e.strerror})")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"{label} cannot be written (permission denied)")
    return path
