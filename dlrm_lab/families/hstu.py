"""The HSTU ranker family (MLPerf DLRMv3): sequence tables, one sample a request of a user's history
and its candidates, scored per candidate.

Its spec is `config.hstu.HSTUSpec`, its model `model.hstu.HSTURanker`, its requests
`data.sequences` (synthetic, time-ordered) and `data.request_files` (Parquet); its sample library
`infer.requests.RequestLibrary`; history reuse across a user's requests `infer.history`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dlrm_lab.config.family import TRAINING_MEMORY_SHARE, ModelFamily
from dlrm_lab.config.hstu import HSTUSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.columns import BOOL, F64, HIGHER, I32, I64, LATENCY_PARTS, STR, define

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torchrec.distributed.types import ModuleSharder

    from dlrm_lab.data import DataParts
    from dlrm_lab.data.streaming import StreamingParts
    from dlrm_lab.infer.serving_parts import Served, ServingParts
    from dlrm_lab.model.cost import SampleCostParts
    from dlrm_lab.train.preflight import TrainingChecks

# Its columns in the shared inference tables (history reuse, its attention path), each placed after a
# column of the table (`metrics.columns.register_columns`): null in other families' rows.
COLUMNS = (
    (
        "queries",
        "error",
        [
            define("history_reused", I32),  # with history reuse: requests that reused a cached history
            define("history_tokens_reused", I64),  # ... their history tokens not encoded again
        ],
    ),
    (
        "infer summary",
        "batch_per_sample_us",
        [
            define("history_cache_mb", F64),  # per-instance history cache (0: off)
            define("history_affinity", BOOL),  # a user's requests routed to the instance holding their history
            define("attention", STR),  # the attention path served
        ],
    ),
    (
        "infer summary",
        f"tail_{LATENCY_PARTS[-1]}_ms",
        [
            # with history reuse: share of completed requests that reused a cached history, and the
            # history tokens not encoded again per request
            define("history_hit_rate", F64, "requests that reused a cached history", "fraction", ".1%", HIGHER,
                   "history hits"),
            define("history_tokens_reused_mean", F64, "history tokens reused per request", "tokens", ".1f"),
        ],
    ),
    ("frontier", "build", ["history_cache_mb"]),
    # --protocol streaming: the window the model was training on, and the later one it was scored on
    ("eval", "eval_time_ms", [define("train_window", I32), define("eval_window", I32)]),
    ("frontier", "best_sla_latency_spread_ms", [define("best_history_hit_rate", F64)]),  # at best_qps, median
)  # fmt: skip

ATTENTION_BATCH = 16  # requests the serving attention path is timed over (at most max_batch)
CHECK_CHUNK = 64  # requests scored at a time by a build's accuracy check


class HSTUFamily:
    name = "hstu"
    label = "HSTU ranker"
    called = "the HSTU ranker"
    spec_type = HSTUSpec
    builds = ("eager", "fused")
    no_compiled_build = ("its batches are jagged sequences of every length, and its attention path is chosen by "
                         "measurement already")  # fmt: skip
    attention_paths = ("padded", "jagged")
    samples_in_spec = True  # its requests are its preset's [data] table: --set changes the spec
    columns = COLUMNS
    wire_samples = False  # the gRPC transports carry DLRM samples (dense + pooled ids)
    projectable = False  # the scaling model (train.scaling_model) counts pooled tables and DLRM's phases
    # requests an instance times its batch cost over, and the largest batch it warms up with: each request
    # is a whole sequence (a DLRMv3-shaped one takes ~0.1 s on a CPU core, linear in requests), and the
    # jagged path has no fixed shapes to warm
    cost_batch = 8
    max_warmup_batch: int | None = 8

    # ----- presets and specs
    def parse_preset(self, raw: JsonObject, *, where: str, table_scale: float | None,
                     max_rows: int | None) -> HSTUSpec:  # fmt: skip
        from dlrm_lab.config.hstu import parse_hstu

        return parse_hstu(raw, where=where, table_scale=table_scale, max_rows=max_rows)

    def spec_from_dict(self, data: JsonObject) -> HSTUSpec:
        return HSTUSpec.from_dict(data)

    def with_data_overrides(self, spec: HSTUSpec, overrides: Sequence[str], *, serving: bool) -> HSTUSpec:
        """`--set KEY=VALUE` changes the requests, so the cost and the manifest too."""
        from dlrm_lab.data.sequences import with_overrides

        return with_overrides(spec, tuple(overrides))

    def size_line(self, spec: HSTUSpec) -> str:
        from dlrm_lab.config.words import human_bytes, human_count

        h = round(spec.mean_history)
        return (
            f"{spec.name}: HSTU ranker, {spec.shape.layers} STU layers of width {spec.shape.stu.dim}, "
            f"{len(spec.tables)} tables, "
            f"{human_count(spec.num_parameters)} parameters ({human_count(spec.embedding_parameters)} embedding), "
            f"{human_bytes(4 * spec.num_parameters)} fp32; a request ~{h:,} history items + "
            f"{spec.data.candidates:,} candidates, {spec.shape.request_flops(h, spec.data.candidates) / 1e9:.3g} GFLOP"
        )

    def describe(self, spec: HSTUSpec) -> tuple[list[str], None]:
        from dlrm_lab.config.words import human_bytes

        shape, data, h = spec.shape, spec.data, round(spec.mean_history)
        (tower_hidden, tower_out), (head_hidden, _) = shape.tower_widths
        attributes = len(shape.attribute_tables)
        lines = [
            self.size_line(spec), spec.description, f"source: {spec.source}",
            f"{shape.layers} STU layers, width {shape.stu.dim}, {shape.stu.heads} heads of q/k {shape.stu.qk_dim} and "
            f"v {shape.stu.v_dim}; {shape.contextual_tokens} contextual token(s); item tower "
            f"{(1 + attributes) * shape.stu.dim} -> {tower_hidden} -> {tower_out}, head {shape.stu.dim} -> "
            f"{head_hidden} -> 1",
            "tables: " + ", ".join(f"{name} {rows:,}" for name, rows in shape.table_rows.items()) + " rows",
            f"per request (mean training history {h:,} items, {data.candidates:,} candidates): "
            f"{shape.request_flops(h, data.candidates) / 1e9:.3g} GFLOP forward, "
            f"{human_bytes(shape.request_lookup_bytes(h, data.candidates))} of embedding rows read",
            f"data: {data.users:,} users, {data.timestamps} steps ({data.warmup_timestamps}-"
            f"{data.train_timestamps - 1} train, {data.train_timestamps}-{data.timestamps - 1} evaluate), "
            f"{data.active_share:g} active a step, N({data.interactions_mean:g}, {data.interactions_sd:g}) items "
            f"met, history <= {data.max_history:,}",
        ]  # fmt: skip
        ref = spec.reference
        recipe = [f"global batch {ref.batch_size:,}" if ref.batch_size else "",
                  f"dense {ref.dense_optimizer or 'optimizer'} lr {ref.dense_lr:g}" if ref.dense_lr else "",
                  f"target AUC {ref.target_auc:g}" if ref.target_auc else "",
                  f"{ref.samples_to_target / 1e6:.1f}M samples to it" if ref.samples_to_target else ""]  # fmt: skip
        if any(recipe):
            lines.append("reference: " + ", ".join(part for part in recipe if part))
        if spec.reference_flops_per_sample:
            lines.append(f"FLOPs per training sample by the reference's rule (S = {ref.max_seq_len:,}): "
                         f"{spec.reference_flops_per_sample / 1e9:.1f} GFLOP (published: "
                         f"{(ref.flops_per_sample or 0) / 1e9:.1f})")  # fmt: skip
        if rules := spec.mlperf:  # the serving defaults the preset sets (docs/hstu.md)
            lines.append(f"MLPerf {rules.benchmark}: Server p99 <= {rules.server_latency_ms:g} ms (the default "
                         f"--sla-ms); a served build keeps {rules.accuracy_share:.1%} of fp32's NE, accuracy and "
                         "per-request AUC")  # fmt: skip
        return lines, None

    def preset_table(self, specs: Sequence[HSTUSpec]) -> tuple[str, list[str], list[list[str]]]:
        from dlrm_lab.config.words import human_bytes, human_count

        rows = [[
            h.name, str(h.shape.layers), str(h.shape.stu.dim), str(h.shape.stu.heads), human_count(h.shape.items),
            human_count(h.shape.users), str(h.data.candidates), f"<= {h.data.max_history:,}",
            human_count(h.num_parameters), human_bytes(4 * h.num_parameters),
        ] for h in specs]  # fmt: skip
        columns = ["preset", "layers", "dim", "heads", "items", "users", "candidates", "history", "params", "fp32"]
        return "HSTU ranker presets (family hstu, docs/hstu.md)", columns, rows

    # ----- the model and its cost
    def build(self, spec: HSTUSpec, device: Any, table_device: Any, table_precision: str, attention: str) -> Any:
        from dlrm_lab.model.hstu import build_ranker

        return build_ranker(spec, device, table_device, table_precision, attention)

    def sample_cost(self, spec: HSTUSpec, table_precision: str, optimizer: str, window: str) -> Any:
        """A sample is a request (MLPerf's): the mean history of `window`'s requests (train; eval for
        serving) and its candidates, the preprocessor's towers as the bottom, the STU stack as the
        interaction, the head as the top; backward twice forward."""
        from dlrm_lab.model.cost import SampleCost, lookup_bytes_per_sample

        history, cands = round(spec.mean_history_of(window)), spec.data.candidates
        pre, stack, post = spec.shape.request_flops_parts(history, cands)
        whole = pre + stack + post
        bytes_read = lookup_bytes_per_sample(spec, table_precision)
        rows = sum(t.pooling_factor * len(t.feature_names) for t in spec.tables)
        return SampleCost(
            bottom_mlp_flops=pre,
            interaction_flops=stack,
            top_mlp_flops=post,
            forward_flops=whole,
            backward_flops=2 * whole,
            embedding_bytes_read=bytes_read,
            embedding_bytes_written=bytes_read,
            optimizer_state_bytes=2 * 4 * rows if optimizer == "rowwise_adagrad" else 0.0,
            embedding_rows_read=float(rows),
        )

    def communication_bytes(self, spec: HSTUSpec, global_batch: int, world_size: int,
                            sharding: dict[str, str]) -> dict[str, float]:  # fmt: skip
        """Sequence tables: every id's row goes back to the rank that asked (no pooling), by all-to-all
        whatever the sharding (TorchRec's sequence sharding has no reduce-scatter); "pooled_all_to_all" then
        holds those rows. Column-wise sends each id to every column shard."""
        from dlrm_lab.model.cost import COMM_ITEMS

        remote = (world_size - 1) / world_size
        local_batch = global_batch / world_size
        out = dict.fromkeys(COMM_ITEMS, 0.0)
        for t in spec.tables:
            ids = t.pooling_factor * len(t.feature_names)  # per request
            fan = world_size if sharding.get(t.name) == "column_wise" else 1
            out["input_dist"] += local_batch * (8 * ids + 4 * len(t.feature_names)) * remote * fan
            out["pooled_all_to_all"] += local_batch * 2 * 4 * t.embedding_dim * ids * remote  # forward and backward
        out["gradient_all_reduce"] = 2 * remote * 4 * spec.dense_parameters
        return out

    def gemm_shapes(self, spec: HSTUSpec, rows: int, max_rows: int) -> list[tuple[int, int, int]]:
        """Per token of `rows` requests: the STU projections (the bulk)."""
        tokens = max(1, min(rows * round(spec.shape.contextual_tokens + spec.mean_history + spec.data.candidates),
                            max_rows))  # fmt: skip
        s = spec.shape.stu
        return [(tokens, s.dim, s.heads * (2 * s.v_dim + 2 * s.qk_dim)), (tokens, 3 * s.heads * s.v_dim, s.dim)]

    def request_flops_curve(self, spec: HSTUSpec) -> tuple[str, tuple[Any, int, int], float]:
        """The report's FLOPs-per-request curve: its label, (shape, candidates, longest history), and the
        mean history trained on."""
        label = f"{spec.name} ({spec.shape.layers}x{spec.shape.stu.dim}, {spec.data.candidates} candidates)"
        return label, (spec.shape, spec.data.candidates, spec.data.max_history), spec.mean_history

    def sharder(self, spec: HSTUSpec) -> ModuleSharder[torch.nn.Module]:
        from dlrm_lab.distributed.wrap import SequenceSharder

        return SequenceSharder()

    def embedding_lr(self, spec: HSTUSpec, default: float) -> tuple[float, str]:
        return default, f"{default:g}: sequence features, every id keeps its own vector"

    # ----- training
    def check_training(self, spec: HSTUSpec, cfg: Any) -> None:
        if cfg.pipeline:
            raise FieldError("pipeline", f": {spec.name} (an HSTU ranker) trains unpipelined only")
        spec.check_table_precision(cfg.table_precision)
        check_ranker_fits(spec, cfg)

    def stream(self, spec: HSTUSpec, global_batch: int) -> Any:
        """`--protocol streaming`'s walk through the windows (`data.streaming.Stream`), checked."""
        from dlrm_lab.data.streaming import Stream

        return Stream(spec.data, global_batch)

    def open_stream(self, spec: HSTUSpec, batch_size: int, **how: Any) -> tuple[Any, Any]:
        """`--protocol streaming`'s sources: the windows in time order, and after each step the next window."""
        from dlrm_lab.data.sequences import SequenceGenerator
        from dlrm_lab.data.streaming import NextWindowSource, StreamSource

        requests = SequenceGenerator(spec.data, how["seed"])
        rank, world = how["rank"], how["world_size"]
        stream = self.stream(spec, batch_size * world)
        return (
            StreamSource(requests, stream, batch_size, rank, world, start_batch=how["start_batch"]),
            NextWindowSource(requests, stream, batch_size, rank, world, num_batches=how["eval_batches"]),
        )

    def check_data_options(self, spec: HSTUSpec, data: str, data_spec: str | None,
                           overrides: Sequence[str]) -> None:  # fmt: skip
        from dlrm_lab.data.sequences import with_overrides

        if data != "synthetic":
            raise FieldError("data", f"{data}: {spec.name} trains on its synthetic requests ({{data}} synthetic) "
                             "only", "data")  # fmt: skip
        if data_spec:
            raise FieldError("data_spec", f": {spec.name}'s requests are its preset's [data] table (change it "
                             "with {data_overrides})", "data_overrides")  # fmt: skip
        with_overrides(spec, tuple(overrides))  # checked here; the run applies them to its spec
        return None

    def open_sources(self, spec: HSTUSpec, data: str, batch_size: int, **how: Any) -> tuple[Any, Any]:
        """Requests in time order; held out: the later window."""
        from dlrm_lab.data.request_batches import SequenceSource
        from dlrm_lab.data.sequences import SequenceGenerator

        self.check_data_options(spec, data, how["data_spec"], how["overrides"])
        requests = SequenceGenerator(spec.data, how["seed"])
        rank, world = how["rank"], how["world_size"]
        return (
            SequenceSource(requests, batch_size, rank, world, "train", start_batch=how["start_batch"]),
            SequenceSource(requests, batch_size, rank, world, "eval", num_batches=how["eval_batches"]),
        )

    def dataset_writer(self, spec: HSTUSpec, *, rows: int, shards: int, seed: int, fmt: str,
                       data_spec: str | None, overrides: Sequence[str], window: str) -> Any:  # fmt: skip
        """`data gen`: the first `rows` requests of `window` (time-ordered) as Parquet."""
        from dlrm_lab.data.request_files import write_requests
        from dlrm_lab.data.sequences import SequenceGenerator, with_overrides
        from dlrm_lab.families.dlrm import DatasetWriter

        if fmt != "parquet":
            raise FieldError("format", f"{fmt}: HSTU requests are written as parquet only")
        _refuse_v4_layout(spec, "data gen", "the request files' columns (data.request_files)")
        if data_spec:
            raise FieldError("spec", f": {spec.name}'s requests are its preset's [data] table (see "
                             "{data_overrides})", "data_overrides")  # fmt: skip
        generator = SequenceGenerator(with_overrides(spec, tuple(overrides)).data, seed)
        total = generator.num_requests(window)
        rows = min(rows, total)

        def write(out: Any, on_progress: Any) -> None:
            write_requests(generator, out, window=window, requests=rows, shards=shards, on_progress=on_progress)

        headline = (f"{spec.name} requests ({window} window, {total:,} in all): teacher AUC "
                    f"{generator.teacher['teacher_auc']:.4f}")  # fmt: skip
        return DatasetWriter(rows=rows, unit="requests", headline=headline, write=write)

    # ----- serving
    def check_served(self, served: Served[HSTUSpec]) -> None:
        from dlrm_lab.infer.build import AUTO

        if served.build not in (AUTO, *self.builds):
            raise FieldError("build", f"{served.build}: {served.spec.name} is an HSTU preset (allowed: "
                             f"{', '.join((AUTO, *self.builds))})")  # fmt: skip
        served.spec.check_table_precision(served.table_precision)
        _refuse_v4_layout(served.spec, "infer", "the served request library (infer.requests)")
        if served.data_spec is not None:
            raise FieldError("data_spec", f"{served.data_spec}: {served.spec.name} is an HSTU preset; change its "
                             "requests with {data_overrides} KEY=VALUE", "data_overrides")  # fmt: skip
        if served.attention not in ("auto", *self.attention_paths):
            raise FieldError("attention", f"{served.attention!r}: allowed: auto, {', '.join(self.attention_paths)}")
        if served.keep_warm_ms:
            raise FieldError("keep_warm_ms", f"{served.keep_warm_ms:g}: for DLRM presets; {served.spec.name}'s "
                             "requests take too long to run idle ones")  # fmt: skip
        if served.checkpoint:
            from dlrm_lab.model.checkpoint import check_spec

            check_spec(served.checkpoint, served.spec.to_dict(), ignore=("data",))

    def serving_model(self, served: Served[HSTUSpec], seed: int, log: Any) -> tuple[Any, str | None, JsonObject | None]:
        """The ranker with its attention path (`auto`: both timed over the first requests the model will
        serve, forward only): the model, the path, and the timing's record."""
        import torch

        from dlrm_lab.infer.requests import SERVED_WINDOW
        from dlrm_lab.model.hstu import build_ranker, choose_attention

        torch.manual_seed(seed)
        choice = choose_attention(served.attention, served.spec, min(served.max_batch, ATTENTION_BATCH),
                                  torch.device("cpu"), seed, backward=False, window=SERVED_WINDOW)  # fmt: skip
        log(f"{served.name}: attention {choice.reason}")
        torch.manual_seed(seed)
        model = build_ranker(served.spec, attention=choice.path).eval()
        if served.checkpoint:
            from dlrm_lab.model.checkpoint import load_weights

            load_weights(model, served.checkpoint)
        return model, choice.path, choice.to_dict()

    def sample_library(self, served: Served[HSTUSpec], seed: int, samples: int) -> Any:
        from dlrm_lab.infer.requests import RequestLibrary

        return RequestLibrary.generate(served.spec, seed, samples)

    def library_from_arrays(self, arrays: dict[str, np.ndarray]) -> Any:
        from dlrm_lab.infer.requests import RequestLibrary

        return RequestLibrary(arrays)

    def held_out(self, served: Served[HSTUSpec], library: Any, seed: int) -> Any:
        """An untrained ranker's: the training window's first requests (the library is the evaluation
        window's); a trained one's: the evaluation window of the requests it was trained on (its seed)."""
        from dlrm_lab.data.sequences import SequenceGenerator
        from dlrm_lab.infer.accuracy import CHECK_REQUESTS

        if served.checkpoint:
            generator = SequenceGenerator(served.spec.data, seed=served.checkpoint.seed)
            return generator.requests(0, min(CHECK_REQUESTS, generator.num_requests("eval")), "eval")
        generator = SequenceGenerator(served.spec.data, seed=seed)
        return generator.requests(0, min(CHECK_REQUESTS, generator.num_requests("train")), "train")

    def check_samples(self, block: Any) -> Any:
        return block  # a RequestBlock, scored in chunks

    def score(self, module: Any, samples: Any, precision: str, autocast: bool) -> Any:
        """One score per candidate of a RequestBlock's requests, CHECK_CHUNK requests at a time."""
        import numpy as np
        import torch

        from dlrm_lab.infer.history import score_requests
        from dlrm_lab.infer.requests import RequestLibrary
        from dlrm_lab.metrics.precision import DTYPES

        requests = RequestLibrary.from_block(samples)
        parts = []
        with torch.inference_mode(), torch.autocast("cpu", dtype=DTYPES[precision], enabled=autocast):
            for start in range(0, requests.size, CHECK_CHUNK):
                block = requests.block(start, min(CHECK_CHUNK, requests.size - start))
                parts.append(torch.sigmoid(score_requests(module, block, None)[0].float()).numpy())
        return np.concatenate(parts)

    def memory(self, served: Served[HSTUSpec]) -> Any:
        """A request's history and candidates in the library (ids, actions, ages, labels; `infer.requests`),
        the activations of the largest batch (every layer's tokens at width D, its u/v/q/k, and the [H, N, N]
        attention of the padded path), and the history cache of each instance."""
        from dlrm_lab.infer.memory import INSTANCE_RUNTIME_BYTES, library_samples
        from dlrm_lab.infer.serving_parts import ModelMemory
        from dlrm_lab.model.cost import stored_table_bytes

        spec, d = served.spec, served.spec.shape.stu
        history, cands = spec.data.max_history, spec.data.candidates
        tokens = 1 + history + cands
        per_request = history * (8 + 8 + 8 + 4) + cands * (8 + 8 + 4 + 4) + 6 * 8
        projections = d.heads * (2 * d.v_dim + 2 * d.qk_dim) + 3 * d.heads * d.v_dim
        activations = 2 * 4 * served.max_batch * tokens * (d.dim * (spec.shape.layers + 1) + projections
                                                           + d.heads * tokens)  # fmt: skip
        fp32 = int(stored_table_bytes(spec, "fp32"))
        dense = 4 * spec.dense_parameters
        cache = int(served.history_cache_mb * 1e6)
        window = spec.data.active_users * (spec.data.timestamps - spec.data.train_timestamps)  # the eval window's
        samples = min(window, library_samples(served.max_batch, served.library_samples))
        return ModelMemory(
            name=served.name, fp32_tables=fp32, snapshot=fp32, library=int(per_request * samples),
            per_instance=INSTANCE_RUNTIME_BYTES + dense + activations + cache, instances=served.instances,
            device_per_instance=fp32 + dense + activations + cache,
        )  # fmt: skip

    query_counts = ("history_reused", "history_tokens_reused")  # per query, from `RequestRunner.counts`

    def count_columns(self, served: Served[HSTUSpec], counts: Any) -> dict[str, int | None]:
        """With history reuse: how many of the query's requests reused a cached history, and their tokens
        (0 for a query never served); null without reuse."""
        on = served.history_cache_mb > 0
        return {name: (int(counts[k]) if counts is not None else 0) if on else None
                for k, name in enumerate(self.query_counts)}  # fmt: skip

    def summarize_queries(
        self, records: Sequence[Mapping[str, object]], ok: np.ndarray, samples: np.ndarray
    ) -> dict[str, float | None]:
        """With history reuse: the share of completed requests that reused a cached history, and the history
        tokens not encoded again per request; null without (or for another family's rows)."""
        import numpy as np

        reused = [r.get("history_reused") for r in records]
        if not ok.any() or any(v is None for v in reused):
            return {"history_hit_rate": None, "history_tokens_reused_mean": None}
        hits = np.array(reused, dtype=np.float64)[ok].sum()
        tokens = np.array([r["history_tokens_reused"] for r in records], dtype=np.float64)[ok].sum()
        served = samples[ok].sum()
        return {"history_hit_rate": float(hits / served), "history_tokens_reused_mean": float(tokens / served)}

    def make_fused(self, model: Any, *, precision: str, table_precision: str) -> Any:
        from dlrm_lab.infer.builds.fused import fused_ranker

        return fused_ranker(model, precision=precision, table_precision=table_precision)

    def make_runner(self, model: Any, library: Any, device: Any, precision: str, history_cache_mb: float) -> Any:
        from dlrm_lab.infer.batches import RequestRunner

        return RequestRunner(model, library, device, precision, history_cache_mb)

    def id_rows(self, spec: HSTUSpec) -> list[int]:
        return []  # requests come from the server's own library: queries carry no ids


def _refuse_v4_layout(spec: HSTUSpec, command: str, where: str) -> None:
    """DLRMv4's item attributes and cross-hash ids are not in `where` yet: one line, before anything starts."""
    if spec.shape.item_tables or spec.shape.cross_tables:
        raise UserError(f"{command}: {spec.name} has item attribute and cross-hash tables, which {where} does not "
                        "carry yet (it trains: `dlrm-lab train`)")  # fmt: skip


def check_ranker_fits(spec: HSTUSpec, cfg: Any, available_bytes: int | None = None) -> None:
    """Refuse, before anything is built, a ranker whose tables (this host's share of them, with row-wise Adagrad's
    state) and dense part (with gradients and optimizer state, on each rank here) cannot fit this host's available
    memory: dlrmv4 at its published size is hundreds of GiB, and would otherwise allocate until the kernel kills
    it. Activations are not counted: this is the floor."""
    import os

    import psutil

    from dlrm_lab.model.cost import TABLE_BYTES_PER_VALUE, dense_training_bytes

    gib = 2.0**30
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    world = max(local, int(os.environ.get("WORLD_SIZE", "1") or 1))
    rows = sum(spec.shape.table_rows.values())
    values = spec.embedding_parameters * TABLE_BYTES_PER_VALUE[cfg.table_precision]
    tables = (values + rows * 4) * local / world  # the tables are sharded over ranks; one Adagrad float per row
    dense = local * dense_training_bytes(spec.shape.dense_parameters, cfg.dense_optimizer)
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if tables + dense > TRAINING_MEMORY_SHARE * available:
        share = f" (this host's {local} of {world} ranks)" if world > 1 else ""
        raise UserError(
            f"training {spec.name} needs {(tables + dense) / gib:,.1f} GiB before its activations: tables "
            f"{tables / gib:,.1f} GiB at {cfg.table_precision}{share}, dense part {dense / gib:,.2f} GiB with "
            f"gradients and {cfg.dense_optimizer} state; this machine has {available / gib:.1f} GiB available: scale "
            "the tables (--table-scale, --max-rows) or train over more hosts"
        )


_FAMILY = HSTUFamily()
FAMILY: ModelFamily[HSTUSpec] = _FAMILY  # checked against the protocol here, and its rooms' roles below
_ROLES: tuple[SampleCostParts[HSTUSpec], DataParts[HSTUSpec], TrainingChecks[HSTUSpec]] = (_FAMILY, _FAMILY, _FAMILY)
_SERVING_ROLES: tuple[StreamingParts[HSTUSpec], ServingParts[HSTUSpec]] = (_FAMILY, _FAMILY)
