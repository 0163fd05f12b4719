"""Lists the registered federated methods and what each supports.

  python -m launch.methods

One row per `config.algorithm` name, read from the algorithm registry
(`fedjax_pfedes/algorithms/registry.py`): how the server combines uploads, whether the method runs
under buffered asynchronous aggregation, has DP-SGD built in, accepts BatchNorm backbones, keeps
a private local-optimizer state across rounds (`config.train.reset_local_optimizer`), and the
paper.
"""

from __future__ import annotations

from absl import app

from fedjax_pfedes.algorithms import registry


def table() -> str:
    """The registry as a Markdown table."""
    rows = ["| config.algorithm | aggregation | async | DP-SGD | BatchNorm | private opt. | "
            "modalities | method |", "|---|---|---|---|---|---|---|---|"]
    for name, e in sorted(registry.entries().items()):
        flags = ["yes" if f else "" for f in (e.asynchronous, e.dp_sgd, e.batch_norm,
                                               e.private_optimizer)]
        rows.append(f"| `{name}` | {e.aggregation} | {' | '.join(flags)} | "
                    f"{', '.join(e.modalities)} | {e.summary} |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    del argv
    print(table())


if __name__ == "__main__":
    app.run(main)
