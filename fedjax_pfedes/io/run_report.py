"""A run's report: PNG plots of what happened, and a Markdown summary that links them.

Reads only the files a run writes (`metrics.jsonl`, `clients.jsonl`, `summary.json`), so it works
on a finished run, a run in progress, or one resumed from a checkpoint. What a federated run needs
watching: accuracy, losses, the loss before / after aggregation, update norms per client as a time
series (a client whose norm keeps climbing has bad data or a bad learning rate), participation,
and the privacy budget when DP is on.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.io.metrics import read_jsonl, read_jsonl_lines
from fedjax_pfedes.io.plotting import MaxNLocator, plt, save


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _line_plot(rows: list[dict], keys: dict[str, str], title: str, ylabel: str,
               path: str, dashed: tuple[str, ...] = ()) -> str | None:
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    drawn = 0
    for key, label in keys.items():
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, "--" if key in dashed else "-", marker="o" if len(x) < 30 else None,
                    ms=3, label=label)
            drawn += 1
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def update_norm_plot(rows: list[dict], clients: list[dict], path: str) -> str | None:
    """Per-client update norm vs round (thin lines), with the round's min / median / max."""
    per_client: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for c in clients:
        if c.get("update_norm") is not None and c.get("accepted", True):
            per_client[c["client"]].append((c["round"], c["update_norm"]))
    if not per_client and not any("update_norm_median" in r for r in rows):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for pts in per_client.values():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.7, alpha=0.45, marker=".",
                ms=2)
    for key, style in (("update_norm_min", ":"), ("update_norm_median", "-"),
                       ("update_norm_max", "--")):
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, "k" + style, lw=1.4, label=key.replace("update_norm_", ""))
    ax.set_xlabel("round")
    ax.set_ylabel("L2 norm of the upload - broadcast")
    ax.set_title(f"update norms ({len(per_client)} clients, one thin line each)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def participation_plot(summary: dict, clients: list[dict], path: str) -> str | None:
    part = summary.get("participation")
    if part is None:  # in progress: count from the client report
        n = 1 + max((c["client"] for c in clients), default=-1)
        selected, completed = np.zeros(n, int), np.zeros(n, int)
        for c in clients:
            selected[c["client"]] += 1
            completed[c["client"]] += c.get("accepted", False)
    else:
        selected, completed = np.asarray(part["selected"]), np.asarray(part["completed"])
    if len(selected) == 0:
        return None
    fig, ax = plt.subplots(figsize=(min(3 + 0.25 * len(selected), 14), 3.6))
    idx = np.arange(len(selected))
    ax.bar(idx, selected, color="tab:gray", alpha=0.5, label="selected")
    ax.bar(idx, completed, color="tab:blue", label="update delivered")
    ax.set_xlabel("client")
    ax.set_ylabel("rounds")
    ax.set_title(f"participation (selected: min {selected.min()}, max {selected.max()})")
    ax.legend(fontsize=8)
    return save(fig, path)


def read_summary(workdir: str) -> dict:
    """summary.json, or {} while the run has not written it (still running, or stopped).

    Raises:
      ValueError: naming the file, when it is there but not JSON (cut off or edited).
    """
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not complete JSON ({e.msg}, line {e.lineno} column "
                         f"{e.colno}): the "
                         "file was cut off or edited; rerun the command to rewrite it") from None


def write_report(workdir: str) -> dict[str, str]:
    """Writes `<workdir>/report/*.png` and `<workdir>/report.md` from the complete records
    (a run in progress: those written so far, and report.md says so); returns {name: png
    path}."""
    rows, in_progress = read_jsonl_lines(os.path.join(workdir, "metrics.jsonl"))
    if not rows:
        raise FileNotFoundError(f"{workdir}/metrics.jsonl is missing or empty: not a run "
                                "directory (python -m launch.main --workdir=...)")
    clients = read_jsonl(os.path.join(workdir, "clients.jsonl"))
    summary = read_summary(workdir)
    in_progress = in_progress or not summary
    out = os.path.join(workdir, "report")
    evaluated = [r for r in rows if "personalized_accuracy_mean" in r]
    train_keys = {k: k.removesuffix("_mean") for k in rows[-1]
                  if k.startswith("train_") and k.endswith("loss_mean")}
    plots = {
        "accuracy": _line_plot(evaluated, {"personalized_accuracy_mean": "personalized",
                                           "global_accuracy_mean": "global test"},
                               "accuracy (personalized: each client's local test split)",
                               "accuracy", f"{out}/accuracy.png"),
        "losses": _line_plot(rows, train_keys, "local training losses (mean over participants)",
                             "loss", f"{out}/losses.png"),
        "aggregation_loss": _line_plot(
            rows, {"loss_before_aggregation": "before the server step",
                   "loss_after_aggregation": "after the server step"},
            "participants' local-test CE around aggregation", "CE", f"{out}/aggregation_loss.png"),
        "proxy_change": _line_plot(
            rows, {"proxy_relative_change": "||E_t - E_(t-1)|| / ||E_(t-1)||"},
            "how far the server step moved E_proxy (pFedES)", "relative change",
            f"{out}/proxy_change.png"),
        "update_norms": update_norm_plot(rows, clients, f"{out}/update_norms.png"),
        "participation": participation_plot(summary, clients, f"{out}/participation.png"),
        "participants": _line_plot(rows, {"online_clients": "online",
                                          "planned_participants": "planned",
                                          "selected": "selected",
                                          "uploads_accepted": "uploads accepted"},
                                   "participants per round", "clients",
                                   f"{out}/participants.png", dashed=("planned_participants",)),
        "privacy": _line_plot(rows, {"dp_epsilon": "client-level DP epsilon",
                                     "dp_sgd_epsilon_max": "DP-SGD epsilon (max client)"},
                              "privacy spent", "epsilon", f"{out}/privacy.png"),
    }
    plots = {k: v for k, v in plots.items() if v}
    _write_markdown(workdir, rows, evaluated, summary, plots, in_progress)
    return plots


def _write_markdown(workdir: str, rows: list[dict], evaluated: list[dict], summary: dict,
                    plots: dict[str, str], in_progress: bool = False) -> None:
    cfg = summary.get("config", {})
    last = rows[-1]
    lines = [f"# Run report: {cfg.get('algorithm', '?')} on {cfg.get('data', {}).get('name', '?')}",
             "", f"Generated by `python -m launch.report {workdir}` from metrics.jsonl, "
             "clients.jsonl and summary.json.", ""]
    if in_progress:
        lines += [f"**Run in progress (or stopped before its end): the {len(rows)} complete "
                  "rounds written so far; no summary.json yet.**", ""]
    table = [["rounds written", last["round"]]]
    if evaluated:
        e = evaluated[-1]
        table.append([f"personalized accuracy (round {e['round']})",
                      f"{e['personalized_accuracy_mean']:.4f} "
                      f"(std {e['personalized_accuracy_std']:.4f})"])
        scored = [r for r in evaluated if "global_accuracy_mean" in r]  # eval.global_every
        if scored:
            g = scored[-1]
            table.append(["global accuracy" + ("" if g is e else f" (round {g['round']})"),
                          f"{g['global_accuracy_mean']:.4f}"])
    for key, label in (("simulated_clock_s", "simulated wall-clock (s)"),
                       ("uploads_rejected_total", "uploads rejected"),
                       ("dp_epsilon", "DP epsilon")):
        if last.get(key) is not None:
            table.append([label, f"{last[key]:.4g}"])
    rates = [r["upload_success_rate"] for r in rows if r.get("upload_success_rate") is not None]
    if rates:
        table.append(["mean upload success rate", f"{np.mean(rates):.3f}"])
    if "wall_time_s" in summary:
        table.append(["wall time (s)", f"{summary['wall_time_s']:.0f}"])
    lines.append(markdown.table(["metric", "value"], table))
    lines.append("")
    for name, path in plots.items():
        lines += [f"## {name.replace('_', ' ')}", "",
                  f"![{name}]({os.path.relpath(path, workdir)})", ""]
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write("\n".join(lines))
