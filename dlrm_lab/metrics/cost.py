"""Money: a machine's price per hour, the shipped price catalogue, and the cost columns of summaries.

A machine's price is given once and stored in its profile (`dlrm-lab machine price 3.06`, or
`--instance-type c7i.large` for a catalogue list price), or per run (`--price-per-hour`). The
catalogue (`prices/on-demand.toml`, shipped like the model presets) holds a few public on-demand
list prices; a user's TOML of the same form extends it. The cost rules are pure functions of a
summary row and a `Price` (docs/metrics.md, "Cost"): the price per hour over the measured rate,
and energy at an optional price per kWh only where energy was measured.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrm_lab.config.prices import MAX_PRICE_PER_HOUR, check_currency, check_energy_price, check_price, in_range
from dlrm_lab.config.toml import read_toml
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.columns import (
    COLUMNS,
    SERVING_COST,
    TRAINING_COST,
    FrontierRow,
    InferSummaryRow,
    TrainSummaryRow,
)
from dlrm_lab.metrics.roofline import save_profile
from dlrm_lab.resources import preset_dir

CATALOGUE_FILE = "on-demand.toml"
GIVEN = "given with dlrm-lab machine price"
OVERRIDE = "--price-per-hour"
J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Price:
    """What an hour of the machine costs, in `currency`, and where that figure came from (`source`:
    "given with dlrm-lab machine price", "catalogue: c7i.large", "--price-per-hour"). `energy_per_kwh`,
    in the same currency, prices measured energy; None: energy is not costed."""

    per_hour: float
    currency: str
    source: str
    instance_type: str | None = None
    energy_per_kwh: float | None = None


@dataclass(frozen=True)
class CatalogueEntry:
    """One machine type's public list price (`gpu` None where `gpus` is 0; `retrieved` an ISO date)."""

    instance_type: str
    provider: str
    region: str
    cpu: str | None
    vcpus: int
    cores: int | None
    memory_gib: float
    gpus: int
    gpu: str | None
    price_per_hour: float
    currency: str
    source: str
    retrieved: str
    file: str


# --------------------------------------------------------------------------------------- validation


# ---------------------------------------------------------------------------------------- catalogue


def shipped_catalogue() -> Path:
    return preset_dir("prices") / CATALOGUE_FILE


def load_price_catalogue(extra: Path | None = None) -> dict[str, CatalogueEntry]:
    """The shipped price catalogue by instance type, with `extra` (a user's TOML of the same form)
    merged over it: an entry of a type already listed replaces it. A bad entry raises one UserError
    naming the file, the entry and the field."""
    entries = _read_catalogue(shipped_catalogue())
    if extra is not None:
        entries.update(_read_catalogue(Path(extra)))
    return entries


_STRINGS = ("type", "provider", "region", "cpu", "gpu", "currency", "source")
_REQUIRED = ("type", "provider", "region", "vcpus", "memory_gib", "price_per_hour", "currency", "source", "retrieved")
_FIELDS = (*_REQUIRED, "cpu", "cores", "gpus", "gpu")


def _read_catalogue(path: Path) -> dict[str, CatalogueEntry]:
    data = read_toml(path, "price catalogue")
    if extra_keys := sorted(set(data) - {"instance"}):
        raise UserError(f"{path}: {extra_keys[0]}: unknown top-level key; entries are [[instance]] tables")
    items = data.get("instance")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise UserError(f"{path}: no [[instance]] entries (one table per machine type: docs/metrics.md, 'Cost')")
    out: dict[str, CatalogueEntry] = {}
    where: dict[str, str] = {}
    for n, item in enumerate(items, 1):
        name = f"instance {n}" + (f" ({item['type']})" if isinstance(item.get("type"), str) else "")
        entry = _entry(item, path, name)
        if entry.instance_type in out:
            raise UserError(
                f"{path}: {name}: type = {entry.instance_type!r}: listed twice (also {where[entry.instance_type]})"
            )
        out[entry.instance_type] = entry
        where[entry.instance_type] = name
    return out


def _entry(item: dict[str, Any], path: Path, name: str) -> CatalogueEntry:
    """One [[instance]] table as the TOML file has it: each field's type is checked here, as it is read."""

    def bad(field: str, rule: str) -> UserError:
        shown = f" = {item[field]!r}" if field in item else ""
        return UserError(f"{path}: {name}: {field}{shown}: {rule}")

    if unknown := [k for k in item if k not in _FIELDS]:
        raise bad(unknown[0], f"unknown field; allowed: {', '.join(_FIELDS)}")
    for field in _REQUIRED:
        if field not in item:
            raise bad(field, "missing")
    for field in _STRINGS:
        if field in item and (not isinstance(item[field], str) or not item[field].strip()):
            raise bad(field, "must be a non-empty string")

    def count(field: str, least: int) -> int | None:
        value = item.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise bad(field, f"must be a whole number >= {least}")
        return value

    def positive(field: str) -> float:
        value = item[field]
        if not in_range(value, 0, MAX_PRICE_PER_HOUR, low_open=True):
            raise bad(field, f"must be a number in (0, {MAX_PRICE_PER_HOUR:g}]")
        return float(value)

    gpus = count("gpus", 0) or 0
    if (gpus > 0) != ("gpu" in item):
        raise bad("gpu" if "gpu" in item else "gpus", "gpu (the GPU's name) is given exactly where gpus > 0")
    if not re.fullmatch(r"[A-Z]{3}", item["currency"]):
        raise bad("currency", "must be a 3-letter upper-case currency code such as USD")
    retrieved = item["retrieved"]
    if isinstance(retrieved, str):
        try:
            retrieved = datetime.date.fromisoformat(retrieved)
        except ValueError:
            raise bad("retrieved", "must be a date, YYYY-MM-DD") from None
    if not isinstance(retrieved, datetime.date) or isinstance(retrieved, datetime.datetime):
        raise bad("retrieved", "must be a date, YYYY-MM-DD")
    return CatalogueEntry(
        instance_type=item["type"],
        provider=item["provider"],
        region=item["region"],
        cpu=item.get("cpu"),
        vcpus=count("vcpus", 1) or 0,
        cores=count("cores", 1),
        memory_gib=positive("memory_gib"),
        gpus=gpus,
        gpu=item.get("gpu"),
        price_per_hour=positive("price_per_hour"),
        currency=item["currency"],
        source=item["source"],
        retrieved=retrieved.isoformat(),
        file=str(path),
    )


def catalogue_entry(instance_type: str, catalogue: dict[str, CatalogueEntry]) -> CatalogueEntry:
    """The catalogue's entry of `instance_type`; a UserError listing the known types where it has none."""
    entry = catalogue.get(instance_type)
    if entry is None:
        raise FieldError(
            "instance_type",
            f"{instance_type!r}: not in the price catalogue (known: {', '.join(catalogue)}); give "
            "its price (dlrm-lab machine price PER_HOUR) or add it to your own catalogue and pass {catalogue}",
            "catalogue",
        )
    return entry


# ------------------------------------------------------------------------------- a machine's price


def store_price(
    profile: JsonObject,
    per_hour: float,
    currency: str = "USD",
    instance_type: str | None = None,
    energy_per_kwh: float | None = None,
    *,
    source: str = GIVEN,
) -> Path:
    """Store the machine's price in its profile file (written whole and atomically, as every profile
    change is; a later probe keeps it) and return where. It replaces a price stored before."""
    entry = {
        "per_hour": check_price(per_hour),
        "currency": check_currency(currency),
        "source": source,
        "instance_type": instance_type,
        "energy_per_kwh": None if energy_per_kwh is None else check_energy_price(energy_per_kwh),
        "given_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return save_profile({**profile, "price": entry})


def stored_price(profile: JsonObject | None) -> Price | None:
    """The price stored in `profile` (None where none was given); a hand-edited one that is not a
    price raises a UserError naming the field."""
    entry = (profile or {}).get("price")
    if entry is None:
        return None
    where = f"machine profile {(profile or {}).get('fingerprint_id')}: price"
    if not isinstance(entry, dict):
        raise UserError(f"{where} = {entry!r}: not a price; give it again with 'dlrm-lab machine price'")
    try:
        energy = entry.get("energy_per_kwh")
        return Price(
            per_hour=check_price(entry.get("per_hour"), f"{where}.per_hour"),
            currency=check_currency(entry.get("currency"), f"{where}.currency"),
            source=str(entry.get("source") or GIVEN),
            instance_type=entry.get("instance_type"),
            energy_per_kwh=None if energy is None else check_energy_price(energy, f"{where}.energy_per_kwh"),
        )
    except UserError as exc:
        raise UserError(f"{exc}; give it again with 'dlrm-lab machine price'") from None


def price_of(
    profile: JsonObject | None,
    override_per_hour: float | None = None,
    currency: str | None = None,
    *,
    catalogue: dict[str, CatalogueEntry] | None = None,
) -> Price | None:
    """The price a run is costed at, first found of:
    1. `override_per_hour` (`--price-per-hour`) in `currency` (default: the stored price's, else USD); the
       stored energy price stays where its currency is the same;
    2. the price stored in the profile (`dlrm-lab machine price`);
    3. the catalogue's list price of the instance type the profile names (`instance_type`);
    else None: no cost columns. Without an override, `currency` must be the price's (nothing is converted).
    """
    stored = stored_price(profile)
    if override_per_hour is not None:
        per_hour = check_price(override_per_hour, OVERRIDE)
        code = check_currency(currency) if currency is not None else (stored.currency if stored else "USD")
        energy = stored.energy_per_kwh if stored and stored.currency == code else None
        return Price(per_hour, code, OVERRIDE, None, energy)
    found = stored
    named = (profile or {}).get("instance_type")
    if found is None and isinstance(named, str):
        entry = (catalogue if catalogue is not None else load_price_catalogue()).get(named)
        if entry is not None:
            found = Price(entry.price_per_hour, entry.currency, f"catalogue: {named}", named)
    if found is not None and currency is not None and check_currency(currency) != found.currency:
        raise FieldError(
            "currency",
            f"{currency!r}: the machine's price is in {found.currency} ({found.source}) and prices are "
            "never converted; give {price_per_hour} with it",
            "price_per_hour",
        )
    return found


def give_price(
    profile: JsonObject,
    per_hour: float | None = None,
    currency: str | None = None,
    instance_type: str | None = None,
    energy_per_kwh: float | None = None,
    catalogue: dict[str, CatalogueEntry] | None = None,
) -> tuple[Price, Path]:
    """`dlrm-lab machine price`: store `per_hour`, or without it the catalogue's price of `instance_type`;
    the price stored and where."""
    if per_hour is None and instance_type is None:
        raise UserError(
            "give the price per hour (dlrm-lab machine price 3.06) or --instance-type T with a catalogue "
            "price (dlrm-lab machine prices lists them)"
        )
    source = GIVEN
    if per_hour is None:
        assert instance_type is not None  # refused above where neither is given
        entry = catalogue_entry(instance_type, catalogue if catalogue is not None else load_price_catalogue())
        if currency is not None and check_currency(currency) != entry.currency:
            raise FieldError(
                "currency",
                f"{currency!r}: the catalogue's price of {instance_type} is in {entry.currency} and "
                "prices are never converted; give the price per hour with it",
            )
        per_hour, currency, source = entry.price_per_hour, entry.currency, f"catalogue: {instance_type}"
    path = store_price(profile, per_hour, currency or "USD", instance_type, energy_per_kwh, source=source)
    energy = None if energy_per_kwh is None else float(energy_per_kwh)
    return Price(float(per_hour), check_currency(currency or "USD"), source, instance_type, energy), path


# -------------------------------------------------------------------------------------- cost rules

# The cost columns as (name, type), from their definitions (`metrics.columns`): an inference point's or
# a search frontier's, a training run's, and every one once.
SERVING_COST_FIELDS = [(name, COLUMNS[name].type) for name in SERVING_COST]
TRAINING_COST_FIELDS = [(name, COLUMNS[name].type) for name in TRAINING_COST]
COST_FIELDS = list(dict.fromkeys([*SERVING_COST_FIELDS, *TRAINING_COST_FIELDS]))


def _per_million(per_hour: float, rate: float | None) -> float | None:
    """Money per 1e6 items at `rate` items/s: the price of the seconds 1e6 items take."""
    return per_hour / 3600.0 / rate * 1e6 if rate and rate > 0 else None


def _energy_cost(joules_per_sample: float | None, price: Price) -> float | None:
    if joules_per_sample is None or price.energy_per_kwh is None:
        return None
    return joules_per_sample * 1e6 / J_PER_KWH * price.energy_per_kwh


def _price_columns(price: Price, machines: int = 1) -> dict[str, float | str]:
    source = price.source if machines == 1 else f"{price.source}, x {machines} machines"
    return {"price_per_hour": price.per_hour * machines, "currency": price.currency, "price_source": source}


def _serving_rate(row: InferSummaryRow | FrontierRow) -> tuple[float | None, float | None, str | None]:
    """(queries/s, samples/s, which) of a point row, or of a search row at its certified or best rate."""
    if "best_qps" not in row:
        return row.get("queries_per_s"), row.get("samples_per_s"), "measured"
    certified = row.get("certified_qps")
    if certified is not None:  # certified: the rate a long LoadGen run held; 0 where none held
        return (certified, row.get("certified_samples_per_s"), "certified") if certified > 0 else (None, None, None)
    best = row.get("best_qps")
    return (best, row.get("best_samples_per_s"), "best") if best else (None, None, None)


def serving_cost_columns(
    row: InferSummaryRow | FrontierRow, price: Price | None, point_rows: Sequence[InferSummaryRow] | None = None
) -> dict[str, float | str | None]:
    """Cost columns of an inference summary row (a point, or a search's frontier row); nulls without a price.

    Rule: cost per 1M samples (queries) = price_per_hour / 3600 / samples_per_s (queries_per_s) x 1e6, at
    - a point: its measured rate;
    - a search row (it has `best_qps`): the certified rate where the search certified one
      (`certified_qps`; 0, none held: null), else the best probed rate that met the bound (`best_qps`).
    The machine is paid for whatever it serves: a co-located point's rows (`point_rows`, this one among
    them) share it, at the sum of the point's rates, as its energy is shared.
    `energy_cost_per_1m_samples` = energy per sample (J) x 1e6 / 3.6e6 x energy_per_kwh, only where the row
    measured `energy_j` over a positive `duration_s` and the price has an energy price; the energy per
    sample is the row's `energy_per_sample_j` (mean power / the point's samples/s), else energy_j /
    duration_s / samples_per_s. Never where energy was not measured: null, not 0.
    """
    out: dict[str, float | str | None] = dict.fromkeys(name for name, _ in SERVING_COST_FIELDS)
    if price is None:
        return out
    out.update(_price_columns(price))
    qps, sps, which = _serving_rate(row)
    if which == "measured" and point_rows and len(point_rows) > 1:
        qps = sum(r.get("queries_per_s") or 0.0 for r in point_rows)
        sps = sum(r.get("samples_per_s") or 0.0 for r in point_rows)
    out["cost_rate"] = which
    out["cost_per_1m_samples"] = _per_million(price.per_hour, sps)
    out["cost_per_1m_queries"] = _per_million(price.per_hour, qps)
    duration, energy = row.get("duration_s"), row.get("energy_j")
    if which == "measured" and energy is not None and duration and duration > 0:
        per_sample = row.get("energy_per_sample_j")
        if per_sample is None and sps:
            per_sample = energy / duration / sps
        out["energy_cost_per_1m_samples"] = _energy_cost(per_sample, price)
    return out


def training_cost_columns(row: TrainSummaryRow, price: Price | None, machines: int = 1) -> TrainSummaryRow:
    """Cost columns of a training summary row; nulls without a price.

    Rules, at price_per_hour = the machine's price x `machines` (the machines the run's ranks used):
    - cost_per_1m_training_samples = price_per_hour / 3600 / samples_per_s x 1e6;
    - cost_to_target = price_per_hour x time_to_target_s / 3600 where the run reached its target AUC
      (`target_reached`), null where it did not or had no target: the money twin of Valid FLOPS;
    - energy_cost_per_1m_training_samples = energy_per_sample_j x 1e6 / 3.6e6 x energy_per_kwh, only where
      `energy_j` was measured and the price has an energy price.
    """
    out = TrainSummaryRow(dict.fromkeys(name for name, _ in TRAINING_COST_FIELDS))
    if price is None:
        return out
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ValueError(f"machines must be a whole number >= 1, got {machines!r}")
    out.update(_price_columns(price, machines))
    per_hour = out["price_per_hour"]
    out["cost_per_1m_training_samples"] = _per_million(per_hour, row.get("samples_per_s"))
    seconds = row.get("time_to_target_s")
    if row.get("target_reached") is True and seconds is not None and seconds >= 0:
        out["cost_to_target"] = per_hour * seconds / 3600.0
    if row.get("energy_j") is not None:
        out["energy_cost_per_1m_training_samples"] = _energy_cost(row.get("energy_per_sample_j"), price)
    return out
