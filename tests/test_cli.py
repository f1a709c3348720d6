"""The `dlrm-lab` command as a user runs it: output, exit codes, one-line errors."""

import io
import json
import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import ENDLESS_TRAIN, ROOT, run_cli_in_process, wait_for_files

from dlrm_lab.metrics import read_manifest


def test_presets_lists_every_preset_with_sizes():
    code, stdout, stderr = run_cli_in_process("presets")
    assert code == 0, stderr
    for name in ("tiny", "kaggle", "terabyte", "dcnv2", "rm1", "rm2", "rm3"):
        assert name in stdout
    assert "89.5 GiB" in stdout  # terabyte at full size


def test_presets_show_resolves_scaling():
    code, stdout, stderr = run_cli_in_process("presets", "show", "rm1", "--table-scale", "0.001")
    assert code == 0, stderr
    assert "rm1 (table_scale=0.001): 8 tables, 32k rows" in stdout
    assert "4,000 " in stdout and "harvard-acc/DeepRecSys" not in stdout  # rows shown scaled
    spec = json.loads(run_cli_in_process("presets", "show", "kaggle", "--max-rows", "7", "--json")[1])
    assert max(t["num_embeddings"] for t in spec["tables"]) == 7


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["presets", "show", "kagle"],
            "error: unknown model preset 'kagle'; available: dcnv2, dlrmv3, dlrmv4, hstu-tiny",
        ),
        (["train", "--steps", "0"], "error: --steps 0: must be an integer >= 1"),
        (["train", "--precision", "fp8"], "error: --precision 'fp8': allowed: auto, fp32, bf16"),
        (["train", "--bogus"], "error: No such option: --bogus"),
        (["train", "--steps", "many"], "error: Invalid value for '--steps'"),
        (["train", "--preset", "tiny", "--max-rows", "0"], "max_rows = 0: must be an integer >= 1"),
        (["train", "--device", "cuda"], "error: --device cuda: no CUDA device"),
        (["runs", "list", "/nonexistent/runs"], "error: /nonexistent/runs: no such directory"),
        (["train", "--sharding", "diagonal"], "error: --sharding 'diagonal': allowed: auto, planner, table_wise"),
        (["train", "--shard", "t_cat_9=row_wise"], "error: --shard 't_cat_9=row_wise': no table 't_cat_9'"),
        (["train", "--shard", "t_cat_0=diagonal"], "sharding type 'diagonal'; allowed: table_wise"),
        (["train", "--target-auc", "1.2"], "error: --target-auc 1.2: must be in (0.5, 1)"),
        (["train", "--resume"], "error: --resume and --checkpoint-every need --checkpoint-dir"),
        (["train", "--set", "click_rate=2"], "error: --set 'click_rate=2': "),
        (["train", "--set", "click_rate"], "error: --set 'click_rate': expected KEY=VALUE"),
        (["train", "--set", "features.cat_99.ids.alpha=1.2"], "error: --set 'features.cat_99.ids.alpha=1.2': "),
        (["train", "--data-spec", "nosuch"], "error: unknown data spec 'nosuch'; available: criteo"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    if args[:3] == ["train", "--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present")
    code, _, stderr = run_cli_in_process(*args)
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr


def test_bad_preset_file_exits_2_naming_file_and_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_dense = 3\nnum_embeddings = [5]\nembedding_dim = 4\nbottom_mlp = [8, 2]\ntop_mlp = [1]\n")
    code, _, stderr = run_cli_in_process("train", "--preset", str(bad))
    assert code == 2
    assert stderr.strip() == (
        f"error: {bad}: bottom_mlp ends at 2 but embedding_dim is 4; interaction 'dot' needs them equal"
    )


def test_train_writes_a_run_that_runs_list_shows(tmp_path, monkeypatch):
    """In-process: the real process (its argv recorded as the command line) is the ctrl-c test's."""
    monkeypatch.setenv("DLRM_LAB_PROGRESS_INTERVAL_S", "0")
    code, stdout, stderr = run_cli_in_process(
        "train", "--preset", "tiny", "--steps", "12", "--batch-size", "64", "--metrics-dir", str(tmp_path)
    )
    assert code == 0, stderr
    assert "tiny: 4 tables, 380 rows, 3.58k parameters" in stderr  # size printed before building
    # stderr is not a terminal (a pipe for a user's `| tee`): plain progress lines instead of a bar (a line per
    # step at interval 0)
    progress = [line for line in stderr.splitlines() if line.startswith("train: ")]
    assert [line.split(" steps")[0] for line in progress] == [f"train: {k}/12" for k in range(1, 13)], stderr
    assert progress[-1].startswith("train: 12/12 steps (100%), ") and "elapsed " in progress[-1]
    assert " samples/s, loss " in progress[-1]
    assert "samples/s" in stdout and "held-out AUC" in stdout
    (run_dir,) = list(tmp_path.iterdir())
    assert read_manifest(run_dir)["status"] == "ok"
    assert pq.read_table(run_dir / "steps.parquet").num_rows == 12
    code, listing, _ = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0 and run_dir.name in listing and " ok " in listing


def test_ctrl_c_marks_the_run_interrupted_and_exits_130(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_lab", *ENDLESS_TRAIN, "--metrics-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as for a command a script starts in the background: SIGINT inherited as ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        # a line per step, were it not --no-progress; rows on disk within 0.2 s of training
        env={**os.environ, "DLRM_LAB_PROGRESS_INTERVAL_S": "0", "DLRM_LAB_FLUSH_SECONDS": "0.2"},
    )
    assert wait_for_files(tmp_path, "*/_parts/steps/*.parquet"), "training never flushed a step"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "tiny: 4 tables" in err and not [line for line in err.splitlines() if line.startswith("train: ")], err
    (run_dir,) = list(tmp_path.iterdir())
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "interrupted"
    assert manifest["command_line"] == ["dlrm-lab", *ENDLESS_TRAIN, "--metrics-dir", str(tmp_path)]  # as typed
    assert f"interrupted: run {run_dir} marked interrupted, its rows kept" in err.splitlines(), err
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()[0]
    assert summary["status"] == "interrupted" and summary["steps"] > 0
    assert pq.read_table(run_dir / "steps.parquet").num_rows == summary["steps"]


def test_presets_show_prints_the_analytic_cost():
    stdout = run_cli_in_process("presets", "show", "tiny")[1]
    assert "per sample: 0.00139 MFLOP forward, 0.00405 MFLOP training, 224 B of embedding rows read" in stdout


def _fake_clock(start: float = 100.0):
    """A clock for progress displays that advances only when told: (clock, advance)."""
    now = [start]

    def advance(seconds: float) -> None:
        now[0] += seconds

    return (lambda: now[0]), advance


def test_progress_prints_a_plain_line_every_interval_when_not_a_terminal(monkeypatch):
    from rich.console import Console
    from rich.progress import Progress

    from dlrm_lab.cli.format import LineProgress, progress
    from dlrm_lab.errors import UserError

    buf = io.StringIO()
    clock, tick = _fake_clock()
    bar = progress("loss {task.fields[loss]}", unit="steps", to=Console(file=buf, width=40), interval_s=5, clock=clock)
    assert isinstance(bar, LineProgress)  # a StringIO is no terminal
    with bar:
        task = bar.add_task("train", total=210, loss="")
        for step in range(210):  # 8 steps/s for 26.25 s
            tick(0.125)
            bar.update(task, advance=1, loss=f"{1 / (step + 1):.4f}")
    lines = buf.getvalue().splitlines()
    # one line each 5 s (at 40, 80, ... steps), then the final one; long lines are not wrapped
    assert [line.split(" steps")[0] for line in lines] == [f"train: {k}/210" for k in (40, 80, 120, 160, 200, 210)]
    assert lines[0] == "train: 40/210 steps (19%), 8 steps/s, elapsed 5s, left 21s, loss 0.0250"
    assert lines[-1] == "train: 210/210 steps (100%), 8 steps/s, elapsed 26s, left 0s, loss 0.0048"

    # without a total (e.g. a conversion of unknown size): a count and a rate, no percent, no time left
    buf = io.StringIO()
    bar = progress(unit="samples", to=Console(file=buf), interval_s=0, clock=clock)
    with bar:
        task = bar.add_task("convert")
        tick(2)
        bar.advance(task, 1000)
        tick(2)
        bar.advance(task, 4000)
    assert buf.getvalue().splitlines() == [
        "convert: 1,000 samples, elapsed 2s",
        "convert: 5,000 samples, 2,000 samples/s, elapsed 4s",
    ]  # the last line already shows the end: no repeat when stopped

    # a terminal gets rich's live bar; the interval comes from the environment when not given
    assert isinstance(progress(to=Console(file=io.StringIO(), force_terminal=True, force_interactive=True)), Progress)
    monkeypatch.setenv("DLRM_LAB_PROGRESS_INTERVAL_S", "0.5")
    assert progress(to=Console(file=io.StringIO())).interval_s == 0.5
    monkeypatch.setenv("DLRM_LAB_PROGRESS_INTERVAL_S", "soon")
    with pytest.raises(UserError, match="DLRM_LAB_PROGRESS_INTERVAL_S='soon': must be a number of seconds"):
        progress(to=Console(file=io.StringIO()))


def test_no_progress_prints_no_line_and_nothing_before_start():
    from rich.console import Console

    from dlrm_lab.cli.format import progress

    clock, tick = _fake_clock()
    for enabled, started in ((False, True), (True, False)):
        buf = io.StringIO()
        bar = progress("loss {task.fields[loss]}", unit="steps", to=Console(file=buf), enabled=enabled, interval_s=0,
                       clock=clock)  # fmt: skip
        task = bar.add_task("train", total=10, loss="")
        if started:
            bar.start()
        for _ in range(10):
            tick(1)
            bar.update(task, advance=1, loss="0.5")
        bar.stop()
        assert buf.getvalue() == "", (enabled, started)
