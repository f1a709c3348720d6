"""The DLRM family (dot, cat and DCNv2 interactions): pooled tables, one sample a user-item pair.

Its spec is `config.specs.ModelSpec` (parsed by `config.presets`), its model `model.dlrm.DLRM` on
TorchRec modules; its serving builds `infer.builds.fused.FusedDLRM`; its sample library
`infer.library.PackedLibrary`. The cost conventions are `model.cost`'s docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dlrm_lab.config.family import TRAINING_MEMORY_SHARE, ModelFamily
from dlrm_lab.config.specs import ModelSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError, UserError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torchrec.distributed.types import ModuleSharder

    from dlrm_lab.data import DataParts
    from dlrm_lab.infer.serving_parts import Served, ServingParts
    from dlrm_lab.model.cost import SampleCostParts
    from dlrm_lab.train.preflight import TrainingChecks


def _mlp(in_features: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    layers, prev = [], in_features
    for size in sizes:
        layers.append((prev, size))
        prev = size
    return layers


@dataclass(frozen=True)
class DatasetWriter:
    """What `data gen` writes: `rows` of `unit`, announced by `headline`; `write(out, on_progress)` writes them."""

    rows: int
    unit: str
    headline: str
    write: Callable[[Any, Callable[[int], Any]], None]


class DLRMFamily:
    name = "dlrm"
    label = "DLRM"
    called = "a DLRM"
    spec_type = ModelSpec
    builds = (
        "eager",
        "fused",
        "compiled",
        "aoti",
        "aoti_frozen",
        "aoti_tuned",
        "aoti_buckets",
        "aoti_int8",
        "openvino",
        "openvino_int8",
    )
    no_compiled_build = ""
    attention_paths: tuple[str, ...] = ()
    wire_samples = True
    columns = ()  # its columns are the shared tables' own
    samples_in_spec = False  # its samples are a data spec's (data_gen/): --set changes that
    projectable = True
    cost_batch = 256  # samples: the larger of the two batches an instance times at start
    max_warmup_batch: int | None = None  # an instance warms up at the largest batch it will serve

    # ----- presets and specs
    def parse_preset(self, raw: JsonObject, *, where: str, table_scale: float | None,
                     max_rows: int | None) -> ModelSpec:  # fmt: skip
        from dlrm_lab.config.presets import parse_model

        return parse_model(raw, where=where, table_scale=table_scale, max_rows=max_rows)

    def spec_from_dict(self, data: JsonObject) -> ModelSpec:
        return ModelSpec.from_dict(data)

    def with_data_overrides(self, spec: ModelSpec, overrides: Sequence[str], *, serving: bool) -> ModelSpec:
        if serving and overrides:
            raise FieldError("data_overrides", f"{overrides[0]}: {{data_overrides}} changes an HSTU preset's "
                             f"requests; {spec.name} is a DLRM (its samples: {{data_spec}})", "data_overrides",
                             "data_spec")  # fmt: skip
        return spec  # training: --set applies to the data spec (data.resolve_data_spec)

    def size_line(self, spec: ModelSpec) -> str:
        from dlrm_lab.config.words import human_bytes, human_count

        scale = []
        if spec.table_scale != 1.0:
            scale.append(f"table_scale={spec.table_scale:g}")
        if spec.max_rows is not None:
            scale.append(f"max_rows={spec.max_rows}")
        how = f" ({', '.join(scale)})" if scale else ""
        return (
            f"{spec.name}{how}: {len(spec.tables)} tables, {human_count(sum(t.num_embeddings for t in spec.tables))} "
            f"rows, {human_count(spec.num_parameters)} parameters ({human_count(spec.embedding_parameters)} "
            f"embedding, {human_count(spec.dense_parameters)} dense), {human_bytes(spec.num_bytes)} fp32"
        )

    def describe(self, spec: ModelSpec) -> tuple[list[str], tuple[list[str], list[list[str]]] | None]:
        from dlrm_lab.config.words import human_bytes

        cross = f" ({spec.dcn_num_layers} cross layers, low rank {spec.dcn_low_rank})" if spec.interaction == "dcnv2" \
            else ""  # fmt: skip
        cost = self.sample_cost(spec, "fp32", "rowwise_adagrad", "train")
        lines = [
            self.size_line(spec), spec.description, f"source: {spec.source}", f"interaction: {spec.interaction}{cross}",
            f"bottom MLP: {spec.num_dense} -> {' -> '.join(map(str, spec.bottom_mlp))}",
            f"top MLP: {spec.over_arch_in_features} -> {' -> '.join(map(str, spec.top_mlp))}",
            f"per sample: {cost.forward_flops / 1e6:.3g} MFLOP forward, {cost.training_flops / 1e6:.3g} MFLOP "
            f"training, {human_bytes(cost.embedding_bytes_read)} of embedding rows read",
        ]  # fmt: skip
        columns = ["table", "feature", "rows", "dim", "pooling", "parameters", "fp32 bytes"]
        rows = [[t.name, ",".join(t.feature_names), f"{t.num_embeddings:,}", str(t.embedding_dim),
                 f"{t.pooling_factor:g}", f"{t.num_parameters:,}", human_bytes(4 * t.num_parameters)]
                for t in spec.tables]  # fmt: skip
        return lines, (columns, rows)

    def preset_table(self, specs: Sequence[ModelSpec]) -> tuple[str, list[str], list[list[str]]]:
        from dlrm_lab.config.words import human_bytes, human_count

        rows = []
        for spec in specs:
            dims = sorted({t.embedding_dim for t in spec.tables})
            pooling = [t.pooling_factor for t in spec.tables]
            rows.append([
                spec.name, spec.interaction, str(spec.num_dense), str(len(spec.tables)), "/".join(map(str, dims)),
                f"{min(pooling):g}" if min(pooling) == max(pooling) else f"{min(pooling):g}-{max(pooling):g}",
                human_count(sum(t.num_embeddings for t in spec.tables)), human_count(spec.num_parameters),
                human_bytes(spec.num_bytes),
            ])  # fmt: skip
        columns = ["preset", "inter", "dense", "tables", "dim", "pool", "rows", "params", "fp32"]
        return "model presets", columns, rows

    # ----- the model and its cost
    def build(self, spec: ModelSpec, device: Any, table_device: Any, table_precision: str, attention: str) -> Any:
        from dlrm_lab.model.dlrm import build_model

        return build_model(spec, device, table_device, table_precision)

    def sample_cost(self, spec: ModelSpec, table_precision: str, optimizer: str, window: str) -> Any:
        """Per sample: the MLPs and the interaction (forward; backward as `model.cost` counts it) and the
        pooled rows read, written back by the update, with row-wise Adagrad's one float per row."""
        from dlrm_lab.model.cost import SampleCost, lookup_bytes_per_sample

        bottom = _mlp(spec.num_dense, spec.bottom_mlp)
        top = _mlp(spec.over_arch_in_features, spec.top_mlp)
        bottom_fwd = sum(2 * i * o for i, o in bottom)
        top_fwd = sum(2 * i * o for i, o in top)
        bottom_bwd = sum(4 * i * o for i, o in bottom) - 2 * bottom[0][0] * bottom[0][1]
        top_bwd = 2 * top_fwd
        if spec.interaction == "dot":
            inter_fwd = 2 * (spec.num_features + 1) ** 2 * spec.embedding_dim
            inter_bwd = 2 * inter_fwd
        elif spec.interaction == "dcnv2":
            n, r = spec.over_arch_in_features, spec.dcn_low_rank
            inter_fwd = spec.dcn_num_layers * 4 * n * r
            inter_bwd = spec.dcn_num_layers * 8 * n * r
        else:
            inter_fwd = inter_bwd = 0
        rows_read = sum(t.pooling_factor * len(t.feature_names) for t in spec.tables)
        bytes_read = lookup_bytes_per_sample(spec, table_precision)
        state = 2 * 4 * rows_read if optimizer == "rowwise_adagrad" else 0.0  # one fp32 per row, read + write
        return SampleCost(
            bottom_mlp_flops=bottom_fwd,
            interaction_flops=inter_fwd,
            top_mlp_flops=top_fwd,
            forward_flops=bottom_fwd + inter_fwd + top_fwd,
            backward_flops=bottom_bwd + inter_bwd + top_bwd,
            embedding_bytes_read=float(bytes_read),
            embedding_bytes_written=float(bytes_read),  # the update rewrites every looked-up row
            embedding_rows_read=float(rows_read),
            optimizer_state_bytes=float(state),
        )

    def communication_bytes(self, spec: ModelSpec, global_batch: int, world_size: int,
                            sharding: dict[str, str]) -> dict[str, float]:  # fmt: skip
        """Pooled tables (see `model.cost.step_communication_bytes`): a row-wise or table-row-wise table's
        pooled output is reduce-scattered (each rank holds partial sums for the whole global batch), a
        data-parallel table sends no ids or pooled rows but all-reduces its gradient with the dense ones."""
        from dlrm_lab.model.cost import COMM_ITEMS, ROW_SHARDED

        remote = (world_size - 1) / world_size
        local_batch = global_batch / world_size
        out = dict.fromkeys(COMM_ITEMS, 0.0)
        replicated = 0
        for t in spec.tables:
            kind = sharding.get(t.name, "table_wise")
            features = len(t.feature_names)
            if kind == "data_parallel":
                replicated += t.num_parameters
                continue
            out["input_dist"] += local_batch * (8 * t.pooling_factor + 4) * features * remote
            pooled = 2 * 4 * t.embedding_dim * features * remote  # forward and backward, per sample
            if kind in ROW_SHARDED:
                out["pooled_reduce_scatter"] += global_batch * pooled
            else:
                out["pooled_all_to_all"] += local_batch * pooled
        out["gradient_all_reduce"] = 2 * remote * 4 * (spec.dense_parameters + replicated)
        return out

    def gemm_shapes(self, spec: ModelSpec, rows: int, max_rows: int) -> list[tuple[int, int, int]]:
        rows = max(1, min(rows, max_rows))
        shapes: list[tuple[int, int, int]] = []
        for n_in, sizes in ((spec.num_dense, spec.bottom_mlp), (spec.over_arch_in_features, spec.top_mlp)):
            for n_out in sizes:
                shapes.append((rows, n_in, n_out))
                n_in = n_out
        if spec.interaction == "dcnv2":
            n, r = spec.over_arch_in_features, spec.dcn_low_rank
            shapes += [(rows, n, r), (rows, r, n)] * spec.dcn_num_layers
        return shapes

    def request_flops_curve(self, spec: ModelSpec) -> None:
        return None  # a sample's FLOPs do not depend on a history length

    def sharder(self, spec: ModelSpec) -> ModuleSharder[torch.nn.Module]:
        from dlrm_lab.distributed.plan import AnyDeviceSharder

        return AnyDeviceSharder()

    def embedding_lr(self, spec: ModelSpec, default: float) -> tuple[float, str]:
        """Row-wise Adagrad moves every row a sample looks up by about the rate; a feature sum-pooling P ids
        then moves its pooled vector P times as far as a one-hot feature's, so the rate is divided by P to keep
        that step (measured in train.setup.embedding_lr_for)."""
        pooling = [t.pooling_factor for t in spec.tables for _ in t.feature_names]
        mean = sum(pooling) / len(pooling)
        if mean <= 1:
            return default, f"{default:g}: one id per feature"
        return default / mean, f"{default:g} / mean pooling factor {mean:g}"

    # ----- training
    def check_training(self, spec: ModelSpec, cfg: Any) -> None:
        check_training_fits(spec, cfg)

    def check_data_options(self, spec: ModelSpec, data: str, data_spec: str | None,
                           overrides: Sequence[str]) -> Any:  # fmt: skip
        from dlrm_lab.data import resolve_data_spec

        if data == "synthetic":
            return resolve_data_spec(spec, data_spec, tuple(overrides))
        if data_spec or overrides:
            raise UserError("--data-spec/--set apply to --data synthetic, not to a dataset on disk")
        return None

    def open_sources(self, spec: ModelSpec, data: str, batch_size: int, **how: Any) -> tuple[Any, Any]:
        """Synthetic samples (held out: the same generator far past any training sample), or a Parquet dataset
        (held out: its generator's samples where it names one, else its first batches, and the description says
        so: converted Criteo)."""
        from dlrm_lab.data import (
            HELD_OUT_OFFSET,
            DataSpec,
            FirstBatches,
            ParquetSource,
            SyntheticGenerator,
            SyntheticSource,
            check_data_options,
        )

        rank, world, evals, start = how["rank"], how["world_size"], how["eval_batches"], how["start_batch"]
        data_spec = check_data_options(spec, data, how["data_spec"], how["overrides"])
        if data_spec is not None:
            gen = SyntheticGenerator(data_spec, how["seed"])
            train = SyntheticSource(gen, batch_size, rank, world, start_batch=start)
            return train, SyntheticSource(gen.clone(), batch_size, rank, world, evals, offset=HELD_OUT_OFFSET)
        files = ParquetSource(data, spec, batch_size, rank, world, start_batch=start)
        if (recorded := files.info.get("data_spec")) is not None:  # its _dataset.json, checked as it was read
            seed = cast(int, files.info.get("seed", 0))
            gen = SyntheticGenerator(DataSpec.from_dict(cast(JsonObject, recorded)), int(seed))
            return files, SyntheticSource(gen, batch_size, rank, world, evals, offset=HELD_OUT_OFFSET)
        return files, FirstBatches(ParquetSource(data, spec, batch_size, rank, world, evals, epochs=1))

    def dataset_writer(self, spec: ModelSpec, *, rows: int, shards: int, seed: int, fmt: str,
                       data_spec: str | None, overrides: Sequence[str], window: str) -> Any:  # fmt: skip
        """`data gen`: `rows` samples of the data spec as Parquet shards or one Criteo TSV file (checked here)."""
        from dlrm_lab.data import synthetic_generator

        generator = synthetic_generator(spec, data_spec, tuple(overrides), seed)
        if fmt == "criteo-tsv":
            from dlrm_lab.data.criteo import check_tsv_spec

            check_tsv_spec(generator.spec)
            if shards != 1:
                raise FieldError("shards", ": criteo-tsv writes one file")

        def write(out: Any, on_progress: Any) -> None:
            if fmt == "parquet":
                from dlrm_lab.data.parquet import write_dataset

                write_dataset(generator, rows, out, shards=shards, on_progress=on_progress)
            else:
                from dlrm_lab.data.criteo import write_criteo_tsv

                write_criteo_tsv(generator, rows, out, on_progress=on_progress)

        headline = (f"spec {generator.spec.name} for {spec.name}: teacher AUC {generator.teacher_auc:.4f}, "
                    f"click rate {generator.spec.click_rate:g}")  # fmt: skip
        return DatasetWriter(rows=rows, unit="samples", headline=headline, write=write)

    # ----- serving
    def check_served(self, served: Served[ModelSpec]) -> None:
        from dlrm_lab.data import resolve_data_spec

        if served.history_cache_mb:
            raise FieldError("history_cache_mb", f"{served.history_cache_mb:g}: history reuse is for HSTU presets; "
                             f"{served.spec.name} is a DLRM")  # fmt: skip
        resolve_data_spec(served.spec, served.data_spec)  # a bad --data-spec is one line before anything starts
        if served.checkpoint:
            from dlrm_lab.model.checkpoint import check_spec

            check_spec(served.checkpoint, served.spec.to_dict())

    def serving_model(
        self, served: Served[ModelSpec], seed: int, log: Any
    ) -> tuple[Any, str | None, JsonObject | None]:
        import torch

        from dlrm_lab.model.dlrm import build_model

        torch.manual_seed(seed)
        model = build_model(served.spec).eval()
        if served.checkpoint:
            from dlrm_lab.model.checkpoint import load_weights

            load_weights(model, served.checkpoint)
        return model, None, None

    def sample_library(self, served: Served[ModelSpec], seed: int, samples: int) -> Any:
        from dlrm_lab.infer.library import PackedLibrary

        return PackedLibrary.generate(served.spec, served.data_spec, seed, samples)

    def library_from_arrays(self, arrays: dict[str, np.ndarray]) -> Any:
        from dlrm_lab.infer.library import PackedLibrary

        return PackedLibrary(**arrays)

    def held_out(self, served: Served[ModelSpec], library: Any, seed: int) -> Any:
        """A trained model's: its training run's own held-out samples, drawn again as that run drew them (the
        first of them are the ones its last evaluation scored); an untrained one's: its generator's samples
        beyond the served ones."""
        from dlrm_lab.data import synthetic_generator
        from dlrm_lab.data.source import batches_to_block
        from dlrm_lab.infer.accuracy import CHECK_SAMPLES

        if not served.checkpoint:
            generator = synthetic_generator(served.spec, served.data_spec, seed=seed)
            return generator.samples(library.size, library.size + CHECK_SAMPLES)  # beyond the served samples
        trained = served.checkpoint
        data = trained.data
        if data != "synthetic" and not Path(data).exists():
            raise FieldError("checkpoint", f"{served.checkpoint.path}: its training data {data} is gone: the accuracy "
                             "rule scores that run's held-out samples")  # fmt: skip
        batch = 2048
        _, held_out = self.open_sources(served.spec, data, batch, rank=0, world_size=1,
                                        eval_batches=-(-CHECK_SAMPLES // batch), data_spec=trained.data_spec,
                                        overrides=trained.data_overrides, seed=trained.seed, start_batch=0)  # fmt: skip
        return batches_to_block(held_out, CHECK_SAMPLES)

    def check_samples(self, block: Any) -> Any:
        """Held-out samples as both models of an accuracy check score them: packed once."""
        from dlrm_lab.infer.library import PackedLibrary

        return PackedLibrary.from_block(block)

    def score(self, module: Any, samples: Any, precision: str, autocast: bool) -> Any:
        """A build's scores of samples (a PackedLibrary or a SampleBlock), all in one batch as an instance
        assembles it."""
        import torch

        from dlrm_lab.infer.batches import QueryRef, assemble_batch, gather_batch, kernel_batch
        from dlrm_lab.infer.builds.fused import FusedDLRM
        from dlrm_lab.infer.library import PackedLibrary
        from dlrm_lab.metrics.precision import DTYPES

        packed = samples if isinstance(samples, PackedLibrary) else PackedLibrary.from_block(samples)
        everything = [QueryRef(-1, packed.size, 0)]
        with torch.inference_mode():
            if isinstance(module, FusedDLRM):
                return module(*kernel_batch(*gather_batch(packed, everything))).numpy()
            dense, kjt = assemble_batch(packed, everything, list(module.spec.feature_names))
            with torch.autocast("cpu", dtype=DTYPES[precision], enabled=autocast):
                return torch.sigmoid(module(dense, kjt).float()).numpy()

    def memory(self, served: Served[ModelSpec]) -> Any:
        """Tables at fp32 and at the served precision, the library's packed samples, one batch's
        activations per instance; making a fused build copies the model (TorchRec's quantize_embeddings) and
        fills one TBE at the table precision beside the fp32 tables: the parent's peak while it is chosen."""
        from dlrm_lab.infer.memory import INSTANCE_RUNTIME_BYTES, library_samples
        from dlrm_lab.infer.serving_parts import ModelMemory
        from dlrm_lab.model.cost import stored_table_bytes

        spec = served.spec
        fp32 = int(stored_table_bytes(spec, "fp32"))
        stored = int(stored_table_bytes(spec, served.table_precision))
        ids_per_sample = sum(t.pooling_factor * len(t.feature_names) for t in spec.tables)
        per_sample = 4 * spec.num_dense + 8 * ids_per_sample + (4 + 8) * spec.num_features + 4
        widths = sum(spec.bottom_mlp) + sum(spec.top_mlp) + spec.over_arch_in_features + ids_per_sample * 2
        activations = 2 * 4 * served.max_batch * widths  # forward activations, with room for a copy
        dense = 4 * spec.dense_parameters
        fused = served.build != "eager"
        build_peak = fp32 + (fp32 + stored if fused else (stored if served.table_precision != "fp32" else 0))
        return ModelMemory(
            name=served.name,
            fp32_tables=fp32,
            build_peak=build_peak,
            snapshot=stored,
            library=int(per_sample * library_samples(served.max_batch, served.library_samples)),
            per_instance=int(INSTANCE_RUNTIME_BYTES + dense + activations),
            instances=served.instances,
            device_per_instance=int(fp32 + stored + dense + activations),
        )

    def count_columns(self, served: Served[ModelSpec], counts: Any) -> dict[str, int | None]:
        return {}  # nothing counted per query

    def summarize_queries(
        self, records: Sequence[Mapping[str, object]], ok: np.ndarray, samples: np.ndarray
    ) -> dict[str, float | None]:
        return {}

    def make_fused(self, model: Any, *, precision: str, table_precision: str) -> Any:
        from dlrm_lab.infer.builds.fused import FusedDLRM

        return FusedDLRM(model, precision=precision, table_precision=table_precision)

    def make_runner(self, model: Any, library: Any, device: Any, precision: str, history_cache_mb: float) -> Any:
        from dlrm_lab.infer.batches import FusedRunner, PackagedRunner, Runner
        from dlrm_lab.infer.builds.fused import FusedDLRM

        if isinstance(model, FusedDLRM):
            if model.whole is not None and device.type == "cpu":  # the whole batch is one native call
                return PackagedRunner(model, library, device)
            return FusedRunner(model, library, device)
        return Runner(model, library, list(model.spec.feature_names), device, precision)

    def id_rows(self, spec: ModelSpec) -> list[int]:
        return list(spec.rows_per_feature)


def check_training_fits(spec: ModelSpec, cfg: Any, available_bytes: int | None = None) -> None:
    """Refuse, before anything is built, a model whose dense part (weights, gradients, optimizer state) and one
    batch's activations cannot fit this host's available memory, per rank times the ranks on this host. The
    tables are the sharding planner's to place and refuse (TorchRec's, against the same memory)."""
    import psutil

    from dlrm_lab.model.cost import training_memory

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need = training_memory(spec, cfg.batch_size, cfg.dense_optimizer, distributed=local_ranks > 1)
    total = local_ranks * (need.dense + need.activations)
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if total > TRAINING_MEMORY_SHARE * available:
        gib = 2.0**30
        ranks = f" x {local_ranks} ranks on this host" if local_ranks > 1 else ""
        raise UserError(
            f"training {spec.name} at --batch-size {cfg.batch_size} needs {total / gib:,.1f} GiB before its tables "
            f"(dense part {need.dense / gib:,.2f} GiB with gradients and {cfg.dense_optimizer} state, one batch's "
            f"activations {need.activations / gib:,.2f} GiB{ranks}) but this machine has {available / gib:.1f} GiB "
            "available: fewer features or narrower MLPs, or a smaller --batch-size"
        )


_FAMILY = DLRMFamily()
FAMILY: ModelFamily[ModelSpec] = _FAMILY  # checked against the protocol here, and its rooms' roles below
_ROLES: tuple[SampleCostParts[ModelSpec], DataParts[ModelSpec], TrainingChecks[ModelSpec], ServingParts[ModelSpec]]
_ROLES = (_FAMILY, _FAMILY, _FAMILY, _FAMILY)
