"""Lists the registered federated methods and what each supports.

  python -m launch.methods            # the table
  python -m launch.methods --fields   # each method's own config fields: default, range, help
  python -m launch.methods --all_fields > docs/guide/config_fields.md   # every field, Markdown

One row per `config.algorithm` name, read from the algorithm registry
(`fedjax_pfedes/algorithms/registry.py`): how the server combines uploads, whether the method runs
under buffered asynchronous aggregation, has DP-SGD built in, accepts BatchNorm backbones, keeps
a private local-optimizer state across rounds (`config.train.reset_local_optimizer`), and the
paper.
"""

from __future__ import annotations

from absl import flags

from fedjax_pfedes import markdown
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.config import defaults
from fedjax_pfedes.config import fields as config_fields
from fedjax_pfedes.launch import cli

_FIELDS = flags.DEFINE_bool("fields", False, "list each method's own config fields (declared "
                            "in its module) with their defaults, ranges and help, and the "
                            "fields it reads")
_ALL_FIELDS = flags.DEFINE_bool("all_fields", False, "every config field, the core's and each "
                                "method's, as the Markdown page docs/guide/config_fields.md")


def table() -> str:
    """The registry as a Markdown table."""
    rows = [[f"`{name}`", e.aggregation,
             *("yes" if f else "" for f in (e.asynchronous, e.dp_sgd, e.batch_norm,
                                           e.private_optimizer)),
             ", ".join(e.modalities), e.summary]
            for name, e in sorted(registry.entries().items())]
    return markdown.table(["config.algorithm", "aggregation", "async", "DP-SGD", "BatchNorm",
                           "private opt.", "modalities", "method"], rows)


def fields() -> str:
    """Each method's own config fields with their defaults, ranges and help, and the other
    fields it reads."""
    lines = []
    for name, e in sorted(registry.entries().items()):
        lines.append(f"{name}:")
        if e.section is not None:
            for row in config_fields.rows(e.section):
                wanted = f"  [{row.wanted}]" if row.wanted else ""
                lines.append(f"  {row.path} = {row.default!r}{wanted}  {row.help}")
        if e.reads:
            lines.append("  reads: " + ", ".join(f"config.{p}" for p in e.reads))
    return "\n".join(lines)


def _section_table(section: type[config_fields.Section]) -> str:
    def cell(text: str) -> str:  # a '|' inside a cell would end it
        return text.replace("|", "\\|")
    rows = [[f"`{r.path}`", f"`{r.default!r}`", cell(r.wanted), cell(r.help)]
            for r in config_fields.rows(section)]
    return markdown.table(["field", "default", "range", "meaning"], rows)


def all_fields() -> str:
    """Every config field with its default, range and help, as a Markdown page: the core's
    sections, then each method's (`docs/guide/config_fields.md` is this output)."""
    parts = ["# Config fields", "",
             "Every field of the config, generated from the declarations "
             "(`python -m launch.methods --all_fields`): the core's sections "
             "(`fedjax_pfedes/config/`), then each method's (its module). A field's range is "
             "checked when its section is built; rules across fields are in the section's "
             "`check` and in `engine/validate.py`.", "",
             "## Top level", "", _section_table(defaults.TopLevel)]
    for name, section in defaults.SECTIONS.items():
        parts += ["", f"## `config.{name}`", "", (section.__doc__ or "").split("\n")[0], "",
                  _section_table(section)]
    for name, e in sorted(registry.entries().items()):
        if e.section is not None:
            parts += ["", f"## Method `{name}`", "", _section_table(e.section)]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> None:
    del argv
    if _ALL_FIELDS.value:
        print(all_fields(), end="")
    else:
        print(fields() if _FIELDS.value else table())


def console() -> None:
    """`python -m launch.methods` from a checkout; `fedjax-pfedes-methods` installed."""
    cli.run(main)


if __name__ == "__main__":
    console()
