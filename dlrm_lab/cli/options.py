"""Options shared by several commands, declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Preset = Annotated[
    str, typer.Option("--preset", "-p", help="Model preset name (see `dlrm-lab presets`) or a .toml path.")
]
TableScale = Annotated[
    Optional[float],
    typer.Option("--table-scale", help="Multiply every table's rows by this factor (e.g. 0.01)."),
]
MaxRows = Annotated[Optional[int], typer.Option("--max-rows", help="Cap every table at this many rows.")]
MetricsDir = Annotated[str, typer.Option("--metrics-dir", help="Directory that receives the run directory.")]
