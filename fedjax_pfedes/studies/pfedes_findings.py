"""The design's findings F1-F7 as experiments with stated verdict rules.

docs/design.md lists seven behaviours the pFedES design expects. Each `Finding` here names its
claim, the config variants its experiment runs (dotted overrides of a base config, several seeds,
same data), a metric per variant computed from the runs' metrics.jsonl, and a rule that turns the
metrics into a verdict by one statistical rule (`paired_verdict`): every comparison is a
paired difference over seeds (same seed: same data, clients and sampling) with a Student-t 95%
confidence interval; 'reproduced' only when the interval excludes 0 in the claimed direction,
'refuted' when it excludes 0 in the opposite direction, 'inconclusive' otherwise. A finding
with several comparisons is reproduced when all are, refuted when any is. Diverged seeds are
never dropped: they count with a stated value (accuracy 0, oscillation `DIVERGED_OSCILLATION`)
or, for metrics without one, make the comparison inconclusive. The rules are stated in `rule`
(and printed in docs/findings.md), fixed before looking at results, so a verdict is mechanical.
`launch.findings` runs them and writes the report.

Variants are shared between findings by name (the default pFedES run serves F3-F7), so running
all seven costs 17 variants x seeds runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.studies.experiments import (
    heterogeneous_architectures,
    mean_std,
)
from fedjax_pfedes.studies.paired_verdicts import (
    INCONCLUSIVE,
    REPRODUCED,
    Paired,
    combined,
    comparison_table,
    curve,
    final,
    oscillation,
    paired_verdict,
    scored_final,
    scored_oscillation,
    within_verdict,
)

Records = dict[str, list[dict]]  # variant name -> one record per seed (experiments.run_grid)

@dataclasses.dataclass(frozen=True)
class Verdict:
    verdict: str
    table: str            # Markdown
    reason: str           # one sentence with the numbers the rule compared
    figure: str = ""      # path of the PNG ('' = none)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding: its claim, the rule deciding it, its variants and its analysis."""

    id: str
    claim: str
    rule: str
    variants: Callable[[ml_collections.ConfigDict], dict[str, dict]]
    analyse: Callable[[Records, ml_collections.ConfigDict, dict[str, dict], str], Verdict]


# ---------------------------------------------------------------------------- helpers


def _nanmean(values) -> float:
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else float("nan")


def _plot(path: str, title: str, draw: Callable) -> str:
    from fedjax_pfedes.io.plotting import plt, save

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    draw(ax)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path, dpi=100)


def _curves_plot(records: Records, names: dict[str, str], key: str, ylabel: str, path: str,
                 title: str) -> str:
    def draw(ax):
        for name, label in names.items():
            c = curve(records[name], key)
            rounds = np.arange(1, c.shape[1] + 1)
            mean = np.nanmean(np.where(np.isfinite(c), c, np.nan), axis=0)
            ax.plot(rounds, mean, "-o", ms=2.5, label=label)
            if c.shape[0] > 1:
                std = np.nanstd(c, axis=0)
                ax.fill_between(rounds, mean - std, mean + std, alpha=0.15)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)

    return _plot(path, title, draw)


DEFAULT = "pfedes_default"  # the base config's pFedES run, shared by F3-F7


# ---------------------------------------------------------------------------- F1 / F2

RATIOS = (0.0, 0.4, 0.8)
# The minority's architectures: with four, none outnumbers convnet3 even at ratio 0.8 (4 clients
# of each of 5 architectures out of 20), so the ratio is the share off the majority, as defined.
MINORITY = ("convnet5", "vit", "mlp", "cnn_small")
HETERO_METHODS = ("pfedes", "fedavg", "standalone")
ONE_PP = 0.01  # F1's margin: one percentage point of accuracy


def _hetero_variants(base) -> dict[str, dict]:
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


def _f1_variants(base):
    return {k: v for k, v in _hetero_variants(base).items() if k.startswith("hetero_r0_")}


def _f1(records: Records, base, variants, figure: str) -> Verdict:
    rows = [[m, mean_std(final(records[f"hetero_r0_{m}"]))] for m in HETERO_METHODS]
    table = markdown.table(["method (all clients convnet3)", "personalized accuracy"], rows)
    same = within_verdict("pFedES − FedAvg, within ±1 pp",
                          scored_final(records["hetero_r0_pfedes"]),
                          scored_final(records["hetero_r0_fedavg"]), ONE_PP)
    control = positive_control(records)
    verdict, why = _gated([same], control)
    table += "\n\n" + comparison_table([same, control], 100, " pp")
    return Verdict(verdict, table, why)


def _f2(records: Records, base, variants, figure: str) -> Verdict:
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
            means = [_nanmean(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            stds = [np.nanstd(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            ax.errorbar(RATIOS, means, yerr=stds, marker="o", capsize=3, label=method)
        ax.set_xlabel("heterogeneity ratio (share of clients off convnet3)")
        ax.set_ylabel("mean personalized accuracy")

    path = _plot(figure, "F2: accuracy vs model heterogeneity", draw)
    return Verdict(verdict, table, why, path)


# ---------------------------------------------------------------------------- F3 λ

LAMBDAS = (0.1, 0.5, 1.0, 2.0)


def _lam_name(lam: float, base) -> str:
    return DEFAULT if lam == base.lam else f"lam{lam:g}"


def _f3_variants(base):
    return {_lam_name(lam, base): {} if lam == base.lam else {"lam": lam} for lam in LAMBDAS}


def _f3(records: Records, base, variants, figure: str) -> Verdict:
    names = {lam: _lam_name(lam, base) for lam in LAMBDAS}
    rows = [[f"{lam:g}", mean_std(final(records[n])),
             mean_std(final(records[n], "global_accuracy_mean"))] for lam, n in names.items()]
    table = markdown.table(["λ", "personalized accuracy", "global accuracy"], rows)

    def draw(ax):
        for key, label in (("personalized_accuracy_mean", "personalized"),
                           ("global_accuracy_mean", "global")):
            ax.errorbar(LAMBDAS, [_nanmean(final(records[n], key)) for n in names.values()],
                        yerr=[np.nanstd(final(records[n], key)) for n in names.values()],
                        marker="o", capsize=3, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("λ (alignment weight)")
        ax.set_ylabel("mean accuracy")

    path = _plot(figure, "F3: local vs global accuracy vs λ", draw)
    hi, mid = records[names[2.0]], records[names[0.5]]
    comparisons = [
        paired_verdict("global accuracy, λ 2.0 − λ 0.5",
                       scored_final(hi, "global_accuracy_mean"),
                       scored_final(mid, "global_accuracy_mean"), +1),
        paired_verdict("personalized accuracy, λ 2.0 − λ 0.5", scored_final(hi),
                       scored_final(mid), -1)]
    table += "\n\n" + comparison_table(comparisons, 100, " pp")
    return Verdict(combined(comparisons), table,
                   "; ".join(f"{c.label}: {c.verdict}" for c in comparisons), path)


# ---------------------------------------------------------------------------- F4 β

BETAS = (0.0, 0.5, 0.9)
# The jump F4 is about needs a global E_proxy that moves between two participations of a
# client: few participants a round (each client then returns after ~1/fraction rounds of other
# clients' training) and long local training (E = 3). E_proxy's step is the default
# effective-step rule (the stated ratio of the private model's step). The arms run
# `f4_rounds(base)` rounds: as many participations per client as the base run's rounds give.
F4_SETUP = {"train.client_fraction": 0.1, "train.local_epochs": 3}


def f4_rounds(base) -> int:
    """F4's rounds: the base config's `train.rounds` times base fraction / F4's fraction (at
    least the base's), so that each client trains as often as in the other findings' runs (at
    a fifth of the participants a round its curve would otherwise stop far from a plateau)."""
    factor = float(base.train.client_fraction) / F4_SETUP["train.client_fraction"]
    return max(int(base.train.rounds), int(round(base.train.rounds * factor)))


def _beta_name(beta: float) -> str:
    return f"f4_beta{beta:g}"


def _f4_variants(base):
    return {_beta_name(b): {**F4_SETUP, "train.rounds": f4_rounds(base), "server_momentum": b}
            for b in BETAS}


def client_jumps(clients_jsonl: str) -> list[float]:
    """Every alignment-loss jump a client saw: for two consecutive participations of a client,
    its loss right after receiving the aggregated E_proxy (align_loss_at_start) minus its loss
    at the end of the previous one (align_loss_at_end), on the same rows of its data."""
    last_end: dict[int, float] = {}
    jumps = []
    with open(clients_jsonl) as f:
        for line in f:
            row = json.loads(line)
            if "align_loss_at_start" not in row:
                continue
            cid = row["client"]
            if cid in last_end:
                jumps.append(row["align_loss_at_start"] - last_end[cid])
            last_end[cid] = row["align_loss_at_end"]
    return jumps


def _jump(records: list[dict]) -> np.ndarray:
    """[seeds] mean alignment-loss jump per (client, next participation)."""
    return np.array([_nanmean(client_jumps(os.path.join(r["run_dir"], "clients.jsonl")))
                     for r in records])


def _server_jump(records: list[dict]) -> np.ndarray:
    """[seeds] mean over rounds of the participants' local-test alignment loss against the new
    E_proxy minus against the old one (the server step alone)."""
    return np.nanmean(curve(records, "align_loss_after_aggregation")
                      - curve(records, "align_loss_before_aggregation"), axis=1)


def _f4_setup_words() -> str:
    return (f"{F4_SETUP['train.client_fraction']:g} of the clients a round, "
            f"E = {F4_SETUP['train.local_epochs']}")


def _f4(records: Records, base, variants, figure: str) -> Verdict:
    names = {b: _beta_name(b) for b in BETAS}
    rows = [[f"{b:g}", mean_std(_jump(records[n]), digits=5),
             mean_std(_server_jump(records[n]), digits=5),
             mean_std(final(records[n]))] for b, n in names.items()]
    table = markdown.table([f"β (server momentum; {_f4_setup_words()}, {f4_rounds(base)} rounds)",
                    "jump a client sees (loss "
                    "at the start of a participation − at the end of its previous one)",
                    "server-step change (local test, new − old E_proxy)",
                    "personalized accuracy"], rows)
    path = _curves_plot(records, {n: f"β = {b:g}" for b, n in names.items()},
                        "train_align_loss_mean", "mean training alignment loss", figure,
                        "F4: alignment loss per round vs server momentum")
    j0, j5 = _jump(records[names[0.0]]), _jump(records[names[0.5]])
    exists = paired_verdict("jump at β = 0 (the condition: a jump exists)", j0, 0 * j0, +1)
    smaller = paired_verdict("jump at β = 0.5 − jump at β = 0", j5, j0, -1)
    table += "\n\n" + comparison_table([exists, smaller])
    if exists.verdict != REPRODUCED:
        return Verdict(INCONCLUSIVE, table, "no jump after aggregation is shown at β = 0: the "
                       "condition the claim is about does not arise here", path)
    return Verdict(smaller.verdict, table, f"{smaller.label}: {smaller.verdict}", path)


# ---------------------------------------------------------------------------- F5 stop-gradients

# With the symmetric default losses a removed stop-gradient is only a rescaled lam or E_proxy
# step (refused; algorithms/pfedes/__init__.py), so F5 runs all three arms with InfoNCE alignment.
F5_ALIGN = "contrastive"
F5_DESIGN = "f5_design"
F5_VARIANTS = {F5_DESIGN: f"both stop-gradients (design), align={F5_ALIGN}",
               "no_sg_proxy": "E_proxy output not stopped in the local step",
               "no_sg_local": "e_local not stopped in E_proxy's step"}


def _f5_variants(base):
    return {F5_DESIGN: {"align": F5_ALIGN},
            "no_sg_proxy": {"align": F5_ALIGN, "stop_gradient_proxy": False},
            "no_sg_local": {"align": F5_ALIGN, "stop_gradient_local": False}}


def _osc(records: list[dict], key: str) -> np.ndarray:
    return np.array([oscillation(c) for c in curve(records, key)])


def _f5(records: Records, base, variants, figure: str) -> Verdict:
    rows = []
    osc = {}
    for name, label in F5_VARIANTS.items():
        osc[name] = scored_oscillation(records[name], "train_align_loss_mean")
        rows.append([label, mean_std(osc[name]),
                     mean_std(_osc(records[name], "train_ce_loss_mean")),
                     mean_std(final(records[name]))])
    table = markdown.table(["variant", "oscillation of the alignment loss", "oscillation of the CE "
                    "loss", "personalized accuracy"], rows)
    path = _curves_plot(records, F5_VARIANTS, "train_align_loss_mean",
                        "mean training alignment loss", figure,
                        "F5: alignment loss per round with / without stop-gradients")
    comparisons = [paired_verdict(f"oscillation, {F5_VARIANTS[n]} − design", osc[n],
                                  osc[F5_DESIGN], +1) for n in ("no_sg_proxy", "no_sg_local")]
    table += "\n\n" + comparison_table(comparisons)
    return Verdict(combined(comparisons), table,
                   "; ".join(f"{c.label}: {c.verdict}" for c in comparisons), path)


# ---------------------------------------------------------------------------- F6 warm-up

# A small share of a client's training: the quick start's clients take ~10-40 local steps a
# round over 5-10 participations, so 5 frozen steps are a few percent of it.
WARMUP_STEPS = 5


def _f6_variants(base):
    return {DEFAULT: {}, f"warmup{WARMUP_STEPS}": {"warmup_steps": WARMUP_STEPS}}


def convergence_round(values: np.ndarray) -> float:
    """First round (1-based) by which 90% of the curve's drop from round 1 to its minimum is
    done; NaN for a non-finite curve."""
    v = np.asarray(values, np.float64)
    if not np.all(np.isfinite(v)):
        return float("nan")
    target = v[0] - 0.9 * (v[0] - v.min())
    return float(np.argmax(v <= target) + 1)


def _f6(records: Records, base, variants, figure: str) -> Verdict:
    names = {DEFAULT: "no warm-up", f"warmup{WARMUP_STEPS}":
             f"backbone frozen for the first {WARMUP_STEPS} local steps"}
    conv = {n: np.array([convergence_round(c)
                         for c in curve(records[n], "train_align_loss_mean")]) for n in names}
    early = {n: np.nanmean(curve(records[n], "train_align_loss_mean")[:, :5], axis=1)
             for n in names}
    rows = [[label, mean_std(conv[n], digits=1), mean_std(early[n]),
             mean_std(final(records[n]))] for n, label in names.items()]
    table = markdown.table(["variant", "rounds to 90% of the alignment-loss drop", "mean alignment "
                    "loss, rounds 1-5", "personalized accuracy"], rows)
    path = _curves_plot(records, names, "train_align_loss_mean", "mean training alignment loss",
                        figure, "F6: projection-head convergence with / without warm-up")
    w = f"warmup{WARMUP_STEPS}"
    comparisons = [
        paired_verdict("rounds to 90% of the drop, warm-up − none", conv[w], conv[DEFAULT], -1),
        paired_verdict("alignment loss rounds 1-5, warm-up − none", early[w], early[DEFAULT],
                       -1)]
    table += "\n\n" + comparison_table(comparisons)
    return Verdict(combined(comparisons), table,
                   "; ".join(f"{c.label}: {c.verdict}" for c in comparisons), path)


# ---------------------------------------------------------------------------- F7 local epochs

EPOCHS = (1, 2, 3)


def _epoch_name(e: int, base) -> str:
    return DEFAULT if e == base.train.local_epochs else f"epochs{e}"


def _f7_variants(base):
    return {_epoch_name(e, base): {} if e == base.train.local_epochs
            else {"train.local_epochs": e} for e in EPOCHS}


def _f7(records: Records, base, variants, figure: str) -> Verdict:
    names = {e: _epoch_name(e, base) for e in EPOCHS}
    osc = {e: scored_oscillation(records[n], "train_align_loss_mean") for e, n in names.items()}
    rows = [[str(e), mean_std(osc[e]), mean_std(final(records[n]))] for e, n in names.items()]
    table = markdown.table(["local epochs E", "oscillation of the alignment loss",
                    "personalized accuracy"], rows)
    path = _curves_plot(records, {n: f"E = {e}" for e, n in names.items()},
                        "train_align_loss_mean", "mean training alignment loss", figure,
                        "F7: alignment loss per round vs local epochs")
    smoother = paired_verdict("oscillation, E = 3 − E = 1", osc[3], osc[1], -1)
    table += "\n\n" + comparison_table([smoother])
    return Verdict(smoother.verdict, table, f"{smoother.label}: {smoother.verdict}", path)


# ---------------------------------------------------------------------------- the catalogue

FINDINGS: dict[str, Finding] = {f.id: f for f in (
    Finding("F1", "with one architecture for everyone, pFedES is within about 1 point of FedAvg",
            "paired by seed, final personalized accuracy: reproduced if the 95% CI of "
            "pFedES − FedAvg lies within ±1 pp, refuted if it lies wholly outside, else "
            "inconclusive; inconclusive too unless the positive control (FedAvg − Standalone "
            "with one architecture, CI > 0) holds", _f1_variants, _f1),
    Finding("F2", "as the heterogeneity ratio grows from 0 to 0.8, pFedES's lead over FedAvg "
            "run per architecture cohort grows beyond 10 points",
            "ratio = share of clients whose architecture differs from the majority (at 0.8: 4 "
            "clients of each of 5 architectures); lead = pFedES − FedAvg per seed; reproduced "
            "if the CIs of (lead at 0.8 − lead at 0) > 0 and of the lead at 0.8 > 10 pp, "
            "refuted if either lies on the other side, else inconclusive; gated by the "
            "positive control as F1", _hetero_variants, _f2),
    Finding("F3", "λ = 2.0 raises global accuracy but lowers personalized accuracy; λ ≈ 0.5 "
            "balances them",
            "paired by seed against λ = 0.5: reproduced if the CI of λ 2.0's global accuracy "
            "difference is > 0 and of its personalized one < 0; refuted if either lies on "
            "the other side of 0; else inconclusive", _f3_variants, _f3),
    Finding("F4", "server momentum β ≈ 0.5 removes the jump of the loss right after aggregation",
            "jump = a client's alignment loss right after receiving the aggregated E_proxy "
            "minus its loss at the end of its previous participation (same rows of its data), "
            "averaged over clients and participations, in a setup where E_proxy moves between "
            f"a client's participations ({_f4_setup_words()}, rounds × the base's fraction / "
            f"{F4_SETUP['train.client_fraction']:g}: as many participations per client); "
            "inconclusive unless the CI of the jump at β = 0 is > 0 (the condition exists); "
            "then reproduced if the CI of jump(β = 0.5) − jump(β = 0) is < 0, refuted if > 0",
            _f4_variants, _f4),
    Finding("F5", "removing either stop-gradient makes the losses oscillate",
            "oscillation = mean |second difference| / mean of the per-round training "
            "alignment loss (a diverged run scores 1.0); all arms align with InfoNCE (with "
            "MSE or cosine a removed stop-gradient is only a rescaled λ or E_proxy step); "
            "reproduced if the CI of (variant − design) is > 0 for both variants, refuted if "
            "either is < 0", _f5_variants, _f5),
    Finding("F6", "warm-up (frozen F_k) makes the projection head converge faster",
            f"warm-up = backbone frozen for the first {WARMUP_STEPS} local steps of a client; "
            "reproduced if the CIs of (warm-up − none) are < 0 for both the rounds to 90% of "
            "the alignment-loss drop and the mean alignment loss over rounds 1-5, refuted if "
            "either is > 0", _f6_variants, _f6),
    Finding("F7", "3 local epochs give a smoother alignment loss than 1",
            "reproduced if the CI of oscillation(E = 3) − oscillation(E = 1) is < 0, refuted "
            "if > 0 (a diverged run scores 1.0)", _f7_variants, _f7),
)}


def resolve(spec: str) -> list[Finding]:
    """'F3', 'F1,F4' or 'all' -> findings; ValueError naming --finding otherwise."""
    if spec == "all":
        return list(FINDINGS.values())
    ids = [s.strip().upper() for s in spec.split(",") if s.strip()]
    unknown = [i for i in ids if i not in FINDINGS]
    if unknown or not ids:
        raise ValueError(f"--finding={spec}: unknown {unknown or spec}; known: "
                         f"{list(FINDINGS)} or 'all'")
    return [FINDINGS[i] for i in ids]


def variants_of(findings: Sequence[Finding], base: ml_collections.ConfigDict
                ) -> dict[str, dict]:
    """The union of the findings' variants (shared names run once)."""
    out: dict[str, dict] = {}
    for f in findings:
        for name, overrides in f.variants(base).items():
            if name in out and out[name] != overrides:
                raise AssertionError(f"variant {name} defined twice differently")
            out[name] = overrides
    return out
