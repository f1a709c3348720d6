"""The serving policy chosen by measurement (`infer.tune`): the max batch from a measured batch cost,
the delay and spin from probes of a fake system whose latency each setting sets."""

from __future__ import annotations

import time

import pytest

from dlrm_lab.config import load_preset
from dlrm_lab.errors import UserError
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.load import QuerySizes, Stream
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import SutDescription
from dlrm_lab.infer.tune import (
    MARGIN,
    MAX_AUTO_BATCH,
    auto_max_batch,
    choose_policy,
    parse_knob,
    spin_candidates,
)
from tests.test_infer_sut import FakeSut, small_library


def test_auto_max_batch_amortises_the_fixed_cost_within_the_bound_and_the_largest_query():
    cost = BatchCost(fixed_ms=1.0, per_sample_ms=0.01)  # fixed cost is 10% of a batch of 900
    n, why = auto_max_batch(cost, largest_piece=100, sla_ms=None)
    assert n == 960 and "10% of a batch of 900" in why  # in multiples of 64
    n, why = auto_max_batch(cost, largest_piece=100, sla_ms=10.0)  # 2.5 ms: 1 + 0.01 x 150
    assert n == 192 and "25% of the 10 ms bound at 150" in why
    n, why = auto_max_batch(cost, largest_piece=700, sla_ms=10.0)  # the largest piece is never cut further
    assert n == 704 and "largest query (700 samples)" in why
    n, why = auto_max_batch(BatchCost(0.3, 1e-5), largest_piece=1, sla_ms=None)
    assert n == MAX_AUTO_BATCH and why.startswith(f"max batch {MAX_AUTO_BATCH}: the cap")
    assert auto_max_batch(BatchCost(5.0, 0.01), largest_piece=1, sla_ms=10.0)[0] == 64  # fixed > the share: smallest


def test_knob_values_are_numbers_or_auto_and_spins_follow_the_load():
    assert parse_knob("max_batch", "auto") is None and parse_knob("spin_ms", " AUTO ") is None
    assert parse_knob("max_delay_ms", "0.5") == 0.5 and parse_knob("max_batch", 64) == 64
    with pytest.raises(UserError, match=r"--max-batch 1.5: must be a whole number or auto"):
        parse_knob("max_batch", "1.5")
    with pytest.raises(UserError, match=r"--spin-ms fast: must be a number or auto"):
        parse_knob("spin_ms", "fast")
    assert spin_candidates(qps=1000.0, instances=2) == [0.0, 1.0, 2.0]  # the mean gap between one instance's queries
    assert spin_candidates(qps=10.0, instances=1) == [0.0, 1.0, 10.0]  # capped
    assert spin_candidates(qps=0.0, instances=1) == [0.0, 1.0, 10.0]


class PolicySut(FakeSut):
    """A fake whose answers come `10 x (4 x delay + (spin ? 3 : wake)) ms` after each query: the delay costs
    (one query at a time, paid whole and then some), and a spinning instance pays 30 ms, not the wake-up.
    Steps of 20 ms and more: well above the driver's own noise on a busy machine (steps of 2 ms were not: a p99 of
    the thread's lag moved by 3 ms chose a delay of 0.5 ms over none). The times are stamps, not waits."""

    def __init__(self, served: ServedModel, wake_ms: float) -> None:
        self.wake_ms = wake_ms
        self.configured: list[dict] = []
        super().__init__(small_library(), served)

    def configure(self, model: str, **knobs) -> None:
        self.configured.append(knobs)
        for k, v in knobs.items():
            setattr(self.served, k, v)

    def service(self) -> int:
        s = self.served
        return int(10 * (4 * s.max_delay_ms + (3.0 if s.spin_ms else self.wake_ms)) * 1e6)

    def describe(self) -> SutDescription:
        return SutDescription(models={"m": self.served.description()}, batch_costs={"m": BatchCost(1.0, 0.01)})


@pytest.mark.parametrize(("wake_ms", "spins"), [(9.0, True), (1.0, False)])
def test_the_delay_and_spin_with_the_lowest_percentile_are_kept_and_recorded(wake_ms, spins):
    served = ServedModel("m", load_preset("tiny"), max_delay_ms=2.0)
    sut = PolicySut(served, wake_ms)
    try:
        stream = Stream("m", 1000.0, QuerySizes.parse("fixed:2"))
        lines = []
        t = time.monotonic()
        c = choose_policy(sut, stream, ("max_batch", "max_delay_ms", "spin_ms"), sla_ms=40.0, probe_s=0.03,
                          repeats=3, log=lines.append)  # fmt: skip
        assert time.monotonic() - t < 30
    finally:
        sut.close()
    assert c.max_batch == 960 and served.max_batch == 960  # the cost's rule (the 40 ms bound allows it)
    assert c.max_delay_ms == 0.0 and served.max_delay_ms == 0.0  # every query paid the delay whole
    delays = [p for p in c.probes if p["knob"] == "max_delay_ms"]
    assert [p["max_delay_ms"] for p in delays] == [0.0, 0.5, 1.0, 2.0]
    assert all(len(p["latency_ms"]) == 3 and p["median_ms"] == sorted(p["latency_ms"])[1] for p in c.probes)
    assert delays[0]["median_ms"] < delays[-1]["median_ms"]
    spin = [p for p in c.probes if p["knob"] == "spin_ms"]
    assert [p["spin_ms"] for p in spin] == spin_candidates(1000.0, 1)
    if spins:  # 30 ms against 90: spinning wins by far more than the margin
        assert c.spin_ms > 0 and min(p["median_ms"] for p in spin[1:]) * MARGIN <= spin[0]["median_ms"]
    else:  # spinning saves nothing: not worth its cores
        assert c.spin_ms == 0.0
    assert served.spin_ms == c.spin_ms and sut.configured[-1] == {"spin_ms": c.spin_ms}
    assert lines == [c.line] and "serving policy chosen by measurement at 1000.0 queries/s" in c.line
    record = c.to_dict()
    assert record["tuned"] == ["max_batch", "max_delay_ms", "spin_ms"] and record["margin"] == MARGIN


def test_only_the_knobs_given_as_auto_are_chosen():
    served = ServedModel("m", load_preset("tiny"), max_batch=32, max_delay_ms=1.5, spin_ms=0.5)
    sut = PolicySut(served, 9.0)
    try:
        c = choose_policy(sut, Stream("m", 500.0, QuerySizes.parse("fixed:2")), ("max_batch",), sla_ms=10.0)
    finally:
        sut.close()
    assert c.probes == [] and (c.max_delay_ms, c.spin_ms) == (1.5, 0.5) and sut.configured == [{"max_batch": 192}]
    # Offline queues its whole load: no bound for a batch to fit in, the fixed cost alone sizes it (1 ms at 3%)
    sut = PolicySut(served, 9.0)
    try:
        c = choose_policy(sut, Stream("m", 500.0, QuerySizes.parse("fixed:2")), ("max_batch",), sla_ms=10.0,
                          whole_load_queued=True)  # fmt: skip
    finally:
        sut.close()
    assert c.max_batch == 3264 and "is 3% of a batch of 3234" in c.reasons[0]
    with pytest.raises(UserError, match="auto is not allowed for threads"):
        choose_policy(sut, Stream("m", 1.0, QuerySizes.parse("fixed:2")), ("threads",), sla_ms=10.0)


def test_infer_run_options_say_which_knobs_are_auto_and_refuse_where_probes_cannot_run():
    from dlrm_lab.commands import infer_setup
    from dlrm_lab.infer.lab import InferConfig, run_inference

    served, _, cfg = infer_setup({"max-delay-ms": "auto", "spin_ms": "0.5"})
    assert cfg.tune == ("max_batch", "max_delay_ms") and served[0].spin_ms == 0.5  # max batch: auto by default
    served, _, cfg = infer_setup({"max-batch": "128", "max-delay-ms": "2"})
    assert cfg.tune == () and (served[0].max_batch, served[0].max_delay_ms) == (128, 2.0)
    with pytest.raises(UserError, match="--spin-ms auto: needs open-loop or server load"):
        infer_setup({"spin-ms": "auto", "scenario": "offline"})
    infer_setup({"scenario": "offline"})  # the max batch needs no probe
    with pytest.raises(UserError, match=r"tune 'threads': allowed: max_batch, max_delay_ms, spin_ms"):
        InferConfig(tune=("threads",))
    two = [ServedModel("a", load_preset("tiny")), ServedModel("b", load_preset("tiny"))]
    streams = [Stream(m.name, 1.0, QuerySizes.parse("fixed:1")) for m in two]
    with pytest.raises(UserError, match="max_delay_ms auto: one model"):
        run_inference(two, streams, InferConfig(tune=("max_delay_ms",)), metrics_dir="/nonexistent")


class WarmSut(PolicySut):
    """Answers `10 x (keep_warm ? 3 : wake) ms` after each query: warming batches keep the memory warm."""

    def service(self) -> int:
        return int(10 * (3.0 if self.served.keep_warm_ms else self.wake_ms) * 1e6)


# a wake cheaper than a warm batch's cost: warming must lose clearly (equal service times let noise decide)
@pytest.mark.parametrize(("wake_ms", "warms"), [(9.0, True), (1.5, False)])
def test_keep_warm_is_chosen_by_measurement_only_where_it_beats_none_by_the_margin(wake_ms, warms):
    """An idle-tail route chosen as the spin is (issue 56): none against a warming batch every 10 ms, interleaved;
    kept only where its percentile beats none by MARGIN (it costs core time), recorded with its probes."""
    from dlrm_lab.infer.tune import KEEP_WARM_PROBE_MS

    served = ServedModel("m", load_preset("tiny"))
    sut = WarmSut(served, wake_ms)
    try:
        c = choose_policy(sut, Stream("m", 1000.0, QuerySizes.parse("fixed:2")), ("keep_warm_ms",), sla_ms=200.0,
                          probe_s=0.03, repeats=3)  # fmt: skip
    finally:
        sut.close()
    probes = [p for p in c.probes if p["knob"] == "keep_warm_ms"]
    assert [p["keep_warm_ms"] for p in probes] == [0.0, KEEP_WARM_PROBE_MS]
    assert c.keep_warm_ms == (KEEP_WARM_PROBE_MS if warms else 0.0) and served.keep_warm_ms == c.keep_warm_ms
    assert sut.configured[-1] == {"keep_warm_ms": c.keep_warm_ms} and "keep-warm" in c.line
    assert c.to_dict()["keep_warm_ms"] == c.keep_warm_ms


def test_keep_warm_auto_is_refused_for_a_family_that_takes_none():
    from dlrm_lab.commands import infer_setup

    served, _, cfg = infer_setup({"keep-warm-ms": "auto"})
    assert "keep_warm_ms" in cfg.tune and served[0].keep_warm_ms == 0.0
    with pytest.raises(UserError, match="--keep-warm-ms 10: for DLRM presets"):
        infer_setup({"model": ["hstu-tiny"], "keep-warm-ms": "auto"})
