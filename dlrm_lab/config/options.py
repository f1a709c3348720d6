"""Options declared once: the fields of a typed config that a user sets.

A config (`TrainConfig`, `InferConfig`, `ServingOptions`, ...) declares each such field with
`option(default, help)`: its name, type, default and help text are the one declaration. The
command line's flags and Typer signature (`dlrm_lab.cli.options`), a sweep's TOML keys and
their checks (`dlrm_lab.commands`) are derived from it. Library code names fields in its
errors (`FieldError`); the command line names them by flag (`Declared.flag`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from dlrm_lab.config.values import OptionValues
from dlrm_lab.errors import FieldError, UserError

SAME: Any = type("Same", (), {"__repr__": lambda self: "SAME"})()  # the command's default is the config's
REQUIRED: Any = ...  # a field without a default: its option must be given (Typer reads `...` so)


@dataclass(frozen=True)
class Option:
    """How a field is given on the command line (kept in the field's metadata)."""

    help: str
    flags: tuple[str, ...] = ()  # its spellings, the first naming it; none: --field-name (and --no- for a bool)
    type: Any = None  # its type there, where that differs from the field's (a repeated option for a tuple)
    default: Any = SAME  # the command's default, where it differs from the config's
    negatable: bool = True  # a bool: also --no-NAME (False: a switch, its one flag turns it on)


def option(
    default: Any,
    help: str,
    *,
    flags: Iterable[str] = (),
    type: Any = None,
    cli_default: Any = SAME,
    negatable: bool = True,
) -> Any:
    """A config field that is also a command-line option and a sweep key (`REQUIRED`: no default)."""
    opt = Option(help, tuple(flags), type, cli_default, negatable)
    return dataclasses.field(default=MISSING if default is REQUIRED else default, metadata={"option": opt})


class OptionChange(typing.TypedDict, total=False):
    """How one command declares an option another config holds, where its words differ (`options_of(**changes)`):
    the `Declared` fields it replaces."""

    help: str
    default: Any  # the option's own type's value
    type: Any  # a type, as a dataclass field's annotation
    flags: tuple[str, ...]
    negatable: bool


@dataclass(frozen=True)
class Declared:
    """One option of a command: the config field it sets and how it is given."""

    owner: type  # the config holding the field
    field: str
    name: str  # the command's parameter and the sweep's key (`batch_size`; TOML may spell it `batch-size`)
    type: Any
    default: Any
    help: str
    flags: tuple[str, ...] = ()  # declared spellings; none: derived from `name`
    negatable: bool = True

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")


def options_of(
    config: type, *, exclude: Iterable[str] = (), only: Iterable[str] | None = None, **changes: OptionChange
) -> list[Declared]:
    """The options `config` declares, in field order; `changes` adjusts one per command by name
    (e.g. `duration={"default": 1.0}`), `exclude` leaves some out and `only` keeps those named."""
    hints = typing.get_type_hints(config)
    own = config.__dict__.get("__annotations__", {})
    out = []
    # its own options first, then those it inherits (ServingOptions: serving, then the tables' scaling)
    for f in sorted(dataclasses.fields(config), key=lambda f: f.name not in own):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        if f.default is not MISSING:
            default = f.default
        else:
            default = REQUIRED if f.default_factory is MISSING else f.default_factory()
        name = opt.flags[0].lstrip("-").replace("-", "_") if opt.flags else f.name
        if opt.default is not SAME:
            default = opt.default
        decl = Declared(config, f.name, name, opt.type or hints[f.name], default, opt.help, opt.flags, opt.negatable)
        if name not in exclude and (only is None or name in only):
            out.append(dataclasses.replace(decl, **changes.get(name, {})))
    if unknown := sorted(set(changes) - {d.name for d in out}):
        raise TypeError(f"{config.__name__} declares no option {unknown[0]!r}")
    return out


def by_field(field: str, check: Any, value: Any) -> Any:
    """`check(value, field)`, a shared rule that names what it checks first, its UserError a FieldError."""
    try:
        return check(value, field)
    except FieldError:
        raise
    except UserError as exc:
        text = str(exc)
        if not text.startswith(field + " "):
            raise
        raise FieldError(field, text[len(field) + 1 :]) from None


def coerce(decl: Declared, value: Any) -> Any:
    """`value` (from TOML or Python) as the command line would parse it into the option's type:
    int, float, str, bool, a list or tuple of them, or Optional of one. A mismatch is a FieldError."""
    return coerce_as(decl.field, value, decl.type)


def _given(kind: Any) -> Any:
    """The type a value given for `kind` has: X for Optional[X] (None is the option left unset)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def coerce_as(field: str, value: Any, kind: Any) -> Any:
    """`value` as the command line would parse it into `kind`; a mismatch is a FieldError of `field`."""
    if value is None:
        return None
    kind = _given(kind)
    args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        items = value if isinstance(value, list | tuple) else [value]
        converted = [coerce_as(field, v, args[0]) for v in items]
        return tuple(converted) if origin is tuple else converted
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise FieldError(field, f"{value!r}: must be true or false")
    if kind in (int, float):
        what = f"must be a {'whole ' if kind is int else ''}number"
        if isinstance(value, bool):
            raise FieldError(field, f"{value!r}: {what}")
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            raise FieldError(field, f"{value!r}: {what}") from None
        if kind is int and isinstance(value, float) and value != number:
            raise FieldError(field, f"{value!r}: must be a whole number")
        if kind is float and not math.isfinite(number):  # no option means anything by nan or inf
            raise FieldError(field, f"{value!r}: must be a finite number")
        return number
    return str(value)


def given(
    options: Mapping[str, Any], declared: list[Declared], command: str, ignored: Iterable[str] = ()
) -> OptionValues:
    """Option values keyed by name (`batch-size` or `batch_size`), each coerced to its declared
    type; a name the command does not declare names the ones it does."""
    by_name = {d.name: d for d in declared}
    values = {k.replace("-", "_").rstrip("_"): v for k, v in options.items()}  # `set_`: a function's --set
    values = {k: v for k, v in values.items() if k not in set(ignored)}
    if unknown := sorted(set(values) - set(by_name)):
        names = ", ".join(sorted(d.flag for d in declared))
        raise UserError(f"{command}: unknown option --{unknown[0].replace('_', '-')}; allowed: {names}")
    return {k: coerce(by_name[k], v) for k, v in values.items()}


def parse_words(declared: list[Declared], words: list[str], command: str) -> OptionValues:
    """The options given in `words` (a command line's, after the command), keyed as a sweep's options are
    (`batch-size`), each coerced to its declared type; an unknown flag or a bad value is one UserError naming it.
    The library's own parser, so that a TorchX component or a scaling run checks a command's words without the
    command line (which stands above the library); stdlib argparse, set up from the declarations as Typer is."""
    parser = _WordParser(prog=command, add_help=False, allow_abbrev=False)
    for d in declared:
        dest: dict[str, Any] = {"dest": d.name, "default": argparse.SUPPRESS}
        spellings = list(d.flags) or [d.flag]
        kind = _given(d.type)
        if kind is bool:
            action = argparse.BooleanOptionalAction if d.negatable else "store_true"
            parser.add_argument(*spellings, action=action, **dest)
        elif typing.get_origin(kind) in (list, tuple):
            parser.add_argument(*spellings, action="append", **dest)
        else:
            parser.add_argument(*spellings, **dest)
    values = vars(parser.parse_args(list(words)))
    by_name = {d.name: d for d in declared}
    return {name.replace("_", "-"): coerce(by_name[name], value) for name, value in values.items()}


class _WordParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would print usage and exit
        raise UserError(f"{self.prog}: {message}; see dlrm-lab {self.prog} --help")


def build(config: type, declared: list[Declared], values: Mapping[str, Any], **fixed: Any) -> Any:
    """`config` from the values of its declared options (by name); an option left unset (None
    where the config has a default) takes the config's default. `fixed` sets other fields."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    kwargs = {}
    for d in declared:
        if d.owner is not config or d.name not in values:
            continue
        value = values[d.name]
        if value is None and fields[d.field].default is not None:
            continue
        kwargs[d.field] = tuple(value) if isinstance(value, list) else value
    return config(**kwargs, **fixed)


@dataclass(frozen=True)
class ModelScaling:
    """How a preset's tables are scaled down: every command that builds a preset takes these."""

    table_scale: float | None = option(None, "Multiply every table's rows by this factor (e.g. 0.01).")
    max_rows: int | None = option(None, "Cap every table at this many rows.")


@dataclass(frozen=True)
class PresetChoice(ModelScaling):
    """One model preset, scaled (`train`'s model)."""

    preset: str = option(
        "tiny", "Model preset name (see `dlrm-lab presets`) or a .toml path.", flags=("--preset", "-p")
    )

    def load(self) -> Any:
        """The preset's spec, of either family (a DLRM or the HSTU ranker)."""
        from dlrm_lab.config.presets import load_any_preset

        return load_any_preset(self.preset, table_scale=self.table_scale, max_rows=self.max_rows)
