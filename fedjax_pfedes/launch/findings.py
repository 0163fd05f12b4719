"""Runs the design's findings F1-F7 as experiments and writes their report with verdicts.

  python -m launch.findings --config=configs/quickstart.py --finding=all --seeds=5 \
      --workdir=runs/findings --output=docs/findings.md
  python -m launch.findings --config=configs/quickstart.py --config.data.name=digits \
      --finding=F3,F4 --seeds=5

Every finding's variants (fedjax_pfedes/studies/pfedes_findings.py) run for `--seeds` seeds on
the same data
(seeds config.seed, +1, ...); variants shared between findings run once, and finished runs in
<workdir>/<dataset>/ made with the same config are reused, so an interrupted command continues
where it stopped. The report section of this dataset in `--output` (between its
`<!-- findings:<dataset> -->` markers) is replaced; other datasets' sections stay. Figures go to
`--figures`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from fedjax_pfedes import markdown
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DataError, DatasetUnavailableError
from fedjax_pfedes.launch import cli, jobs_flag
from fedjax_pfedes.launch.cli import fail, loaded_config
from fedjax_pfedes.studies import experiments, pfedes_findings

_CONFIG = config_flags.DEFINE_config_file("config", None, "Base experiment config (pFedES).",
                                          lock_config=True)
_FINDING = flags.DEFINE_string("finding", "all", "F1..F7, a comma-separated list, or 'all'.")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Seeds per variant (the paired CI needs >= 2).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/findings", "Where the runs go.")
_OUTPUT = flags.DEFINE_string("output", "docs/findings.md", "The Markdown report.")
_FIGURES = flags.DEFINE_string("figures", "docs/figures", "Where the figures go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")


def population(config: ml_collections.ConfigDict, seeds: int) -> str:
    d, t = config.data, config.train
    machine = f"{jax.default_backend().upper()}, {os.cpu_count()} cores"
    return (f"Measured on {machine}. {d.name}, {d.num_clients} clients "
            f"({config.clients.architectures}), partition "
            f"{d.partition} (Dirichlet α {d.dirichlet_alpha:g} where it applies), "
            f"{t.rounds} rounds, {t.client_fraction:g} of the clients per round, E = "
            f"{t.local_epochs}, SGD lr {t.lr_local:g} momentum {t.local_momentum:g}, "
            f"λ {config.lam:g}, β {config.server_momentum:g}, d {config.proxy_dim}; "
            f"{seeds} seed(s) (seeds {config.seed}..{config.seed + seeds - 1}); mean ± std over "
            "seeds of the mean over all clients at the last round")


def section(config, seeds: int, command: str, verdicts: list[tuple], output: str,
            results: pfedes_findings.Records) -> str:
    """The Markdown of one dataset's findings (`results`: every variant's runs)."""
    name = config.data.name
    lines = [f"<!-- findings:{name} -->", f"## {name}", "", population(config, seeds) + ".",
             "", experiments.plateau_note(results), "",
             "```bash", command, "```", "",
             markdown.table(["finding", "claim", "verdict", "what the rule compared"],
                            [[f"[{f.id}](#{name}-{f.id.lower()})", f.claim, f"**{v.verdict}**",
                              v.reason] for f, v in verdicts])]
    for f, v in verdicts:
        lines += ["", f"<a id=\"{name}-{f.id.lower()}\"></a>", f"### {name} {f.id}: {f.claim}",
                  "", f"Rule: {f.rule}.", "", f"**Verdict: {v.verdict}** ({v.reason}).", "",
                  v.table]
        if v.figure:
            rel = os.path.relpath(v.figure, os.path.dirname(os.path.abspath(output)))
            lines += ["", f"![{f.id} on {name}]({rel})"]
    lines.append(f"<!-- /findings:{name} -->")
    return "\n".join(lines)


HEADER = """# Findings F1-F7, reproduced or refuted

Each finding of the pFedES design (docs/design.md) is run as an experiment by
`python -m launch.findings` with a verdict rule fixed in
`fedjax_pfedes/studies/pfedes_findings.py` (stated with each finding below). Numbers are from
the command shown with each dataset, on the machine named there; rerunning the command
regenerates its section.
"""


def write_section(output: str, name: str, text: str) -> None:
    """Replaces this dataset's section of `output` (or appends it)."""
    current = open(output).read() if os.path.exists(output) else HEADER
    begin, end = f"<!-- findings:{name} -->", f"<!-- /findings:{name} -->"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + text + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    with open(output, "w") as f:
        f.write(current)


def main(argv: list[str]) -> None:
    del argv
    base = loaded_config(_CONFIG)
    base.algorithm = "pfedes"
    base.monitor.client_report = True  # F4 reads every client's alignment losses
    base.monitor.aggregation_loss = True
    base.train.allow_divergence = True  # a diverging variant is a result (F5), not an error
    if _SEEDS.value < 1:
        fail(f"--seeds must be >= 1, got {_SEEDS.value}")
    try:
        chosen = pfedes_findings.resolve(_FINDING.value)
        variants = pfedes_findings.variants_of(chosen, base)
        for overrides in variants.values():
            validate_config(experiments.with_overrides(base, overrides))
    except (ConfigError, ValueError) as e:
        fail(str(e))
    cli.output_folder("workdir", _WORKDIR.value)
    cli.output_folder("figures", _FIGURES.value)
    cli.output_folder("output", os.path.dirname(os.path.abspath(_OUTPUT.value)),
                      f"the folder of --output={_OUTPUT.value}")
    try:
        workdir = os.path.join(_WORKDIR.value, base.data.name)
        with jobs_flag.run_pool(_PROGRESS.value) as pool:
            results = experiments.run_grid(base, variants, _SEEDS.value, workdir,
                                           _PROGRESS.value, reuse=True, pool=pool)
    except (ConfigError, DatasetUnavailableError, DataError, ValueError) as e:
        fail(str(e))
    verdicts = []
    for f in chosen:
        figure = os.path.join(_FIGURES.value, f"findings_{base.data.name}_{f.id}.png")
        verdicts.append((f, f.analyse(results, base, variants, figure)))
    command = "python -m launch.findings " + " ".join(sys.argv[1:])
    write_section(_OUTPUT.value, base.data.name,
                  section(base, _SEEDS.value, command, verdicts, _OUTPUT.value, results))
    with open(os.path.join(workdir, "findings.json"), "w") as fh:
        json.dump({f.id: {"verdict": v.verdict, "reason": v.reason} for f, v in verdicts}, fh,
                  indent=1)
    for f, v in verdicts:
        print(f"{f.id}: {v.verdict} ({v.reason})")
    print(f"wrote {_OUTPUT.value}")


def console() -> None:
    """`python -m launch.findings` from a checkout; `fedjax-pfedes-findings` installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
