"""A ranker request's sparse features and the tables they look up, which the HSTU data and the ranker share: per
history token and per candidate the item's id and one id per attribute table of the item (DLRMv3: its category;
DLRMv4: its artist and album), then the contextual tokens (the user's, then one per cross-hash table, whose name
says what it crosses). `RequestFeatures` lists them in the order a batch does, named after their tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CATEGORY_TABLE = "item_category"  # DLRMv3's one item attribute, when a preset names no item tables
# what a cross-hash table may cross, besides the item's attribute tables (DLRMv4: artist, album): the user, the
# anchor (the request's first candidate) item, the request's hour of day, and whether the anchor was organic
CROSS_KEYS = ("user", "item", "hour", "is_organic")

Tables = tuple[tuple[str, int], ...]  # (name, rows) in order


def history_feature(table: str) -> str:
    """A history token's id feature of an item table: item_id, item_category_id, artist_id."""
    return f"{table}_id"


def candidate_feature(table: str) -> str:
    """A candidate's id feature of an item table: item_candidate_id, item_candidate_category_id, ..._artist_id."""
    return "item_candidate_id" if table == "item" else f"item_candidate_{table.removeprefix('item_')}_id"


def cross_keys(name: str) -> tuple[str, ...]:
    """The features a cross-hash table's name crosses (`user_x_artist_x_hour` -> user, artist, hour)."""
    return tuple(name.split("_x_"))


@dataclass(frozen=True)
class RequestFeatures:
    """The sparse features of a request, in the order a batch lists them: per history token, per candidate,
    per request (the contextual tokens: the user, then each cross)."""

    history: tuple[str, ...]
    candidates: tuple[str, ...]
    contextual: tuple[str, ...]

    @classmethod
    def of(cls, attributes: tuple[str, ...], crosses: tuple[str, ...]) -> RequestFeatures:
        tables = ("item", *attributes)
        return cls(tuple(map(history_feature, tables)), tuple(map(candidate_feature, tables)), ("user_id", *crosses))

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.history, *self.candidates, *self.contextual)


def tables_of(raw: Any) -> Tables:
    """(name, rows) pairs from a TOML table, a manifest's lists or pairs already."""
    items = raw.items() if isinstance(raw, dict) else raw
    return tuple((str(name), rows) for name, rows in items)
