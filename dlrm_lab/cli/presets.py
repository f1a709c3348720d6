"""`dlrm-lab presets`: list the model presets, or show one resolved."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from dlrm_lab.cli.format import console, human_bytes, human_count
from dlrm_lab.cli.options import MaxRows, TableScale
from dlrm_lab.config import HSTUSpec, ModelSpec, available_presets, load_any_preset, load_preset

app = typer.Typer(help="Model presets (models/*.toml).", invoke_without_command=True, no_args_is_help=False)


def size_line(spec: ModelSpec | HSTUSpec) -> str:
    """One line with what a preset costs, printed before anything is built."""
    scale = []
    if isinstance(spec, HSTUSpec):
        h = round(spec.mean_history)
        return (
            f"{spec.name}: HSTU ranker, {spec.shape.layers} STU layers of width {spec.shape.stu.dim}, "
            f"{human_count(spec.num_parameters)} parameters ({human_count(spec.embedding_parameters)} embedding), "
            f"{human_bytes(4 * spec.num_parameters)} fp32; a request ~{h:,} history items + "
            f"{spec.data.candidates:,} candidates, {spec.shape.request_flops(h, spec.data.candidates) / 1e9:.3g} GFLOP"
        )
    if spec.table_scale != 1.0:
        scale.append(f"table_scale={spec.table_scale:g}")
    if spec.max_rows is not None:
        scale.append(f"max_rows={spec.max_rows}")
    how = f" ({', '.join(scale)})" if scale else ""
    return (
        f"{spec.name}{how}: {len(spec.tables)} tables, {human_count(sum(t.num_embeddings for t in spec.tables))} rows, "
        f"{human_count(spec.num_parameters)} parameters ({human_count(spec.embedding_parameters)} embedding, "
        f"{human_count(spec.dense_parameters)} dense), {human_bytes(spec.num_bytes)} fp32"
    )


@app.callback()
def list_presets(
    ctx: typer.Context,
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
) -> None:
    """List presets with tables, rows, parameters and bytes."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table(title="model presets")
    for col in ("preset", "inter", "dense", "tables", "dim", "pool", "rows", "params", "fp32"):
        table.add_column(col, justify="right" if col not in ("preset", "inter") else "left", no_wrap=True)
    for name in available_presets():
        spec = load_preset(name, table_scale=table_scale, max_rows=max_rows)
        dims = sorted({t.embedding_dim for t in spec.tables})
        pooling = [t.pooling_factor for t in spec.tables]
        table.add_row(
            name,
            spec.interaction,
            str(spec.num_dense),
            str(len(spec.tables)),
            "/".join(map(str, dims)),
            f"{min(pooling):g}" if min(pooling) == max(pooling) else f"{min(pooling):g}-{max(pooling):g}",
            human_count(sum(t.num_embeddings for t in spec.tables)),
            human_count(spec.num_parameters),
            human_bytes(spec.num_bytes),
        )
    console().print(table)
    hstu = Table(title="HSTU ranker presets (family hstu, docs/hstu.md)")
    for col in ("preset", "layers", "dim", "heads", "items", "users", "candidates", "history", "params", "fp32"):
        hstu.add_column(col, justify="left" if col == "preset" else "right", no_wrap=True)
    for name in available_presets("hstu"):
        h = load_any_preset(name, table_scale=table_scale, max_rows=max_rows)
        assert isinstance(h, HSTUSpec)
        hstu.add_row(
            name, str(h.shape.layers), str(h.shape.stu.dim), str(h.shape.stu.heads), human_count(h.shape.items),
            human_count(h.shape.users), str(h.data.candidates), f"<= {h.data.max_history:,}",
            human_count(h.num_parameters), human_bytes(4 * h.num_parameters),
        )  # fmt: skip
    console().print(hstu)


def _show_hstu(spec: HSTUSpec) -> None:
    out = console()
    shape, data = spec.shape, spec.data
    out.print(size_line(spec))
    out.print(spec.description)
    out.print(f"source: {spec.source}")
    out.print(
        f"{shape.layers} STU layers, width {shape.stu.dim}, {shape.stu.heads} heads of q/k {shape.stu.qk_dim} and "
        f"v {shape.stu.v_dim}; tables item {shape.items:,}, category {shape.categories:,}, user {shape.users:,} rows"
    )
    h = round(spec.mean_history)
    out.print(
        f"per request (mean training history {h:,} items, {data.candidates:,} candidates): "
        f"{shape.request_flops(h, data.candidates) / 1e9:.3g} GFLOP forward, "
        f"{human_bytes(shape.request_lookup_bytes(h, data.candidates))} of embedding rows read"
    )
    out.print(
        f"data: {data.users:,} users, {data.timestamps} steps ({data.warmup_timestamps}-{data.train_timestamps - 1} "
        f"train, {data.train_timestamps}-{data.timestamps - 1} evaluate), {data.active_share:g} active a step, "
        f"N({data.interactions_mean:g}, {data.interactions_sd:g}) items met, history <= {data.max_history:,}"
    )


@app.command("show")
def show(
    name: str = typer.Argument(..., help="Preset name or .toml path."),
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    as_json: bool = typer.Option(False, "--json", help="Print the resolved spec as JSON."),
) -> None:
    """Print one preset resolved: every table, the MLPs and the sizes."""
    spec = load_any_preset(name, table_scale=table_scale, max_rows=max_rows)
    if as_json:
        typer.echo(json.dumps(spec.to_dict(), indent=2, default=str))
        return
    if isinstance(spec, HSTUSpec):
        _show_hstu(spec)
        return
    out = console()
    out.print(size_line(spec))
    out.print(spec.description)
    out.print(f"source: {spec.source}")
    out.print(
        f"interaction: {spec.interaction}"
        + (
            f" ({spec.dcn_num_layers} cross layers, low rank {spec.dcn_low_rank})"
            if spec.interaction == "dcnv2"
            else ""
        )
    )
    out.print(f"bottom MLP: {spec.num_dense} -> {' -> '.join(map(str, spec.bottom_mlp))}")
    out.print(f"top MLP: {spec.over_arch_in_features} -> {' -> '.join(map(str, spec.top_mlp))}")
    from dlrm_lab.model.cost import sample_cost

    cost = sample_cost(spec)
    out.print(
        f"per sample: {cost.forward_flops / 1e6:.3g} MFLOP forward, {cost.training_flops / 1e6:.3g} MFLOP "
        f"training, {human_bytes(cost.embedding_bytes_read)} of embedding rows read"
    )
    table = Table()
    for col in ("table", "feature", "rows", "dim", "pooling", "parameters", "fp32 bytes"):
        table.add_column(col, justify="left" if col in ("table", "feature") else "right")
    for t in spec.tables:
        table.add_row(
            t.name,
            ",".join(t.feature_names),
            f"{t.num_embeddings:,}",
            str(t.embedding_dim),
            f"{t.pooling_factor:g}",
            f"{t.num_parameters:,}",
            human_bytes(4 * t.num_parameters),
        )
    out.print(table)
