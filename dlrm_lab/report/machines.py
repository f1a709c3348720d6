"""Machines side by side: which machine gives the lowest cost per inference (`dlrm-lab report`).

For runs made on several machines (their manifests' hardware fingerprints differ), one row per machine,
model and latency bound: the best rate that met the bound there, from latency-bounded searches (the
certified rate where one held, else the best probed rate) and from inference points that met their
bound, beside the machine (CPU model, the flags that decide GEMM speed, cores, GPUs), samples/s per core,
the fraction of roof, the cost per 1M inferences (a run's cost columns, else the price the run's carried
profile holds: `metrics.cost`) and energy per inference where measured. Within a model and bound the
machines are ranked by cost per 1M inferences (unpriced last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, cast

from dlrm_lab.config.values import section
from dlrm_lab.metrics.columns import InferSummaryRow
from dlrm_lab.metrics.cost import serving_cost_columns, stored_price
from dlrm_lab.metrics.roofline import run_profile
from dlrm_lab.report.load import ReportData, ReportRow, RunInfo, run_of

# The flags that decide a CPU's GEMM speed (AVX2 only, AVX-512 bf16, AMX), shown beside its model
GEMM_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Candidate:
    """One way a machine served a model under a bound: a search's answer or a point that met it."""

    queries_per_s: float
    samples_per_s: float
    source: str  # "search (certified)", "search (best probe)", "point"
    row: ReportRow


class Machine(TypedDict):
    """What a run's manifest says of its machine (`machine_of`)."""

    machine: str  # its hardware fingerprint, shortened
    cpu_model: str | None
    gemm_flags: str  # those of GEMM_FLAGS it has, or "-"
    cores: int | None  # physical, else logical
    gpus: str  # their names, or "-"


class MachineRow(Machine):
    """A machine, model and bound of `machine_rows`: the best rate that met the bound there, and its cost."""

    model: str | None  # the run's preset, or the model it served
    sla_ms: float | None
    sla_percentile: float | None
    queries_per_s: float
    samples_per_s: float
    samples_per_s_per_core: float | None
    roofline_fraction: float | None
    cost_per_1m_queries: float | None
    cost_per_1m_samples: float | None
    currency: str | None
    energy_per_query_j: float | None
    source: str
    run_id: str
    rank: int | None  # within its model and bound, by cost per 1M inferences (None: no price)


def machine_of(run: RunInfo) -> Machine:
    """What a run's manifest says of its machine."""
    hw = section(run.manifest, "hardware")
    flags = set(cpu_flags) if isinstance(cpu_flags := hw.get("cpu_flags"), list) else set()
    devices = section(hw, "gpus").get("devices")
    gpus = [d.get("name") for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []
    return {
        "machine": str(hw.get("fingerprint_id") or "unknown")[:8],
        "cpu_model": cast("str | None", hw.get("cpu_model")),  # as `metrics.hardware` records them
        "gemm_flags": " ".join(f for f in GEMM_FLAGS if f in flags) or "-",
        "cores": cast("int | None", hw.get("physical_cores") or hw.get("logical_cores")),
        "gpus": ", ".join(g for g in gpus if g) or "-",
    }


def _candidates(data: ReportData) -> list[tuple[RunInfo, ReportRow, Candidate]]:
    out = []
    for s in data.search:
        best = s.best_row()
        if best is None or not best.get("best_qps"):
            continue
        if best.get("certified_qps"):  # a rate a long LoadGen run held
            qps, sps, how = best["certified_qps"], best.get("certified_samples_per_s"), "search (certified)"
        elif best.get("certified_qps") == 0:  # certified, and none held: not an answer
            continue
        else:
            qps, sps, how = best["best_qps"], best.get("best_samples_per_s"), "search (best probe)"
        roof = [r.get("roofline_fraction") for rows in s.best_probe_points().values() for r in rows]
        known = [x for x in roof if x is not None]
        row = {**best, "roofline_fraction": max(known) if known else None}
        out.append((s.run, row, Candidate(float(qps), float(sps or 0.0), how, row)))
    for r in data.infer:
        if r.get("sla_met") and r.get("queries_per_s"):
            out.append((run_of(r), r, Candidate(float(r["queries_per_s"]), float(r["samples_per_s"]), "point", r)))
    return out


def machine_rows(data: ReportData) -> list[MachineRow]:
    """One row per machine, model and bound (module docstring), ranked within each model and bound by cost per
    1M inferences. Empty when the runs come from fewer than two machines."""
    best: dict[tuple, tuple[RunInfo, ReportRow, Candidate]] = {}
    for run, row, c in _candidates(data):
        key = (
            machine_of(run)["machine"],
            row.get("preset") or row.get("model"),
            row.get("sla_ms"),
            row.get("sla_percentile"),
        )
        if key not in best or c.samples_per_s > best[key][2].samples_per_s:
            best[key] = (run, row, c)
    if len({k[0] for k in best}) < 2:
        return []
    rows: list[MachineRow] = []
    for (_, model, sla_ms, pct), (run, row, c) in best.items():
        info = machine_of(run)
        cost = {k: row.get(k) for k in ("cost_per_1m_queries", "cost_per_1m_samples", "currency")}
        if cost["cost_per_1m_queries"] is None:  # recorded without a price: the price its carried profile holds
            price = stored_price(run_profile(run.manifest))
            priced = serving_cost_columns(
                InferSummaryRow(queries_per_s=c.queries_per_s, samples_per_s=c.samples_per_s), price
            )
            cost = {k: priced.get(k) for k in cost}
        rows.append(
            {
                **info,
                "model": model,
                "sla_ms": sla_ms,
                "sla_percentile": pct,
                "queries_per_s": c.queries_per_s,
                "samples_per_s": c.samples_per_s,
                "samples_per_s_per_core": c.samples_per_s / info["cores"] if info["cores"] else None,
                "roofline_fraction": row.get("roofline_fraction"),
                "cost_per_1m_queries": cost["cost_per_1m_queries"],
                "cost_per_1m_samples": cost["cost_per_1m_samples"],
                "currency": cost["currency"],
                "energy_per_query_j": row.get("energy_per_query_j"),
                "source": c.source,
                "run_id": run.run_id,
                "rank": None,  # once every row is placed
            }
        )
    rows.sort(
        key=lambda r: (
            str(r["model"]),
            r["sla_ms"] or 0,
            r["cost_per_1m_queries"] is None,
            r["cost_per_1m_queries"] or 0.0,
        )
    )
    rank: dict[tuple, int] = {}
    for r in rows:
        bound = (r["model"], r["sla_ms"], r["sla_percentile"])
        rank[bound] = rank.get(bound, 0) + 1
        r["rank"] = rank[bound] if r["cost_per_1m_queries"] is not None else None
    return rows
