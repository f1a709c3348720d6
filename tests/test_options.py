"""Options declared once: a config's field is its command-line option, its sweep key and its check.

The Typer signatures of `train`, `infer run`, `infer search`, `serve` and `client` are generated from
the fields the configs declare (`config.options.option`); sweeps accept exactly those keys and check
them by building the same configs; the library names a bad field, the command line names its flag.
"""

import inspect
import json
import pickle
from dataclasses import dataclass

import pytest
import typer
from conftest import run_cli_in_process
from typer.testing import CliRunner

from dlrm_lab import commands
from dlrm_lab.cli import app
from dlrm_lab.config import TrainConfig
from dlrm_lab.config.options import REQUIRED, build, coerce, given, option, options_of
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.infer.options import InferConfig, ServingOptions
from dlrm_lab.infer.search_options import SearchOptions
from dlrm_lab.serve.options import ClientOptions, ServeOptions
from dlrm_lab.sweep.grid import load_spec

COMMANDS = sorted(commands.COMMANDS)


def click_command(command: str):
    cmd = typer.main.get_command(app)
    for word in command.split():
        cmd = cmd.commands[word]
    return cmd


@pytest.mark.parametrize("command", COMMANDS)
def test_every_declared_option_is_the_commands_option_with_its_flag_help_and_default(command):
    params = {p.name: p for p in click_command(command).params}
    declared = commands.COMMANDS[command]
    assert set(params) - commands.CLI_ONLY == {d.name for d in declared}  # no more, no less
    for d in declared:
        p = params[d.name]
        assert d.flag in p.opts and p.required == (d.default is REQUIRED), d.name
        assert p.default == (None if p.required else d.default), d.name
        assert p.help.replace("\\[", "[") == d.help  # shown as written (rich markup escaped)
        assert p.multiple == ("list" in str(d.type)), d.name


def test_renamed_fields_and_aliases_keep_their_flags():
    run = {p.name: p for p in click_command("infer run").params}
    assert run["model"].opts == ["--model", "-m", "--preset", "-p"]
    assert run["set"].opts == ["--set"] and run["alone"].secondary_opts == ["--no-alone"]
    assert {d.name: d.field for d in commands.INFER_RUN if d.name != d.field} == {
        "duration": "duration_s", "warmup": "warmup_s", "percentile": "sla_percentile", "alone": "compare_alone",
        "timeout": "timeout_s", "connect_timeout": "connect_timeout_s", "set": "data_overrides",
    }  # fmt: skip
    train = {p.name: p for p in click_command("train").params}
    assert train["preset"].opts == ["--preset", "-p"] and train["timeout"].opts == ["--timeout"]
    assert train["pin_cores"].secondary_opts == ["--no-pin-cores"] and train["precision"].default == "auto"
    assert TrainConfig().precision == "fp32"  # the command's default, not the library's


def test_serve_and_client_keep_their_flags_aliases_and_words():
    serve = {p.name: p for p in click_command("serve").params}
    assert serve["model"].opts == ["--model", "-m", "--preset", "-p"] and serve["grace"].opts == ["--grace"]
    assert serve["pin_cores"].secondary_opts == ["--no-pin-cores"] and serve["max_query_samples"].default == 65_536
    client = {p.name: p for p in click_command("client").params}
    assert client["target"].required and client["closed_loop"].opts == ["--closed-loop"]
    assert client["closed_loop"].secondary_opts == []  # a switch: no --no-closed-loop
    assert client["duration"].default == 10.0 and client["timeout"].help == (
        "Seconds a query may take before DEADLINE_EXCEEDED."
    )  # `infer run`'s options, in the client's own words


def test_what_the_client_passes_on_is_infer_runs_own_option():
    run = {d.name: (d.owner, d.field) for d in commands.INFER_RUN}
    passed = [d for d in commands.CLIENT if d.owner is not ClientOptions]
    assert passed and all(run[d.name] == (d.owner, d.field) for d in passed)


def test_serve_builds_its_models_and_front_from_the_declared_options():
    served, front = commands.serve_setup({"model": ["tiny"], "instances": 2, "max_query_samples": 128, "grace": 1.5})
    assert (served[0].name, served[0].instances, served[0].max_query_samples) == ("tiny", 2, 128)
    assert front == ServeOptions(grace_s=1.5)
    with pytest.raises(UserError, match=r"^--max-query-samples 0: must be a whole number >= 1$"):
        commands.serve_setup({"max_query_samples": 0})


def test_a_field_has_one_flag_in_every_config_that_declares_it():
    seen: dict[str, str] = {}
    for config in (TrainConfig, InferConfig, ServingOptions, SearchOptions, *commands._CONFIGS):
        for d in options_of(config):
            assert seen.setdefault(d.field, d.flag) == d.flag, d.field
    assert not set(commands._UNDECLARED) & set(seen)  # a command not declared yet reuses no field's name
    assert commands.flag("timeout_s") == "--timeout" and commands.flag("calibrate_s") == "calibrate_s"
    assert commands.flag("grace_s") == "--grace" and commands.flag("metrics_dir") == "--metrics-dir"


@pytest.mark.parametrize("command", ["train", "infer run"])
def test_every_declared_option_is_a_sweep_key(tmp_path, command):
    """Each option, at its command's default, in a grid file: accepted, checked by the setup that runs it."""
    lines = [f'command = "{command}"', "[options]"]
    for d in commands.COMMANDS[command]:
        if d.default is not None:
            lines.append(f"{d.name.replace('_', '-')} = {_toml(d.default)}")
    path = tmp_path / "grid.toml"
    path.write_text("\n".join(lines))
    spec = load_spec(path)
    assert len(spec.options) == sum(d.default is not None for d in commands.COMMANDS[command])


def _toml(value):
    return ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')


def test_an_unknown_sweep_key_names_the_allowed_ones(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('command = "train"\n[grid]\nbatchsize = [1]')
    with pytest.raises(UserError) as err:
        load_spec(path)
    allowed = ", ".join(sorted(d.flag for d in commands.TRAIN))
    assert f"unknown option --batchsize; allowed: {allowed}" in str(err.value)
    assert "--set" in allowed and "--timeout" in allowed and "--timeout-s" not in allowed


def test_a_bad_value_names_the_field_in_the_library_and_the_flag_on_the_command_line(tmp_path):
    with pytest.raises(FieldError) as err:
        TrainConfig(timeout_s=-1.0)
    assert err.value.field == "timeout_s" and str(err.value) == "timeout_s -1.0: must be a number of seconds > 0"
    with pytest.raises(UserError, match=r"^--timeout -1.0: must be a number of seconds > 0$"):
        commands.train_setup({"timeout": -1.0})  # the setups take options by name: they speak flags
    code, _, stderr = run_cli_in_process("train", "--timeout", "-1", "--metrics-dir", str(tmp_path))
    assert code == 2 and stderr == "error: --timeout -1.0: must be a number of seconds > 0\n"
    code, _, stderr = run_cli_in_process("infer", "run", "--duration", "0", "--metrics-dir", str(tmp_path))
    assert code == 2 and stderr == "error: --duration 0.0: must be > 0 seconds\n"
    path = tmp_path / "grid.toml"
    path.write_text('command = "infer run"\n[grid]\npercentile = [101]')
    with pytest.raises(UserError, match=r"point 0 \(percentile=101\): --percentile 101.0: must be in \(0, 100\]"):
        load_spec(path)


def test_a_message_naming_several_fields_names_each_by_its_flag():
    with pytest.raises(FieldError) as err:
        TrainConfig(resume=True)
    assert str(err.value) == "resume and checkpoint_every need checkpoint_dir"
    assert err.value.named(commands.flag) == "--resume and --checkpoint-every need --checkpoint-dir"
    with pytest.raises(FieldError) as err:
        SearchOptions(capacity_s=0)
    assert err.value.named(commands.flag) == "--capacity-duration 0, --max-probe-duration 20.0: must be > 0"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--port", "70000"], "--port 70000: must be in [0, 65535] (0: any free port)"),
        (["data", "gen", "--rows", "0"], "--rows 0: must be an integer >= 1"),
        (
            ["data", "gen", "-p", "kaggle", "--format", "criteo-tsv", "--shards", "2"],
            "--shards: criteo-tsv writes one file",
        ),
        (["launch", "--nproc", "0", "--", "train"], "--nproc 0: must be an integer >= 1"),
        (["scale", "--mode", "diagonal"], "--mode 'diagonal': allowed: weak, strong"),
    ],
)
def test_a_library_error_names_its_flag_where_the_command_is_not_declared_yet(tmp_path, args, message):
    """The library raises by field (`port`, `rows`, ...); the command line says the flag the user typed."""
    out = ["--out", str(tmp_path / "d")] if args[:2] == ["data", "gen"] else ["--metrics-dir", str(tmp_path)]
    code, _, stderr = run_cli_in_process(*args, *(out if args[0] != "launch" else []))
    assert code == 2 and stderr == f"error: {message}\n"


def test_a_field_error_crosses_a_process_boundary_whole():
    """A rank's or an instance's error is pickled: it arrives with its fields, to be named by flag there."""
    sent = FieldError("resume", ": the checkpoint is at step 5; {steps} 3 leaves nothing to do", "steps")
    got = pickle.loads(pickle.dumps(sent))
    assert isinstance(got, FieldError) and (got.field, got.fields) == ("resume", ("resume", "steps"))
    assert got.named(commands.flag) == "--resume: the checkpoint is at step 5; --steps 3 leaves nothing to do"


def test_inside_the_command_line_a_field_error_says_the_flag_from_the_moment_it_is_raised(tmp_path):
    """A FieldError raised under the CLI (`fields_named_by`) carries the flag in its text, so a run's manifest records
    what stderr says; outside it the library's field names stay; a run's recorded error says the flag."""
    from dlrm_lab.errors import fields_named_by
    from dlrm_lab.metrics.run import Run

    with fields_named_by(commands.flag):
        inside = FieldError("batch_size", "0: must be an integer >= 1")
    assert str(inside) == "--batch-size 0: must be an integer >= 1"
    assert str(FieldError("batch_size", "0: must be an integer >= 1")) == "batch_size 0: must be an integer >= 1"
    with fields_named_by(commands.flag), pytest.raises(FieldError):
        with Run.create(tmp_path, "train", {}) as run:
            raise FieldError("resume", ": the checkpoint is at step 5; {steps} 3 leaves nothing to do", "steps")
    error = json.loads((run.dir / "manifest.json").read_text())["error"]
    assert "--resume: the checkpoint is at step 5; --steps 3 leaves nothing to do" in error


def test_one_declaration_makes_the_option_the_coercion_and_the_config():
    """The mechanism on a config of its own: nothing else names `rate_hz` or its flag."""
    from dlrm_lab.cli.options import command

    @dataclass(frozen=True)
    class Probe:
        rate_hz: float = option(2.0, "Samples per second.", flags=("--rate",))
        names: tuple[str, ...] = option((), "Repeatable.", type=list[str] | None, cli_default=None)

        def __post_init__(self):
            if not self.rate_hz > 0:
                raise FieldError("rate_hz", f"{self.rate_hz}: must be > 0")

    declared = options_of(Probe)
    values = given({"rate": "4", "names": "a"}, declared, "probe")
    assert values == {"rate": 4.0, "names": ["a"]} and build(Probe, declared, values) == Probe(4.0, ("a",))
    with pytest.raises(FieldError, match="rate_hz 'x': must be a number"):
        coerce(declared[0], "x")
    seen = {}
    probe_app = typer.Typer()
    probe_app.command("probe")(command(*declared)(lambda options: seen.update(options)))
    probe_app.command("other")(lambda: None)
    result = CliRunner().invoke(probe_app, ["probe", "--rate", "3", "--names", "x"])
    assert result.exit_code == 0, result.output
    assert seen == {"rate": 3.0, "names": ["x"]}


def test_the_library_parser_knows_the_command_lines_own_words():
    from dlrm_lab import commands
    from dlrm_lab.cli.train import train_command

    assert {d.name for d in commands._CLI_WORDS} == commands.CLI_ONLY
    typer_params = set(inspect.signature(train_command).parameters)
    assert typer_params == {d.name for d in [*commands.TRAIN, *commands._CLI_WORDS]}  # the same words, both parsers


def test_scale_passes_its_train_options_through_trains_own_declarations():
    """The library parses train's words from train's declarations (a TorchX component checks them too, and the
    library stands below the command line)."""
    from dlrm_lab.commands import train_words

    words = ["-p", "kaggle", "--steps=12", "--no-pin-cores", "--set", "a=1", "--set", "b=2", "--prefetch", "0"]
    assert train_words(words) == {"preset": "kaggle", "steps": 12, "pin-cores": False, "set": ["a=1", "b=2"],
                                  "prefetch": "0"}  # fmt: skip
    for bad, said in ((["--stepz", "3"], "unrecognized arguments: --stepz 3"), (["--steps", "x"], "--steps 'x'"),
                      (["--steps"], "argument --steps: expected one argument")):  # fmt: skip
        code, _, stderr = run_cli_in_process("scale", "--ranks", "1", "--", *bad)
        assert code != 0 and said in stderr and "Traceback" not in stderr, stderr


def test_help_shows_declared_text_as_written():
    """`[data]` and `[/MODEL]` are text, not rich markup (`[/MODEL]` made `infer run --help` fail)."""
    code, stdout, _ = run_cli_in_process("infer", "run", "--help")
    text = "".join(stdout.replace("│", "").split())  # the table's wrapping and borders aside
    assert code == 0 and "preset's[data](itsrequests)" in text  # a narrow terminal may cut the URL short
