"""What a person reads while and after a run trains: log lines with percent, ETA and eval loss, a
short DONE line, loss.png drawn at evals and on a stop with resumes marked, `status` pointing at
the plot and TensorBoard, `--version`, and `config fields`."""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import time

import pytest

from trainpod import cli
from trainpod.train.reporting import RunReporter, StatusWriter, hours_minutes
from trainpod.volume import Volume

from support import RUN, TINY_PRETRAIN, run_trainpod, signal_when_step_reached, start_trainpod

SHORT_RUN = ("--set", "train.max_steps=40", "--set", "train.eval_every=10", "--set", "train.log_every=5")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_dataset_volume):
    """A tiny pretrain stopped by SIGTERM after step 11, then run again to its end: (volume, facts)."""
    volume = tmp_path_factory.mktemp("progress") / "volume"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    args = ("run", "pretrain", "--config", str(TINY_PRETRAIN), *SHORT_RUN)
    first = signal_when_step_reached(start_trainpod(*args, volume=volume), volume, 11, signal.SIGTERM)
    run = volume / "runs" / RUN
    facts = {"first": first, "png_after_stop": (run / "loss.png").is_file()}
    facts["latest_after_stop"] = int((run / "checkpoints/LATEST").read_text().strip().split("-")[1])
    second = run_trainpod(*args, volume=volume)
    assert second.returncode == 0, second.stdout + second.stderr
    facts["second"] = second.stdout + second.stderr
    return volume, facts


def test_log_lines_show_percent_done_eta_and_the_last_eval_loss(resumed):
    _, facts = resumed
    line = next(line for line in facts["second"].splitlines() if "step 35/40" in line)
    assert re.search(r"step 35/40 \(87\.5%\) \| loss \d+\.\d{4} \| eval \d+\.\d{4} \|", line), line
    assert re.search(r"\| ETA (<1m|\d+m|\d+h\d\dm)$", line), line


def test_the_done_line_is_short_and_human_and_the_json_is_in_done(resumed):
    volume, facts = resumed
    line = next(line for line in facts["second"].splitlines() if "DONE:" in line)
    assert re.search(
        rf"run {RUN} DONE: step 40, loss \d\.\d{{4}} \(eval \d\.\d{{4}}\), (<1m|\d+m) this start", line
    )
    assert "{" not in line and len(line) < 300, line
    assert json.loads((volume / "runs" / RUN / "DONE").read_text())["step"] == 40


def test_a_stopped_run_has_its_loss_png_and_the_resume_is_recorded(resumed):
    volume, facts = resumed
    assert facts["png_after_stop"], "loss.png is drawn at the step-10 eval and on the stop"
    run = Volume(volume).run(RUN)
    assert json.loads((run.logs / "resumes.json").read_text()) == [facts["latest_after_stop"]]
    assert run.loss_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_png_marks_each_resume_with_a_vertical_line(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = Volume(tmp_path).run("r")
    run.logs.mkdir(parents=True)
    (run.logs / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5 - s / 10}) + "\n" for s in range(1, 31))
    )
    RunReporter(run, 30, 10, enabled=True).close()
    reporter = RunReporter(run, 30, 20, enabled=True)
    drawn = []
    original = Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda ax, x=0, *a, **k: drawn.append(x) or original(ax, x, *a, **k))
    reporter.plot_loss()
    reporter.close()
    assert drawn == [10, 20] and run.loss_plot.is_file()


def test_a_metrics_line_cut_short_by_a_full_volume_does_not_stop_the_next_start(tmp_path):
    # metrics.jsonl is appended to; an append that hit ENOSPC leaves the first bytes of its line. The next
    # start (after space was freed) failed to parse it in RunReporter(): exit 1 at every start.
    run = Volume(tmp_path).run("r")
    run.logs.mkdir(parents=True)
    lines = "".join(json.dumps({"step": s, "loss": 5 - s / 10}) + "\n" for s in range(1, 16))
    (run.logs / "metrics.jsonl").write_text(lines + '{"step": 16, "loss": 4.4')
    reporter = RunReporter(run, 30, 10, enabled=True)
    reporter.plot_loss()
    reporter.close()
    kept = (run.logs / "metrics.jsonl").read_text()
    assert kept == "".join(lines.splitlines(keepends=True)[:10]), "the steps up to the checkpoint, unchanged"
    assert run.loss_plot.is_file()


def test_a_resume_from_an_older_checkpoint_forgets_the_later_resumes(tmp_path):
    run = Volume(tmp_path).run("r")
    run.logs.mkdir(parents=True)
    (run.logs / "resumes.json").write_text("[10, 20, 30]")
    RunReporter(run, 40, 20, enabled=True).close()
    assert json.loads((run.logs / "resumes.json").read_text()) == [10, 20]


def test_status_prints_the_loss_plot_and_the_tensorboard_command(resumed, capsys, monkeypatch):
    volume, _ = resumed
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(volume))
    assert cli.main(["status", RUN, "--volume", str(volume)]) == 0
    out = capsys.readouterr().out
    assert f"loss curve  {volume / 'runs' / RUN / 'loss.png'}" in out
    assert f"tensorboard --logdir {volume / 'runs' / RUN / 'tensorboard'}" in out
    assert "step 40/40 (100%)" in out


def test_durations_read_as_hours_and_minutes():
    assert [hours_minutes(s) for s in (10, 60, 59 * 60, 3600, 3 * 3600 + 5 * 60)] == [
        "<1m",
        "1m",
        "59m",
        "1h00m",
        "3h05m",
    ]


def test_version_prints_the_package_version(capsys):
    import trainpod

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"trainpod {trainpod.__version__}"


@pytest.mark.parametrize("count", ["0", "-3"])
def test_nproc_per_node_below_one_is_refused_not_run_as_one_process(count, tmp_path, capsys):
    from trainpod import cli

    with pytest.raises(SystemExit) as caught:
        cli.main(["run", "pretrain", "--nproc-per-node", count, "--volume", str(tmp_path)])
    assert caught.value.code == 2
    assert f"argument --nproc-per-node: {count} is not 1 or more" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("workload", ["command", "datagen", "convert"])
def test_nproc_per_node_for_a_one_process_workload_is_refused_not_run_n_times(workload, tmp_path, capsys):
    """`trainpod run command --nproc-per-node 2` started two kits, each running the user's whole program with
    RANK set, on the same run's lease; a datagen or conversion, two copies of the same work."""
    from trainpod import cli

    code = cli.main(["run", workload, "--nproc-per-node", "2", "--volume", str(tmp_path)])
    assert code == 2
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert f"--nproc-per-node 2: workload {workload} does not run one process per GPU" in err
    assert ("torchrun" in err) == (workload == "command")
    assert not any(tmp_path.iterdir())


def test_config_fields_lists_every_field_with_type_default_and_description(capsys):
    from trainpod.config.finetune import FinetuneConfig

    assert cli.main(["config", "fields", "finetune"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^lora\.r\s+int >= 1\s+default 16\n    LoRA rank\.$", out, re.M)
    assert re.search(r"^base_model\.path\s+str\s+default \(required\)$", out, re.M)
    assert re.search(r"^method\s+one of: qlora, lora, full\s+default 'qlora'$", out, re.M)
    assert re.search(r"^data\.sft\.datasets\[\]\.format\s", out, re.M), "list items of a section are walked"
    paths = {line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")}
    for section in ("train", "checkpoint", "lora", "quantization", "tracking", "export"):
        model = FinetuneConfig.model_fields[section].annotation
        missing = {f"{section}.{name}" for name in model.model_fields} - paths
        assert not missing, f"fields not listed: {missing}"


def test_config_fields_of_convert_lists_each_task_kinds_own_fields(capsys):
    assert cli.main(["config", "fields", "convert"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^task\s+list\[MlxTask \| MergeTask \| ExportTask \| HubTask\]\s+default \(required\)$", out, re.M
    )
    assert re.search(
        r"^task\[kind=merge\]\.qlora_base\s+one of: dequantized, original\s+default 'dequantized'$", out, re.M
    )
    assert re.search(r"^task\[kind=export\]\.step\s+int \| one of: latest\s+default 'latest'$", out, re.M)
    assert re.search(r"^task\[kind=mlx\]\.output\s+str\s+default 'mlx'$", out, re.M)
    assert re.search(r"^task\[kind=hub\]\.private\s+bool\s+default True$", out, re.M)


@pytest.mark.parametrize("workload", sorted(cli._config_types()))
def test_config_fields_lists_every_field_of_every_section_a_config_holds(workload, capsys):
    """README: `trainpod config fields` shows every field; a section inside a list or a union is one too."""
    assert cli.main(["config", "fields", workload]) == 0
    listed = {
        line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line[0].isspace()
    }
    leaves = {re.sub(r"\[[^]]*\]", "", path).rsplit(".", 1)[-1] for path in listed}
    for model in sections_of(cli._config_types()[workload]):
        missing = set(model.model_fields) - leaves
        assert not missing, f"{workload}: {model.__name__}'s fields {sorted(missing)} are not listed"


def sections_of(model) -> list:
    """Every pydantic model a config holds, found through any nesting of its fields' types."""
    import typing

    from pydantic import BaseModel

    found, todo = [], [model]
    while todo:
        current = todo.pop()
        if isinstance(current, type) and issubclass(current, BaseModel):
            if current not in found:
                found.append(current)
                todo += [info.annotation for info in current.model_fields.values()]
        else:
            todo += list(typing.get_args(current))
    return found


def test_config_fields_of_an_unknown_workload_names_the_known_ones(capsys):
    assert cli.main(["config", "fields", "nope"]) == 2
    err = capsys.readouterr().err
    from trainpod.workloads import REGISTRY

    assert "no config type 'nope'; use one of:" in err and all(name in err for name in REGISTRY), err


def test_ls_of_a_volume_that_does_not_exist_says_so_instead_of_empty(tmp_path, monkeypatch, capsys):
    for name in ("TRAINPOD_S3_VOLUME", "TRAINPOD_VOLUME"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["ls", "--volume", str(tmp_path / "typo")]) == 2
    assert f"volume {tmp_path / 'typo'} does not exist here; pass --volume" in capsys.readouterr().out
    assert cli.main(["ls", "--volume", str(tmp_path)]) == 0
    assert "empty (no datasets, tokenizers or runs)" in capsys.readouterr().out


def test_status_away_from_the_volume_says_it_is_not_here_instead_of_no_runs(tmp_path, monkeypatch, capsys):
    """On a laptop without the S3 settings, `trainpod status` read /workspace, found nothing and said "no runs"
    (or a named run's "no status yet"), as if the run had never started."""
    for name in ("TRAINPOD_S3_VOLUME", "TRAINPOD_VOLUME", "RUNPOD_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for argv in (["status"], ["status", RUN]):
        assert cli.main([*argv, "--volume", str(tmp_path / "typo")]) == 2
        out = capsys.readouterr().out
        assert f"volume {tmp_path / 'typo'} does not exist here" in out and "--s3-volume" in out, out
    assert cli.main(["status", "--volume", str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().out


def test_status_of_a_run_name_the_volume_has_never_seen_is_exit_2_listing_the_runs_there(
    tmp_path, monkeypatch, capsys
):
    """A typo said "no status yet" and exited 0, as for a run about to start: a script polling it waited forever.
    A deployed run whose pod has not started yet has its deploy record beside the runs: still exit 0."""
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    Volume(tmp_path).run("tiny-pretrain").create()
    assert cli.main(["status", "tiny-pretrian", "--volume", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "tiny-pretrian: no run of that name on the volume" in out and "runs there: tiny-pretrain" in out, (
        out
    )
    (tmp_path / "runs/.deployed-only.DEPLOYED").write_text(
        '{"spot": true, "secrets_as_values": false, "unix": 1}'
    )
    assert cli.main(["status", "deployed-only", "--volume", str(tmp_path)]) == 0
    assert "deployed-only: no status yet" in capsys.readouterr().out


def test_status_json_is_written_off_the_training_thread_and_the_newest_is_on_disk_at_close(tmp_path):
    writer = StatusWriter(tmp_path / "status.json")
    for step in range(200):  # faster than the writes: the ones overtaken are skipped, never reordered
        writer.put({"step": step})
    writer.close()
    assert json.loads((tmp_path / "status.json").read_text()) == {"step": 199}
    with pytest.raises(RuntimeError, match="closed"):
        writer.put({"step": 200})


def test_a_status_write_that_failed_for_another_reason_than_a_full_volume_never_ends_training(
    tmp_path, caplog
):
    """status.json is advisory: a write that failed (a network volume's I/O error) was raised on the training
    thread, a crash losing the steps since the last commit. A full volume is still raised (test_disk_full)."""
    status = tmp_path / "status.json"
    status.mkdir()  # every write of it fails (IsADirectoryError), as on a volume gone bad
    writer = StatusWriter(status)
    with caplog.at_level(logging.WARNING, logger="trainpod.train.reporting"):
        for step in range(3):
            writer.put({"step": step})
            time.sleep(0.05)
        writer.close()
    assert sum("could not write" in r.message for r in caplog.records) == 1, "said once, not at every write"


def test_ls_says_what_an_sft_and_a_generated_dataset_hold(tmp_path, capsys):
    """An SFT dataset was listed as its manifest's whole counts dict ({'dropped': 0, 'longest_sample_tokens': ...}),
    a generator's as `{}` (its metadata.json has no `counts`: the records are per split)."""
    from trainpod import cli

    sft = tmp_path / "datasets/sft-tiny"
    sft.mkdir(parents=True)
    counts = {"dropped": 0, "rows": 400, "train_samples": 380, "train_tokens": 45579, "val_samples": 20}
    manifest = {"format": "trainpod-sft/1", "complete": True, "template": "alpaca", "counts": counts}
    (sft / "manifest.json").write_text(json.dumps(manifest))
    generated = tmp_path / "datasets/tiny-edits"
    generated.mkdir()
    splits = {"train": {"records": 1827}, "val": {"records": 83}, "test": {"records": 90}}
    (generated / "metadata.json").write_text(json.dumps({"format": "trainpod-generate/1", "splits": splits}))
    assert cli.main(["ls", "--volume", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "datasets/sft-tiny: trainpod-sft/1, 380 train + 20 val samples, template alpaca\n" in out, out
    assert "datasets/tiny-edits: generated records, train 1,827, val 83, test 90\n" in out, out


def test_run_on_a_volume_folder_that_is_not_there_names_the_flag_given_too(tmp_path, capsys):
    """`trainpod run datagen --volume ./demo-volume` (generator-tiny.yaml's line) before the folder exists was
    told "TRAINPOD_VOLUME=... does not exist; ... set TRAINPOD_VOLUME", a variable the user never set."""
    from trainpod import cli

    from support import CONFIGS

    missing = tmp_path / "demo-volume"
    config = str(CONFIGS / "datagen/generator-tiny.yaml")
    assert cli.main(["run", "datagen", "--config", config, "--volume", str(missing)]) == 2
    out = capsys.readouterr()
    assert f"TRAINPOD_VOLUME (or --volume) {missing} does not exist" in out.out + out.err
    assert not missing.exists()


def test_status_json_holds_the_whole_runs_mfu_over_the_time_it_is_billed_for(volume, monkeypatch):
    """`trainpod estimate` prices a run with the MFU its status.json holds. The log window's `mfu` reads low
    after a window with an eval or a commit, high in one without; `run_mfu` is the whole run's: every token
    over all the time it was billed for. The CPU has no bf16 peak, so the test gives it one (1 TFLOP/s)."""
    import trainpod.train.trainer as trainer

    monkeypatch.setattr(trainer, "peak_flops", lambda device: 1e12)
    assert cli.main(["run", "pretrain", "--config", str(TINY_PRETRAIN), "--volume", str(volume)]) == 0
    run = Volume(volume).run(RUN)
    status = json.loads(run.status.read_text())
    done = json.loads((run.root / "DONE").read_text())
    rows = [json.loads(line) for line in (run.logs / "metrics.jsonl").read_text().splitlines()]
    flops_per_token = rows[-1]["mfu"] * 1e12 / rows[-1]["tokens_per_s"]  # the run's model FLOPs per token
    expected = done["tokens_seen"] * flops_per_token / (1e12 * status["elapsed_s"])
    assert status["run_mfu"] == pytest.approx(expected, rel=1e-6)
