"""The design's findings F1-F7 as experiments with stated verdict rules.

docs/design.md lists seven behaviours the pFedES design expects. Each `Finding` here names its
claim, the config variants its experiment runs (dotted overrides of a base config, several seeds,
same data), a metric per variant computed from the runs' metrics.jsonl, and a rule that turns the
metrics into a verdict: 'reproduced', 'partly' or 'not reproduced'. The rules are stated in
`rule` (and printed in docs/findings.md), fixed before looking at results, so a verdict is
mechanical. `launch.findings` runs them and writes the report.

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

from fedjax_pfedes.experiments import heterogeneous_architectures, mean_std

Records = dict[str, list[dict]]  # variant name -> one record per seed (experiments.run_grid)

REPRODUCED, PARTLY, NOT_REPRODUCED = "reproduced", "partly", "not reproduced"


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


def final(records: list[dict], key: str = "personalized_accuracy_mean") -> np.ndarray:
    """[seeds] final-round value of `key` (NaN for a diverged run)."""
    return np.array([np.nan if r.get("diverged") else r["final"][key] for r in records])


def curve(records: list[dict], key: str) -> np.ndarray:
    """[seeds, rounds] per-round values of `key`: NaN where missing, and after the last round of
    a run that stopped early (diverged)."""
    rows = [[np.nan if v is None else v for v in r["curves"][key]] for r in records]
    out = np.full((len(rows), max(map(len, rows), default=0)), np.nan)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def oscillation(values: np.ndarray) -> float:
    """Round-to-round roughness of a loss curve: mean |L[t+1] - 2 L[t] + L[t-1]| / mean L (a
    smooth monotone curve scores ~0, a zig-zag high); inf when the curve is not finite."""
    v = np.asarray(values, np.float64)
    if len(v) < 3:
        return float("nan")
    if not np.all(np.isfinite(v)):
        return float("inf")
    return float(np.mean(np.abs(np.diff(v, 2))) / max(np.mean(np.abs(v)), 1e-12))


def _nanmean(values) -> float:
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else float("nan")


def _plot(path: str, title: str, draw: Callable) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    draw(ax)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


DEFAULT = "pfedes_default"  # the base config's pFedES run, shared by F3-F7


# ---------------------------------------------------------------------------- F1 / F2

RATIOS = (0.0, 0.4, 0.8)


def _hetero_variants(base) -> dict[str, dict]:
    n = base.data.num_clients
    out = {}
    for ratio in RATIOS:
        archs = heterogeneous_architectures(n, ratio, "convnet3", ("convnet5", "vit"))
        for method in ("pfedes", "fedavg"):
            out[f"hetero_r{ratio:g}_{method}"] = {"algorithm": method,
                                                  "clients.architectures": archs}
    return out


def _f1_variants(base):
    return {k: v for k, v in _hetero_variants(base).items() if k.startswith("hetero_r0_")}


def _f1(records: Records, base, variants, figure: str) -> Verdict:
    p, f = final(records["hetero_r0_pfedes"]), final(records["hetero_r0_fedavg"])
    diff = 100 * (_nanmean(p) - _nanmean(f))
    table = _table(["method (all clients convnet3)", "personalized accuracy"],
                   [["pfedes", mean_std(p)], ["fedavg", mean_std(f)],
                    ["pfedes − fedavg", f"{diff:+.1f} pp"]])
    verdict = (REPRODUCED if abs(diff) <= 1 else PARTLY if abs(diff) <= 3
               else NOT_REPRODUCED)
    return Verdict(verdict, table, f"pFedES − FedAvg = {diff:+.1f} pp with one architecture")


def _f2(records: Records, base, variants, figure: str) -> Verdict:
    leads, rows = [], []
    for ratio in RATIOS:
        p = final(records[f"hetero_r{ratio:g}_pfedes"])
        f = final(records[f"hetero_r{ratio:g}_fedavg"])
        lead = 100 * (_nanmean(p) - _nanmean(f))
        leads.append(lead)
        rows.append([f"{ratio:g}", variants[f"hetero_r{ratio:g}_pfedes"]
                     ["clients.architectures"], mean_std(p), mean_std(f), f"{lead:+.1f} pp"])
    table = _table(["heterogeneity ratio", "architectures", "pfedes", "fedavg (per cohort)",
                    "pfedes − fedavg"], rows)

    def draw(ax):
        for method in ("pfedes", "fedavg"):
            means = [_nanmean(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            stds = [np.nanstd(final(records[f"hetero_r{r:g}_{method}"])) for r in RATIOS]
            ax.errorbar(RATIOS, means, yerr=stds, marker="o", capsize=3, label=method)
        ax.set_xlabel("heterogeneity ratio (share of clients off convnet3)")
        ax.set_ylabel("mean personalized accuracy")

    path = _plot(figure, "F2: accuracy vs model heterogeneity", draw)
    grows = all(b > a for a, b in zip(leads, leads[1:], strict=False))
    verdict = (REPRODUCED if grows and leads[-1] > 10
               else PARTLY if leads[-1] > leads[0] else NOT_REPRODUCED)
    return Verdict(verdict, table, "pFedES's lead by ratio: "
                   + ", ".join(f"{r:g}: {lead:+.1f} pp" for r, lead in zip(RATIOS, leads,
                                                                           strict=True)), path)


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
    table = _table(["λ", "personalized accuracy", "global accuracy"], rows)

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
    g = {lam: _nanmean(final(records[n], "global_accuracy_mean")) for lam, n in names.items()}
    p = {lam: _nanmean(final(records[n])) for lam, n in names.items()}
    holds = [g[2.0] > g[0.5], p[2.0] < p[0.5]]
    verdict = REPRODUCED if all(holds) else PARTLY if any(holds) else NOT_REPRODUCED
    return Verdict(verdict, table, f"λ 2.0 vs 0.5: global {g[2.0]:.4f} vs {g[0.5]:.4f}, "
                   f"personalized {p[2.0]:.4f} vs {p[0.5]:.4f}", path)


# ---------------------------------------------------------------------------- F4 β

BETAS = (0.0, 0.5, 0.9)


def _beta_name(beta: float, base) -> str:
    return DEFAULT if beta == base.server_momentum else f"beta{beta:g}"


def _f4_variants(base):
    return {_beta_name(b, base): {} if b == base.server_momentum else {"server_momentum": b}
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


def _f4(records: Records, base, variants, figure: str) -> Verdict:
    names = {b: _beta_name(b, base) for b in BETAS}
    rows = [[f"{b:g}", mean_std(_jump(records[n]), digits=5),
             mean_std(_server_jump(records[n]), digits=5),
             mean_std(final(records[n]))] for b, n in names.items()]
    table = _table(["β (server momentum)", "jump a client sees (loss at the start of a "
                    "participation − at the end of its previous one)", "server-step change "
                    "(local test, new − old E_proxy)", "personalized accuracy"], rows)
    path = _curves_plot(records, {n: f"β = {b:g}" for b, n in names.items()},
                        "train_align_loss_mean", "mean training alignment loss", figure,
                        "F4: alignment loss per round vs server momentum")
    j0, j5 = _nanmean(_jump(records[names[0.0]])), _nanmean(_jump(records[names[0.5]]))
    verdict = (REPRODUCED if j0 > 0 and j5 <= 0.25 * j0
               else PARTLY if j5 < j0 else NOT_REPRODUCED)
    return Verdict(verdict, table, f"mean jump β=0: {j0:+.5f}, β=0.5: {j5:+.5f}", path)


# ---------------------------------------------------------------------------- F5 stop-gradients

F5_VARIANTS = {DEFAULT: "both stop-gradients (design)",
               "no_sg_proxy": "E_proxy output not stopped in the local step",
               "no_sg_local": "e_local not stopped in E_proxy's step"}


def _f5_variants(base):
    return {DEFAULT: {}, "no_sg_proxy": {"stop_gradient_proxy": False},
            "no_sg_local": {"stop_gradient_local": False}}


def _osc(records: list[dict], key: str) -> np.ndarray:
    return np.array([oscillation(c) for c in curve(records, key)])


def _f5(records: Records, base, variants, figure: str) -> Verdict:
    rows = []
    osc = {}
    for name, label in F5_VARIANTS.items():
        osc[name] = _osc(records[name], "train_align_loss_mean")
        rows.append([label, mean_std(osc[name]),
                     mean_std(_osc(records[name], "train_ce_loss_mean")),
                     mean_std(final(records[name]))])
    table = _table(["variant", "oscillation of the alignment loss", "oscillation of the CE "
                    "loss", "personalized accuracy"], rows)
    path = _curves_plot(records, F5_VARIANTS, "train_align_loss_mean",
                        "mean training alignment loss", figure,
                        "F5: alignment loss per round with / without stop-gradients")
    base = _nanmean(osc[DEFAULT])
    ratios = [np.mean(osc[n]) / base if base > 0 else np.inf for n in ("no_sg_proxy",
                                                                       "no_sg_local")]
    verdict = (REPRODUCED if all(r > 1.5 for r in ratios)
               else PARTLY if any(r > 1.5 for r in ratios) else NOT_REPRODUCED)
    return Verdict(verdict, table, "oscillation relative to the design: no stop-gradient on "
                   f"E_proxy {ratios[0]:.2f}x, on e_local {ratios[1]:.2f}x", path)


# ---------------------------------------------------------------------------- F6 warm-up

WARMUP_STEPS = 20


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
    table = _table(["variant", "rounds to 90% of the alignment-loss drop", "mean alignment "
                    "loss, rounds 1-5", "personalized accuracy"], rows)
    path = _curves_plot(records, names, "train_align_loss_mean", "mean training alignment loss",
                        figure, "F6: projection-head convergence with / without warm-up")
    w = f"warmup{WARMUP_STEPS}"
    faster = _nanmean(conv[DEFAULT]) - _nanmean(conv[w])
    lower = _nanmean(early[w]) < _nanmean(early[DEFAULT])
    verdict = (REPRODUCED if faster >= 1 and lower else PARTLY if faster >= 1 or lower
               else NOT_REPRODUCED)
    return Verdict(verdict, table, f"warm-up reaches 90% of the drop {faster:+.1f} rounds "
                   f"earlier; early alignment loss {'lower' if lower else 'not lower'}", path)


# ---------------------------------------------------------------------------- F7 local epochs

EPOCHS = (1, 2, 3)


def _epoch_name(e: int, base) -> str:
    return DEFAULT if e == base.train.local_epochs else f"epochs{e}"


def _f7_variants(base):
    return {_epoch_name(e, base): {} if e == base.train.local_epochs
            else {"train.local_epochs": e} for e in EPOCHS}


def _f7(records: Records, base, variants, figure: str) -> Verdict:
    names = {e: _epoch_name(e, base) for e in EPOCHS}
    osc = {e: _osc(records[n], "train_align_loss_mean") for e, n in names.items()}
    rows = [[str(e), mean_std(osc[e]), mean_std(final(records[n]))] for e, n in names.items()]
    table = _table(["local epochs E", "oscillation of the alignment loss",
                    "personalized accuracy"], rows)
    path = _curves_plot(records, {n: f"E = {e}" for e, n in names.items()},
                        "train_align_loss_mean", "mean training alignment loss", figure,
                        "F7: alignment loss per round vs local epochs")
    o1, o3 = _nanmean(osc[1]), _nanmean(osc[3])
    verdict = (REPRODUCED if o3 < 0.67 * o1 else PARTLY if o3 < o1 else NOT_REPRODUCED)
    return Verdict(verdict, table, f"oscillation E=1: {o1:.4f}, E=3: {o3:.4f}", path)


# ---------------------------------------------------------------------------- the catalogue

FINDINGS: dict[str, Finding] = {f.id: f for f in (
    Finding("F1", "with one architecture for everyone, pFedES is within about 1 point of FedAvg",
            "reproduced if |pFedES − FedAvg| ≤ 1 pp (mean personalized accuracy over seeds), "
            "partly if ≤ 3 pp", _f1_variants, _f1),
    Finding("F2", "as the heterogeneity ratio grows from 0 to 0.8, pFedES's lead over FedAvg "
            "run per architecture cohort grows beyond 10 points",
            "reproduced if the lead grows at every ratio step (0, 0.4, 0.8) and exceeds 10 pp "
            "at 0.8; partly if the lead at 0.8 exceeds the lead at 0", _hetero_variants, _f2),
    Finding("F3", "λ = 2.0 raises global accuracy but lowers personalized accuracy; λ ≈ 0.5 "
            "balances them",
            "reproduced if, against λ = 0.5, λ = 2.0 has higher global and lower personalized "
            "accuracy; partly if one of the two holds", _f3_variants, _f3),
    Finding("F4", "server momentum β ≈ 0.5 removes the jump of the loss right after aggregation",
            "jump = a client's alignment loss right after receiving the aggregated E_proxy "
            "minus its loss at the end of its previous participation (same rows of its data), "
            "averaged over clients and participations; reproduced if the jump at β = 0 is "
            "positive and β = 0.5 cuts it to ≤ 25%; partly if β = 0.5 lowers it",
            _f4_variants, _f4),
    Finding("F5", "removing either stop-gradient makes the losses oscillate",
            "oscillation = mean |second difference| / mean of the per-round training "
            "alignment loss; reproduced if removing each stop-gradient raises it > 1.5x (a "
            "diverged run counts as oscillating); partly if one does", _f5_variants, _f5),
    Finding("F6", "warm-up (frozen F_k) makes the projection head converge faster",
            f"warm-up = backbone frozen for the first {WARMUP_STEPS} local steps of a client; "
            "reproduced if it reaches 90% of the alignment-loss drop ≥ 1 round earlier and its "
            "mean alignment loss over rounds 1-5 is lower; partly if one holds",
            _f6_variants, _f6),
    Finding("F7", "3 local epochs give a smoother alignment loss than 1",
            "reproduced if the alignment loss's oscillation at E = 3 is < 0.67x that at E = 1; "
            "partly if lower", _f7_variants, _f7),
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
