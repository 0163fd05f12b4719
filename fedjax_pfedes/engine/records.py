"""What a round's training produced and how it is recorded: the participants' metrics as columns
(`ClientMetrics`), their uploads (`Trained`), the means a round's monitoring record holds, the
per-client rows of clients.jsonl and the counts of outcomes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedjax_pfedes.engine import client_system
from fedjax_pfedes.engine.context import RunContext
from fedjax_pfedes.upload.plan import UPLOAD_NORM, CohortUploads


@dataclasses.dataclass
class ClientMetrics:
    """Per-client metrics of a set of trained clients, as columns (no per-client Python when a
    round builds, averages or reports them).

    Iterating gives the client ids (so `set(...)`, `sorted(...)`, `in` and `len` read it as the
    set of trained clients); `metrics[cid]` is one client's metrics as a dict.

    Attributes:
      ids: [n] global client ids, in training order.
      columns: metric -> [n] float64 values, in the order the metrics were first reported.
    """

    ids: np.ndarray
    columns: dict[str, np.ndarray]

    @classmethod
    def empty(cls) -> ClientMetrics:
        return cls(np.zeros(0, np.int64), {})

    @classmethod
    def concatenate(cls, parts: list[ClientMetrics]) -> ClientMetrics:
        """The clients of `parts` in order; a metric some part lacks is NaN there."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        names = list(dict.fromkeys(k for p in parts for k in p.columns))
        nan = [np.full(len(p), np.nan) for p in parts]
        return cls(np.concatenate([p.ids for p in parts]),
                   {k: np.concatenate([p.columns.get(k, n) for p, n in zip(parts, nan,
                                                                           strict=True)])
                    for k in names})

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids.tolist())

    def __contains__(self, cid) -> bool:
        return bool(np.any(self.ids == cid))

    def positions(self, clients: np.ndarray) -> np.ndarray:
        """Each of `clients`' row in the columns, -1 for a client without metrics."""
        order = np.argsort(self.ids, kind="stable")
        sorted_ids = self.ids[order]
        at = np.searchsorted(sorted_ids, clients)
        at = np.minimum(at, max(len(sorted_ids) - 1, 0))
        found = (sorted_ids[at] == clients) if len(sorted_ids) else np.zeros(len(clients), bool)
        return np.where(found, order[at] if len(order) else 0, -1)

    def __getitem__(self, cid: int) -> dict[str, float]:
        j = int(self.positions(np.array([cid]))[0])
        if j < 0:
            raise KeyError(cid)
        return {k: float(v[j]) for k, v in self.columns.items()}


@dataclasses.dataclass
class Trained:
    """Local updates of a set of clients: per-cohort uploads plus per-client metrics."""

    uploads: dict[str, CohortUploads]
    client_metrics: ClientMetrics
    traffic: list[tuple]  # (clients, upload params, upload bytes, download params, bytes)
    useful_steps: float = 0.0    # local steps of the participants' own schedules
    computed_steps: float = 0.0  # local steps the execution strategy actually ran

    def padded_step_fraction(self) -> dict[str, float]:
        """{'padded_step_fraction': computed / useful local steps} (1.0 = no wasted steps)."""
        if self.useful_steps <= 0:
            return {}
        return {"padded_step_fraction": self.computed_steps / self.useful_steps}


def client_means(client_metrics: ClientMetrics) -> dict[str, float]:
    """`<metric>_mean` over clients, the local-loss variance and the update-norm distribution."""
    if not len(client_metrics):
        return {}
    columns = client_metrics.columns
    out = {f"{k}_mean": float(np.mean(v)) for k, v in columns.items() if k != UPLOAD_NORM}
    if "train_ce_loss" in columns:
        out["client_loss_var"] = float(columns["train_ce_loss"].var())
    norms = columns[UPLOAD_NORM]
    out.update(update_norm_min=float(norms.min()), update_norm_median=float(np.median(norms)),
               update_norm_max=float(norms.max()))
    return out


def client_report(ctx: RunContext, timing: client_system.RoundTiming, trained: Trained,
                  rejected: set[int], staleness: dict[int, int] | None = None) -> list[dict]:
    """One row per selected client: outcome, samples, steps, local loss, update norm, times.

    Built column by column (numpy), then zipped into the rows: a client without metrics (it
    did not train or its update never arrived) has `train_loss` and `update_norm` None and its
    planned `local_steps`."""
    clients = np.asarray(timing.clients, np.int64)
    metrics = trained.client_metrics
    at = metrics.positions(clients)
    has = at >= 0
    take = np.maximum(at, 0)
    has_list = has.tolist()

    def metric(name: str) -> list:
        if name not in metrics.columns:
            return [None] * len(clients)
        return [v if h else None
                for v, h in zip(metrics.columns[name][take].tolist(), has_list, strict=True)]

    steps = np.asarray(timing.step_limit)
    if "local_steps" in metrics.columns:
        steps = np.where(has, metrics.columns["local_steps"][take], steps)
    rejected_mask = np.isin(clients, np.fromiter(rejected, np.int64, len(rejected)))
    ids = clients.tolist()
    columns = {
        "client": ids, "arch": ctx.arch_of(clients),
        "status": [str(v) for v in np.asarray(timing.status).tolist()],
        "accepted": (has & ~rejected_mask).tolist(),
        "samples": np.asarray(ctx.sizes)[clients].astype(np.int64).tolist(),
        "epochs": np.asarray(ctx.epochs)[clients].astype(np.int64).tolist(),
        "local_steps": steps.astype(np.int64).tolist(),
        "train_loss": metric("train_ce_loss"), "update_norm": metric(UPLOAD_NORM),
        **{k: np.asarray(getattr(timing, k), np.float64).tolist()
           for k in ("download_s", "compute_s", "upload_s", "total_s")}}
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(),
                                                                      strict=True)]
    extra = [k for k in ctx.algorithm.client_report_metrics if k in metrics.columns]
    if extra:
        values = {k: metrics.columns[k][take].tolist() for k in extra}
        for i in np.flatnonzero(has).tolist():
            rows[i].update({k: values[k][i] for k in extra})
    if staleness is not None:
        for row in rows:
            if row["client"] in staleness:
                row["staleness"] = staleness[row["client"]]
    return rows


def outcome_counts(timing: client_system.RoundTiming, uploads_accepted: int) -> dict[str, Any]:
    s = timing.status
    selected = len(s)
    return {"participants": int(timing.trains.sum()),
            "dropped_out": int((s == client_system.DROPPED_OUT).sum()),
            "past_deadline": int((s == client_system.PAST_DEADLINE).sum()),
            "partial_work": int((s == client_system.PARTIAL).sum()),
            "uploads_accepted": uploads_accepted,
            "upload_success_rate": uploads_accepted / selected if selected else None}


def count_dp_sgd_steps(steps: np.ndarray, rows: list[dict]) -> np.ndarray:
    """`steps` plus the local steps of the clients whose training counted this round (delivered
    or partial work: their noisy gradients were computed)."""
    steps = np.array(steps)
    for row in rows:
        if row["status"] in (client_system.DELIVERED, client_system.PARTIAL):
            steps[row["client"]] += row["local_steps"]
    return steps
