"""Findings F1 and F2: pFedES against FedAvg as the clients' architectures differ more."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.studies.experiments import (
    heterogeneous_architectures,
    mean_std,
)
from fedjax_pfedes.studies.finding import (
    Records,
    Verdict,
    nanmean,
    plot_figure,
)
from fedjax_pfedes.studies.paired_verdicts import (
    INCONCLUSIVE,
    REPRODUCED,
    Paired,
    combined,
    comparison_table,
    final,
    paired_verdict,
    scored_final,
    within_verdict,
)

# ---------------------------------------------------------------------------- F1 / F2

RATIOS = (0.0, 0.4, 0.8)
# The minority's architectures: with four, none outnumbers convnet3 even at ratio 0.8 (4 clients
# of each of 5 architectures out of 20), so the ratio is the share off the majority, as defined.
MINORITY = ("convnet5", "vit", "mlp", "cnn_small")
HETERO_METHODS = ("pfedes", "fedavg", "standalone")
ONE_PP = 0.01  # F1's margin: one percentage point of accuracy


def hetero_variants(base) -> dict[str, dict]:
    n = base.data.num_clients
    out = {}
    for ratio in RATIOS:
        archs = heterogeneous_architectures(n, ratio, "convnet3", MINORITY)
        for method in HETERO_METHODS:
            out[f"hetero_r{ratio:g}_{method}"] = {"algorithm": method,
                                                  "clients.architectures": archs}
    return out


def positive_control(records: Records) -> Paired:
    """FedAvg with one architecture for everyone must beat Standalone: else the setup cannot
    show that collaboration helps, and F1/F2 cannot be decided on it."""
    return paired_verdict("control: FedAvg (one architecture) − Standalone",
                          scored_final(records["hetero_r0_fedavg"]),
                          scored_final(records["hetero_r0_standalone"]), +1)


def _gated(comparisons: Sequence[Paired], control: Paired) -> tuple[str, str]:
    """The combined verdict, inconclusive when the positive control fails; and why."""
    if control.verdict != REPRODUCED:
        return INCONCLUSIVE, ("the positive control failed (FedAvg on one architecture does not "
                              "beat Standalone): the setup cannot show collaboration")
    return combined(comparisons), "; ".join(f"{c.label}: {c.verdict}" for c in comparisons)


def f1_variants(base):
    return {k: v for k, v in hetero_variants(base).items() if k.startswith("hetero_r0_")}


def analyse_f1(records: Records, base, variants, figure: str) -> Verdict:
    rows = [[m, mean_std(final(records[f"hetero_r0_{m}"]))] for m in HETERO_METHODS]
    table = markdown.table(["method (all clients convnet3)", "personalized accuracy"], rows)
    same = within_verdict("pFedES − FedAvg, within ±1 pp",
                          scored_final(records["hetero_r0_pfedes"]),
                          scored_final(records["hetero_r0_fedavg"]), ONE_PP)
    control = positive_control(records)
    verdict, why = _gated([same], control)
    table += "\n\n" + comparison_table([same, control], 100, " pp")
    return Verdict(verdict, table, why)


def analyse_f2(records: Records, base, variants, figure: str) -> Verdict:
    leads, rows = {}, []
    for ratio in RATIOS:
        p = scored_final(records[f"hetero_r{ratio:g}_pfedes"])
        f = scored_final(records[f"hetero_r{ratio:g}_fedavg"])
        leads[ratio] = p - f
        rows.append([f"{ratio:g}", variants[f"hetero_r{ratio:g}_pfedes"]
                     ["clients.architectures"], mean_std(p), mean_std(f),
                     mean_std(final(records[f"hetero_r{ratio:g}_standalone"])),
                     f"{100 * np.mean(leads[ratio]):+.1f} pp"])
    table = markdown.table(["heterogeneity ratio", "architectures", "pfedes", "fedavg (per cohort)",
                    "standalone", "pfedes − fedavg"], rows)
    top = RATIOS[-1]
    grows = paired_verdict(f"lead at {top:g} − lead at 0", leads[top], leads[0.0], +1)
    beyond = paired_verdict(f"lead at {top:g}, beyond 10 pp", leads[top], 0 * leads[top], +1,
                            margin=0.10)
    control = positive_control(records)
    verdict, why = _gated([grows, beyond], control)
    table += "\n\n" + comparison_table([grows, beyond, control], 100, " pp")

    def draw(ax):
        for method in HETERO_METHODS:
            means = [nanmean(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            stds = [np.nanstd(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            ax.errorbar(RATIOS, means, yerr=stds, marker="o", capsize=3, label=method)
        ax.set_xlabel("heterogeneity ratio (share of clients off convnet3)")
        ax.set_ylabel("mean personalized accuracy")

    path = plot_figure(figure, "F2: accuracy vs model heterogeneity", draw)
    return Verdict(verdict, table, why, path)
