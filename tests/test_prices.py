"""Money: the shipped price catalogue and a user's extension, a machine's price stored with its profile,
and the cost rules, each against numbers worked by hand."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
from conftest import run_cli_in_process

from dlrm_lab.errors import UserError
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.cost import (
    COST_FIELDS,
    SERVING_COST_FIELDS,
    TRAINING_COST_FIELDS,
    Price,
    give_price,
    load_price_catalogue,
    price_of,
    serving_cost_columns,
    shipped_catalogue,
    store_price,
    stored_price,
    training_cost_columns,
)
from dlrm_lab.metrics.hardware import hardware_fingerprint
from dlrm_lab.metrics.roofline import load_profile, save_profile

AWS = "https://aws.amazon.com/ec2/pricing/on-demand/"


def entry_toml(type_: str = "my.box", **fields) -> str:
    values = {"type": type_, "provider": "mine", "region": "lab", "vcpus": 8, "memory_gib": 32,
              "price_per_hour": 1.5, "currency": "EUR", "source": "https://example.org/quote",
              "retrieved": "2026-11-01", **fields}  # fmt: skip
    lines = ["[[instance]]"]
    for k, v in values.items():
        if v is not None:
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- catalogue


def test_shipped_catalogue_lists_public_prices_with_their_source_and_date():
    catalogue = load_price_catalogue()
    wanted = {
        "c7i.large",
        "c7i.xlarge",
        "c7a.large",
        "c6a.large",
        "c7i.8xlarge",
        "m7i.xlarge",
        "p5.48xlarge",
        "g6.xlarge",
    }
    assert wanted <= set(catalogue)
    for e in catalogue.values():
        assert e.price_per_hour > 0 and e.currency == "USD" and e.source == AWS and e.retrieved
        assert (e.provider, e.region) == ("aws", "us-east-1") and e.vcpus >= 1 and e.memory_gib > 0
    assert (catalogue["p5.48xlarge"].gpus, catalogue["p5.48xlarge"].gpu) == (8, "NVIDIA H100 80GB HBM3")
    assert (catalogue["g6.xlarge"].gpus, catalogue["g6.xlarge"].gpu) == (1, "NVIDIA L4")
    assert catalogue["c7i.large"].gpus == 0 and catalogue["c7i.large"].gpu is None
    assert "Zen 3" in catalogue["c6a.large"].cpu
    assert "list prices at the date" in shipped_catalogue().read_text()  # the caveat users read first


def test_a_users_catalogue_extends_the_shipped_one_and_replaces_a_type_it_lists(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text(entry_toml("my.box", gpus=2, gpu="NVIDIA L40S") + entry_toml("c7i.large", price_per_hour=0.05))
    catalogue = load_price_catalogue(mine)
    assert catalogue["my.box"].price_per_hour == 1.5 and catalogue["my.box"].currency == "EUR"
    assert catalogue["my.box"].gpus == 2 and catalogue["my.box"].retrieved == "2026-11-01"
    assert catalogue["c7i.large"].price_per_hour == 0.05 and catalogue["c7i.large"].file == str(mine)
    assert catalogue["c7a.large"].price_per_hour == load_price_catalogue()["c7a.large"].price_per_hour


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (entry_toml(price_per_hour=0), "instance 1 (my.box): price_per_hour = 0: must be a number in (0, 1e+09]"),
        (entry_toml(price_per_hour=None), "instance 1 (my.box): price_per_hour: missing"),
        (entry_toml(currency="dollars"), "instance 1 (my.box): currency = 'dollars': must be a 3-letter"),
        (entry_toml(price_per_hr=1.0), "instance 1 (my.box): price_per_hr = 1.0: unknown field; allowed:"),
        (entry_toml(gpus=1), "instance 1 (my.box): gpus = 1: gpu (the GPU's name) is given exactly where gpus > 0"),
        (entry_toml(vcpus=1.5), "instance 1 (my.box): vcpus = 1.5: must be a whole number >= 1"),
        (entry_toml(retrieved="last week"), "instance 1 (my.box): retrieved = 'last week': must be a date"),
        (entry_toml() + entry_toml(), "instance 2 (my.box): type = 'my.box': listed twice (also instance 1 (my.box))"),
        (entry_toml(type_=None), "instance 1: type: missing"),
        ("[machine]\nprice = 1\n", "machine: unknown top-level key"),
        ("[[instance]\n", "invalid TOML"),
    ],
)
def test_a_bad_catalogue_entry_fails_with_one_line_naming_file_entry_and_field(tmp_path, text, names):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_price_catalogue(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and names in message and "\n" not in message


def test_machine_prices_lists_the_catalogue_and_a_users_entries(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text(entry_toml("my.box"))
    code, out, err = run_cli_in_process("machine", "prices", "--catalogue", str(mine))
    assert code == 0, err
    for shown in ("c7i.large", "0.08925 USD", "p5.48xlarge", "8 x NVIDIA H100", "my.box", "1.5 EUR", "8/-", AWS):
        assert shown in out, shown


# ---------------------------------------------------------------------------------- a machine's price


@pytest.fixture
def profile(tmp_path, monkeypatch) -> dict:
    """This machine's profile, stored under tmp_path: round peaks, no price yet."""
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    fid = hardware_fingerprint()["fingerprint_id"]
    peaks = {"gemm_flops_per_s": {"fp32": 1e11}, "memory_bytes_per_s": 2e10, "gather_bytes_per_s": 5e9}
    stored = {"fingerprint_id": fid, "probed_at": "2026-11-22T00:00:00+00:00", "hardware": {"cpu_model": "x"},
              "devices": {"cpu": {"threads": {"1": peaks}}}, "comms": {}}  # fmt: skip
    save_profile(stored)
    return load_profile(fid)


def test_a_price_given_once_is_stored_with_the_profile_and_survives_a_new_probe(profile):
    store_price(profile, 3.06, "usd", instance_type="m7i.xlarge", energy_per_kwh=0.12)
    again = load_profile(profile["fingerprint_id"])
    assert again["price"]["per_hour"] == 3.06 and again["devices"] == profile["devices"]
    assert stored_price(again) == Price(3.06, "USD", "given with dlrm-lab machine price", "m7i.xlarge", 0.12)

    save_profile({**profile, "probed_at": "2026-11-23T00:00:00+00:00"})  # a later probe knows nothing of prices
    assert load_profile(profile["fingerprint_id"])["price"] == again["price"]


def test_price_of_takes_the_override_then_the_stored_price_then_the_named_type(profile):
    catalogue = load_price_catalogue()
    assert price_of(profile, catalogue=catalogue) is None
    assert price_of({**profile, "instance_type": "no.such"}, catalogue=catalogue) is None
    named = price_of({**profile, "instance_type": "c7i.large"}, catalogue=catalogue)
    assert named == Price(0.08925, "USD", "catalogue: c7i.large", "c7i.large")

    priced = {**profile, "instance_type": "c7i.large", "price": {"per_hour": 2.0, "currency": "EUR",
              "source": "given with dlrm-lab machine price", "energy_per_kwh": 0.3}}  # fmt: skip
    assert price_of(priced, catalogue=catalogue) == Price(2.0, "EUR", "given with dlrm-lab machine price", None, 0.3)
    assert price_of(priced, 5.0) == Price(5.0, "EUR", "--price-per-hour", None, 0.3)
    assert price_of(priced, 5.0, "USD") == Price(5.0, "USD", "--price-per-hour")  # an EUR energy price is not USD
    assert price_of(None, 5.0) == Price(5.0, "USD", "--price-per-hour")
    with pytest.raises(UserError, match="^currency 'USD': the machine's price is in EUR"):
        price_of(priced, currency="USD")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per_hour": 0.0}, "PER_HOUR 0.0: must be a number in (0, 1e+09]"),
        ({"per_hour": -1.0}, "PER_HOUR -1.0: must be a number in (0, 1e+09]"),
        ({"per_hour": math.inf}, "PER_HOUR inf: must be a number in (0, 1e+09]"),
        ({"per_hour": math.nan}, "PER_HOUR nan: must be a number in (0, 1e+09]"),
        ({"per_hour": 1.0, "currency": "US$"}, "--currency 'US$': must be a 3-letter currency code"),
        ({"per_hour": 1.0, "currency": "EURO"}, "--currency 'EURO': must be a 3-letter currency code"),
        ({"per_hour": 1.0, "energy_per_kwh": -0.1}, "--energy-per-kwh -0.1: must be a number in [0, 1e+09]"),
        ({"per_hour": 1.0, "energy_per_kwh": 1e308}, "--energy-per-kwh 1e+308: must be a number in [0, 1e+09]"),
        ({"instance_type": "z9.huge"}, "--instance-type 'z9.huge': not in the price catalogue (known: c7i.large"),
        ({"instance_type": "c7i.large", "currency": "EUR"}, "--currency 'EUR': the catalogue's price of c7i.large"),
        ({}, "give the price per hour"),
    ],
)
def test_a_bad_price_is_refused_in_one_line_naming_the_option_and_value(profile, kwargs, message):
    from dlrm_lab.commands import flag
    from dlrm_lab.errors import FieldError

    with pytest.raises(UserError) as info:
        give_price(profile, **kwargs)
    shown = info.value.named(flag) if isinstance(info.value, FieldError) else str(info.value)  # as the CLI says it
    assert message in shown and "\n" not in shown
    assert "price" not in load_profile(profile["fingerprint_id"])  # nothing stored


def test_override_price_is_checked_like_a_given_one():
    with pytest.raises(UserError, match=r"^--price-per-hour 0: must be a number in \(0, 1e\+09\]$"):
        price_of(None, 0)
    with pytest.raises(UserError, match=r"machine profile f: price.per_hour -2: must be a number in \(0, 1e\+09\]"):
        stored_price({"fingerprint_id": "f", "price": {"per_hour": -2, "currency": "USD"}})


def test_machine_price_cli_stores_given_and_catalogue_prices_and_show_prints_them(profile):
    fid = profile["fingerprint_id"]
    code, out, err = run_cli_in_process("machine", "price", "3.06", "--currency", "EUR", "--energy-per-kwh", "0.25")
    assert code == 0, err
    assert "3.06 EUR/hour (given with dlrm-lab machine price), energy 0.25 EUR/kWh" in out
    assert stored_price(load_profile(fid)) == Price(3.06, "EUR", "given with dlrm-lab machine price", None, 0.25)

    code, out, err = run_cli_in_process("machine", "price", "--instance-type", "c7i.large")
    assert code == 0, err
    assert stored_price(load_profile(fid)) == Price(0.08925, "USD", "catalogue: c7i.large", "c7i.large")
    code, shown, err = run_cli_in_process("machine", "show", fid)
    assert code == 0, err
    assert "price: 0.08925 USD/hour (catalogue: c7i.large)" in shown

    code, _, err = run_cli_in_process("machine", "price", "0")
    assert code == 2 and err.strip() == "error: PER_HOUR 0.0: must be a number in (0, 1e+09]"
    code, _, err = run_cli_in_process("machine", "price", "1", "--fingerprint", "nosuchmachine")
    assert code == 2 and "run 'dlrm-lab machine probe' first" in err and len(err.strip().splitlines()) == 1


# -------------------------------------------------------------------------------------- cost rules

PRICE = Price(per_hour=3.6, currency="USD", source="given with dlrm-lab machine price", energy_per_kwh=0.2)


def test_serving_cost_is_the_price_of_the_seconds_a_million_samples_take():
    row = {"queries_per_s": 100.0, "samples_per_s": 2000.0, "duration_s": 10.0, "energy_j": None}
    cost = serving_cost_columns(row, PRICE)
    # 3.6 per hour = 0.001 per second; 1e6 samples take 500 s, 1e6 queries 10,000 s
    assert cost["cost_per_1m_samples"] == pytest.approx(0.5)
    assert cost["cost_per_1m_queries"] == pytest.approx(10.0)
    assert cost["energy_cost_per_1m_samples"] is None  # energy not measured: null, never 0
    assert (cost["price_per_hour"], cost["currency"], cost["cost_rate"]) == (3.6, "USD", "measured")
    assert cost["price_source"] == "given with dlrm-lab machine price"


def test_energy_is_costed_only_where_it_was_measured():
    measured = {"queries_per_s": 100.0, "samples_per_s": 2000.0, "duration_s": 10.0, "energy_j": 2000.0}
    # 2000 J over 10 s = 200 W; at 2000 samples/s 0.1 J per sample; 1e6 samples = 1e5 J = 1/36 kWh at 0.2
    assert serving_cost_columns(measured, PRICE)["energy_cost_per_1m_samples"] == pytest.approx(0.2 / 36)
    # the row's own energy per sample (a co-located point's, over all its models) is the one used
    shared = {**measured, "energy_per_sample_j": 0.05}
    assert serving_cost_columns(shared, PRICE)["energy_cost_per_1m_samples"] == pytest.approx(0.1 / 36)
    assert serving_cost_columns({**measured, "duration_s": 0.0}, PRICE)["energy_cost_per_1m_samples"] is None
    unpriced = Price(3.6, "USD", "x")
    assert serving_cost_columns(measured, unpriced)["energy_cost_per_1m_samples"] is None
    free = Price(3.6, "USD", "x", energy_per_kwh=0.0)
    assert serving_cost_columns(measured, free)["energy_cost_per_1m_samples"] == 0.0  # measured, and free


def test_co_located_models_share_the_machine():
    rows = [{"queries_per_s": 30.0, "samples_per_s": 300.0}, {"queries_per_s": 20.0, "samples_per_s": 100.0}]
    first, second = (serving_cost_columns(r, PRICE, rows) for r in rows)
    assert first["cost_per_1m_samples"] == second["cost_per_1m_samples"] == pytest.approx(0.001 / 400 * 1e6)
    assert first["cost_per_1m_queries"] == pytest.approx(0.001 / 50 * 1e6)
    alone = serving_cost_columns(rows[1], PRICE, rows[1:])
    assert alone["cost_per_1m_samples"] == pytest.approx(0.001 / 100 * 1e6)


def test_a_search_is_costed_at_its_certified_rate_else_its_best_rate_that_met_the_bound():
    search = {
        "best_qps": 200.0,
        "best_samples_per_s": 4000.0,
        "certified_qps": 180.0,
        "certified_samples_per_s": 3600.0,
    }
    certified = serving_cost_columns(search, PRICE)
    assert certified["cost_rate"] == "certified"
    assert certified["cost_per_1m_queries"] == pytest.approx(0.001 / 180 * 1e6)
    assert certified["cost_per_1m_samples"] == pytest.approx(0.001 / 3600 * 1e6)
    best = serving_cost_columns({**search, "certified_qps": None, "certified_samples_per_s": None}, PRICE)
    assert best["cost_rate"] == "best" and best["cost_per_1m_samples"] == pytest.approx(0.001 / 4000 * 1e6)
    none_held = serving_cost_columns({**search, "certified_qps": 0.0, "certified_samples_per_s": 0.0}, PRICE)
    pruned = serving_cost_columns({"best_qps": None, "best_samples_per_s": None}, PRICE)
    for row in (none_held, pruned):
        assert row["cost_rate"] is None and row["cost_per_1m_samples"] is None and row["cost_per_1m_queries"] is None


def test_training_cost_per_sample_and_to_the_target():
    row = {"samples_per_s": 50_000.0, "target_reached": True, "time_to_target_s": 1800.0, "energy_j": 9e5,
           "energy_per_sample_j": 0.004}  # fmt: skip
    cost = training_cost_columns(row, PRICE)
    assert cost["cost_per_1m_training_samples"] == pytest.approx(0.001 / 50_000 * 1e6)
    assert cost["cost_to_target"] == pytest.approx(1.8)  # half an hour at 3.6 per hour
    assert cost["energy_cost_per_1m_training_samples"] == pytest.approx(0.004 * 1e6 / 3.6e6 * 0.2)
    missed = training_cost_columns({**row, "target_reached": False}, PRICE)
    no_target = training_cost_columns({**row, "target_reached": None, "time_to_target_s": None}, PRICE)
    assert missed["cost_to_target"] is None and no_target["cost_to_target"] is None
    assert training_cost_columns({**row, "energy_j": None}, PRICE)["energy_cost_per_1m_training_samples"] is None
    two = training_cost_columns(row, PRICE, machines=2)
    assert two["price_per_hour"] == 7.2 and two["cost_to_target"] == pytest.approx(3.6)
    assert two["price_source"] == "given with dlrm-lab machine price, x 2 machines"


def test_without_a_price_every_cost_column_is_null_and_the_columns_are_the_fields():
    point = {"queries_per_s": 1.0, "samples_per_s": 1.0, "duration_s": 1.0, "energy_j": 1.0}
    assert serving_cost_columns(point, None) == dict.fromkeys(n for n, _ in SERVING_COST_FIELDS)
    assert training_cost_columns(point, None) == dict.fromkeys(n for n, _ in TRAINING_COST_FIELDS)
    for rows, fields in (([serving_cost_columns(point, PRICE)], SERVING_COST_FIELDS),
                         ([training_cost_columns(point, PRICE)], TRAINING_COST_FIELDS)):  # fmt: skip
        assert pa.Table.from_pylist(rows, schema=pa.schema(fields)).num_rows == 1
    names = [n for n, _ in COST_FIELDS]
    assert len(names) == len(set(names)) and set(names) == {n for n, _ in SERVING_COST_FIELDS + TRAINING_COST_FIELDS}
    ranked = [n for n in names if n.startswith(("cost_per", "cost_to", "energy_cost"))]
    assert all(columns.COLUMNS[n].better == columns.LOWER for n in ranked)


def test_a_damaged_stored_price_is_refused_before_a_run_starts(profile, tmp_path):
    save_profile({**profile, "price": {"per_hour": -3, "currency": "USD"}})
    for args in (
        ("infer", "run", "--model", "tiny", "--duration", "0.5"),
        ("train", "--preset", "tiny", "--steps", "1"),
    ):
        code, _, err = run_cli_in_process(*args, "--metrics-dir", str(tmp_path / "r"), "--no-progress")
        assert code == 2 and "price.per_hour -3: must be a number in (0, 1e+09]" in err, err
        assert not (tmp_path / "r").exists() or list((tmp_path / "r").iterdir()) == []  # before the run


def test_a_price_near_the_float_limit_is_refused_not_printed_as_infinite_costs():
    """`--price-per-hour 1e308` made every cost `inf` (round 4's class, issue 57): a price is bounded where it is
    given, and every cost a bounded price makes is finite."""
    from dlrm_lab.config.prices import MAX_PRICE_PER_HOUR, check_price

    with pytest.raises(UserError, match=r"^PER_HOUR 1e\+308: must be a number in \(0, 1e\+09\]"):
        check_price(1e308)
    assert math.isfinite(MAX_PRICE_PER_HOUR / 3600 / 1e-6 * 1e6)  # the dearest hour, one query an hour, per 1M
