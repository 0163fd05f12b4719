"""Lists the registered federated methods and what each supports.

  python -m launch.methods            # the table
  python -m launch.methods --fields   # each method's own config fields with their defaults

One row per `config.algorithm` name, read from the algorithm registry
(`fedjax_pfedes/algorithms/registry.py`): how the server combines uploads, whether the method runs
under buffered asynchronous aggregation, has DP-SGD built in, accepts BatchNorm backbones, keeps
a private local-optimizer state across rounds (`config.train.reset_local_optimizer`), and the
paper.
"""

from __future__ import annotations

from absl import app, flags

from fedjax_pfedes import markdown
from fedjax_pfedes.algorithms import registry

_FIELDS = flags.DEFINE_bool("fields", False, "list each method's own config fields (declared "
                            "in its module) with their defaults, and the fields it reads")


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
    """Each method's own config fields with their defaults, and the other fields it reads."""
    lines = []
    for name, e in sorted(registry.entries().items()):
        lines.append(f"{name}:")
        lines += [f"  config.{path} = {default!r}" for path, default in e.fields.items()]
        if e.reads:
            lines.append("  reads: " + ", ".join(f"config.{p}" for p in e.reads))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    print(fields() if _FIELDS.value else table())


def console() -> None:
    """`python -m launch.methods` from a checkout; `fedjax-pfedes-methods` installed."""
    app.run(main)


if __name__ == "__main__":
    console()
