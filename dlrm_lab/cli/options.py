"""Command-line options: derived from the library's declarations (`config.options`), plus the few
that only the command line has (where results go, how progress shows)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.markup import escape

from dlrm_lab.config.options import Declared, ModelScaling, options_of
from dlrm_lab.config.values import OptionValues


def annotation(decl: Declared) -> Any:
    """The Typer parameter type of a declared option (a bool keeps Typer's --x/--no-x, a switch its one
    flag). Help is plain text: Typer renders it as rich markup, where `[data]` would vanish and `[/MODEL]` fail."""
    flags = () if decl.type is bool and decl.negatable else decl.flags
    return Annotated[decl.type, typer.Option(*flags, help=escape(decl.help))]


def aliases(config: type, *names: str) -> tuple[Any, ...]:
    """Declared options as Typer types, for a hand-written signature (`presets`, `data`)."""
    declared = {d.name: d for d in options_of(config)}
    return tuple(annotation(declared[name]) for name in names)


@dataclass(frozen=True)
class CliOnly:
    """An option of the command line alone (not a config's field, not a sweep key)."""

    name: str
    type: Any
    default: Any


def command(*options: Declared | CliOnly) -> Callable[[Callable[[OptionValues], Any]], Callable[..., Any]]:
    """A Typer command taking `options`: its signature is generated from them, and the body receives
    every option's value by name (a Python caller may pass a few; the rest take their defaults)."""
    params = [
        inspect.Parameter(
            o.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=o.default,
            annotation=annotation(o) if isinstance(o, Declared) else o.type,
        )
        for o in options
    ]
    defaults = {p.name: p.default for p in params}

    def wrap(body: Callable[[OptionValues], Any]) -> Callable[..., Any]:
        @functools.wraps(body, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
        def run(**given: Any) -> Any:
            if unknown := sorted(set(given) - set(defaults)):
                raise TypeError(f"{body.__name__}() got an unexpected keyword argument {unknown[0]!r}")
            return body({**defaults, **given})

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what Typer reads
        run.__annotations__ = {}  # Typer resolves these in the body's module, where `Any` may not be
        return run

    return wrap


TableScale, MaxRows = aliases(ModelScaling, "table_scale", "max_rows")
MetricsDir = Annotated[str, typer.Option("--metrics-dir", help="Directory that receives the run directory.")]
METRICS_DIR = CliOnly("metrics_dir", MetricsDir, "runs")
