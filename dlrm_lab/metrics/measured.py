"""Choices the lab makes by measurement, their figures cached in the machine profile.

A precision, a sharding plan, a serving build or a C allocator is chosen from figures measured on this machine (its
GEMM rates at the model's shapes, the plans' step times, the builds' and allocators' batch times). Each kind keeps
them in a section of the profile (`roofline.MEASURED_CHOICES`), one entry per key of what was measured, with the date
and the machine's speed then: a later run reads them instead of measuring again, unless the entry is damaged (one
warning line; measured again and replaced) or was measured at another speed than now (`canary.measured_slower`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar, cast

from dlrm_lab.config.values import JsonObject, Log, section
from dlrm_lab.metrics import canary
from dlrm_lab.metrics.roofline import ProfileNotStored, not_positive, profile_path, save_profile

# What an entry of each holds: its table of measurements (keys per level: names, or batch sizes as whole numbers;
# every leaf a number > 0), and the other tables it carries
CACHED_TABLES: dict[str, tuple[str, tuple[type, ...], tuple[str, ...]]] = {
    "precision_rates": ("flops_per_s", (str,), ()),
    "sharding_trials": ("step_ms", (str,), ("skipped",)),
    "build_rates": ("batch_ms", (str, int), ()),
    "allocator_rates": ("batch_ms", (str, int), ()),
    "gemm_widths": ("ms", (str, str, int), ()),
}


def cached_problem(section: str, key: str, entry: Any) -> str | None:
    """What is wrong with an entry of a MEASURED_CHOICES section, as `field = value: rule`; None when nothing."""
    name, levels, tables = CACHED_TABLES[section]
    where = f"{section}.{key}"
    if not isinstance(entry, dict):
        return f"{where} = {entry!r:.80}: must be a table"
    if not isinstance(entry.get("measured_at"), str):
        return f"{where}.measured_at = {entry.get('measured_at')!r:.80}: must be the date it was measured"
    for extra in tables:
        if not isinstance(entry.get(extra), dict):
            return f"{where}.{extra} = {entry.get(extra)!r:.80}: must be a table"

    def walk(value: Any, at: str, depth: int, key: str = "") -> str | None:
        if depth == len(levels):
            if key.startswith("-"):  # a build's own figures beside its batch times (its spread): 0 is one
                return None if not_positive(at, value) is None or value == 0 else f"{at} = {value!r}: must be >= 0"
            return not_positive(at, value)
        if not isinstance(value, dict) or not value:
            return f"{at} = {value!r:.80}: must be a table"
        for k, v in value.items():
            if levels[depth] is int and not str(k).removeprefix("-").isdigit():
                return f"{at}.{k}: must be a batch size (a whole number)"
            if problem := walk(v, f"{at}.{k}", depth + 1, str(k)):
                return problem
        return None

    if entry.get(name) == {} and isinstance(entry.get("failed"), dict) and entry["failed"]:
        return None  # every build it holds failed here (`infer.build`): their reasons are the entry
    return walk(entry.get(name), f"{where}.{name}", 0)


def cached_choice(profile: JsonObject | None, section: str, key: str, log: Log | None = None) -> JsonObject | None:
    """The entry `key` of a MEASURED_CHOICES section of `profile`: None where there is none, or where it is damaged
    (a hand edit, a partial write: one warning line naming the file and the field; the caller measures again and
    its new entry replaces the bad one)."""
    if profile is None or profile.get(section) is None:
        return None
    table = profile[section]
    if not isinstance(table, dict):
        problem: str | None = f"{section} = {table!r:.80}: must be a table of measured entries"
    elif (entry := table.get(key)) is None:
        return None
    elif (problem := cached_problem(section, key, entry)) is None:
        if (slower := canary.measured_slower(profile, entry)) is None:
            return entry
        if log is not None:
            log(f"{section}.{key}: {slower}; measuring again")
        return None
    if log is not None:
        log(f"warning: {profile_path(str(profile['fingerprint_id']))}: {problem}; discarded, measuring again")
    return None


def store_measured(profile: JsonObject, table: str, key: str, entry: JsonObject) -> Path | str:
    """Add one entry to a MEASURED_CHOICES section of `profile` and save it, with the machine's speed then (a
    canary reading against quiet, `canary_ratio`: a choice made in a slow minute is measured again, not kept); where
    it went (or, where the profile cannot be written, why not: the choice stands, it is only measured again next
    time)."""
    if (speed := canary.canary_now(profile)) is not None:
        entry = {**entry, "canary_ratio": speed}
    try:
        return save_profile({**profile, table: {**section(profile, table), key: entry}})
    except ProfileNotStored as exc:
        return f"nowhere ({exc})"


Figures = TypeVar("Figures")


def measured_choice(
    profile: JsonObject | None,
    table: str,
    key: str,
    *,
    read: Callable[[JsonObject], Figures | None],
    measure: Callable[[], Figures],
    entry: Callable[[Figures, JsonObject | None], JsonObject | str],
    log: Log | None = None,
) -> tuple[Figures, str]:
    """The figures a measured choice rests on (a MEASURED_CHOICES section's `key`), with where they came from in one
    clause: `read` from `profile`'s entry where it holds all it needs (`cached_choice` checked it), else `measure()`d
    now and stored as `entry(figures, the entry found)` with the date (a string instead: not stored, and why)."""
    cached = cached_choice(profile, table, key, log)
    if profile is not None and cached is not None and (figures := read(cached)) is not None:
        where = profile_path(str(profile["fingerprint_id"]))
        return figures, f"cached in {where} (measured {cached['measured_at']})"
    figures = measure()
    return figures, record_measured(profile, table, key, entry(figures, cached) if profile is not None else None)


def record_measured(
    profile: JsonObject | None, table: str, key: str, entry: JsonObject | str | None, on: str = "this machine"
) -> str:
    """Figures measured just now, stored as `entry` with the date under `key` of `profile`'s MEASURED_CHOICES section
    `table` (`entry` a string: not stored, and why; no profile or no entry: nowhere); where they went, in one clause."""
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    source = f"measured now ({measured_at}) on {on}"
    if profile is None or entry is None:
        return source
    if isinstance(entry, str):
        return f"{source}, not stored: {entry}"
    return f"{source}, stored in {store_measured(profile, table, key, {**entry, 'measured_at': measured_at})}"


BatchTimes = dict[str, dict[int, float]]  # ms a batch, by what was timed (a build, an allocator) and batch size


def batch_times(names: Sequence[str]) -> Callable[[JsonObject], BatchTimes | None]:
    """`measured_choice`'s `read` of a `batch_ms` entry (build and allocator rates): the batch times of every one of
    `names`, None where one is missing."""

    def read(cached: JsonObject) -> BatchTimes | None:
        stored = cast(dict[str, Any], cached["batch_ms"])  # a table of tables (`cached_problem` checked it)
        if not all(name in stored for name in names):
            return None
        return {name: {int(n): v for n, v in stored[name].items()} for name in names}

    return read


def stored_batch_times(times: BatchTimes) -> JsonObject:
    """Batch times as an entry's `batch_ms` holds them (batch sizes as strings: JSON's keys)."""
    return {name: {str(n): v for n, v in per.items()} for name, per in times.items()}
