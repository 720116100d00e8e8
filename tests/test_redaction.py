"""Secrets never reach a log line, whichever library prints them."""

from __future__ import annotations

import logging
import os
import sys
import time

from trainpod.log import is_secret_name, redact, setup_logging
from trainpod.program import Program


def test_secret_values_from_the_environment_are_masked(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    text = redact("token hf_abcdefghijklmnop and key 0123456789abcdef")
    assert "hf_abcdefghijklmnop" not in text and "0123456789abcdef" not in text
    assert text.count("***") == 2


def test_a_secret_pasted_with_a_line_end_is_masked_as_the_libraries_use_it(monkeypatch):
    """A token pasted into RunPod's secrets with its line end: huggingface_hub strips it before use, so what it
    (or a program) prints is the bare token, which masking the value as set never matched."""
    monkeypatch.setenv("HF_TOKEN", "hf_pastedtokenvalue\n")
    monkeypatch.setenv("WANDB_API_KEY", "  0123456789abcdef\r\n")
    text = redact("Authorization: Bearer hf_pastedtokenvalue; wandb key 0123456789abcdef.")
    assert text == "Authorization: Bearer ***; wandb key ***.", text


def test_credentials_in_urls_are_masked_even_when_not_in_the_environment():
    assert (
        redact("cloning https://user:ghp_zzz@github.com/org/repo.git")
        == "cloning https://***@github.com/org/repo.git"
    )


def test_credentials_in_urls_of_any_scheme_are_masked():
    """A program's database, cache or queue URL (MLflow's postgresql://, redis://:password@) carries its
    password as a https URL does; only http(s) URLs were masked."""
    lines = {
        "tracking at postgresql://mlflow:pg-pass-123456@db:5432/mlflow": "postgresql://***@db:5432/mlflow",
        "cache redis://:redis-pass-123456@cache:6379/0": "redis://***@cache:6379/0",
        "mongodb+srv://me:mongo-pass-123456@c0.mongodb.net/db": "mongodb+srv://***@c0.mongodb.net/db",
    }
    for line, masked in lines.items():
        assert masked in redact(line) and "pass-123456" not in redact(line), redact(line)
    plain = "see http://host/a@b, file:///tmp/x@y and me@example.com"
    assert redact(plain) == plain


def test_log_handlers_mask_secrets(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RUNPOD_API_KEY", "fake-runpod-secret-for-tests")
    setup_logging(tmp_path / "run.log")
    logging.getLogger("anything").info("request failed with key fake-runpod-secret-for-tests")
    for handler in logging.getLogger().handlers:
        handler.flush()
    assert "fake-runpod-secret-for-tests" not in capsys.readouterr().out
    assert "fake-runpod-secret-for-tests" not in (tmp_path / "run.log").read_text()
    assert "***" in (tmp_path / "run.log").read_text()


def test_a_crash_message_holding_a_secret_is_masked_in_status_json(monkeypatch, tmp_path, capsys):
    """status.json lives on the volume: the reason it keeps is masked like a log line."""
    from trainpod.volume import Volume
    from trainpod.workloads import command
    from trainpod.workloads.lifecycle import RunRequest, execute

    monkeypatch.setenv("HF_TOKEN", "hf_status_secret_123456")

    def crash(ctx, config):
        raise OSError("401 for https://user:ghp_urlsecret987@huggingface.co/x with hf_status_secret_123456")

    monkeypatch.setattr(command, "run", crash)
    config = tmp_path / "command.yaml"
    config.write_text("name: leaky\ncommand: [python, -c, pass]\n")
    assert execute(RunRequest("command", str(config), volume=Volume(tmp_path))) == 1
    status = (tmp_path / "runs/leaky/status.json").read_text()
    assert "crash: OSError: 401 for https://***@huggingface.co/x" in status, status
    out = capsys.readouterr().out
    for secret in ("hf_status_secret_123456", "ghp_urlsecret987"):
        assert secret not in status and secret not in out


def test_any_variable_named_like_a_secret_is_masked(monkeypatch):
    """A deploy config's `secrets:` may name any variable; the pod masks what is named like one."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-abcdef123456")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "svc-token-7890abc")
    monkeypatch.setenv("DB_PASSWORD", "hunter2hunter2")
    monkeypatch.setenv("S3_SECRET", "s3-secret-value-42")
    monkeypatch.setenv("PUBLIC_KEY", "ssh-ed25519 AAAAC3Nzapublic you@laptop")
    text = redact("sk-proj-abcdef123456 svc-token-7890abc hunter2hunter2 s3-secret-value-42 AAAAC3Nzapublic")
    assert text == "*** *** *** *** AAAAC3Nzapublic"


def env_extra_problems(extra: dict[str, str]) -> list[str]:
    """What deploy's config check says about env.extra, in a deploy config that is otherwise fine."""
    from trainpod.config.deploy import DeployConfig
    from trainpod.deploy_checks import config_problems

    config = DeployConfig.model_validate(
        {
            "run": "r",
            "workload": "pretrain",
            "config": "configs/pretrain/tiny.yaml",
            "image": {"name": "ghcr.io/org/trainpod:0.1.0"},
            "pod": {"gpu_types": ["NVIDIA H100 80GB HBM3"]},
            "volume": {"name": "vol", "data_center": "EU-RO-1"},
            "env": {"extra": extra},
        }
    )
    return [p for p in config_problems(config, "configs/deploy/x.yaml", False) if "env.extra" in p]


def test_one_rule_says_which_variable_names_hold_secrets_for_the_logs_and_for_deploy():
    secrets = ["HF_TOKEN", "DB_KEY", "OPENAI_API_KEY", "PASSWORD", "my_secret", "RUNPOD_SECRET_X", "TOKEN"]
    plain = ["TOKENIZERS_PARALLELISM", "PUBLIC_KEY", "SSH_PUBLIC_KEY", "KEYBOARD", "SORT_KEYS", "MONKEY"]
    assert [n for n in secrets if not is_secret_name(n)] == []
    assert [n for n in plain if is_secret_name(n)] == []
    problems = env_extra_problems({"TOKENIZERS_PARALLELISM": "false", "DB_KEY": "hunter2-long"})
    assert len(problems) == 1 and problems[0].startswith("env.extra.DB_KEY holds a value")


def test_a_url_with_credentials_in_env_extra_is_refused_masked_whatever_its_name():
    """MLFLOW_TRACKING_URI=https://user:password@host went to the pod as plain env (RunPod's console and API
    show it), though deploy_checks promised env.extra holds no value that looks like a secret."""
    extra = {
        "MLFLOW_TRACKING_URI": "https://mlflow-user:s3cretpassw0rd@mlflow.example.com",
        "DATABASE_URL": "postgresql://app:dbpassw0rd@db.example.com:5432/runs",
        "PLAIN_URL": "https://mlflow.example.com/api",  # no credentials: fine
        "AS_REFERENCE": "{{ RUNPOD_SECRET_AS_REFERENCE }}",
        "PATH_LIKE": "/workspace/data@v2",
    }
    problems = env_extra_problems(extra)
    assert [p.split("=", 1)[0] for p in problems] == [
        "env.extra.MLFLOW_TRACKING_URI",
        "env.extra.DATABASE_URL",
    ]
    assert all("holds credentials" in p and "RUNPOD_SECRET_" in p for p in problems)
    assert not any("s3cretpassw0rd" in p or "dbpassw0rd" in p for p in problems), problems


def test_a_line_with_a_long_word_is_masked_at_once_with_the_url_credentials_after_it():
    """The URL pattern tried a scheme at every letter of a word and read to its end each time: a run of 100 kB
    without a space (a DNA sample, a base64 image in a JSON log) took 25 s with the GIL held."""
    word = "ACGT" * 10_000
    started = time.monotonic()
    text = redact(f"sample {word} from https://user:db-pass-123456@db/x and {word}://a:b@c")
    assert time.monotonic() - started < 2, "masking is linear in the line's length"
    assert text == f"sample {word} from https://***@db/x and {word}://***@c"


def test_a_programs_line_of_a_hundred_kb_without_an_end_never_blocks_it(tmp_path):
    """Its output is read (and masked) as it comes: the program printing such a line waited at its next write,
    a minute and more, on a pod billed meanwhile."""
    printing = (
        "import sys\nfor _ in range(50): sys.stdout.write('x' * 2000); sys.stdout.flush()\nprint('end')"
    )
    program = Program([sys.executable, "-c", printing], tmp_path, dict(os.environ), tmp_path / "program.log")
    started = time.monotonic()
    program.start()
    while program.poll() is None and time.monotonic() - started < 30:
        time.sleep(0.05)
    program.wait_for_output(5)
    program.sweep()
    assert time.monotonic() - started < 10, "the program and its output are done in well under a second"
    assert program.poll() == 0
    assert ("x" * 100_000 + "end\n") in (tmp_path / "program.log").read_text()


def test_a_secret_on_the_programs_command_line_is_masked_in_its_started_line(monkeypatch, tmp_path):
    """program.log's first line, `--- started [argv]`, was written as it was: a token passed as an argument
    (`--hub-token $HF_TOKEN`, expanded by a wrapper or the config) or a git URL's password reached the volume."""
    monkeypatch.setenv("HF_TOKEN", "secret-on-the-command-line")
    argv = [
        sys.executable,
        "-c",
        "pass",
        "--hub-token",
        "secret-on-the-command-line",
        "https://me:gitpass9876@host/r",
    ]
    program = Program(argv, tmp_path, dict(os.environ), tmp_path / "program.log")
    program.start()
    started = time.monotonic()
    while program.poll() is None and time.monotonic() - started < 30:
        time.sleep(0.05)
    program.wait_for_output(5)
    program.sweep()
    logged = (tmp_path / "program.log").read_text()
    assert logged.startswith("--- started ") and "'--hub-token', '***', 'https://***@host/r'" in logged, (
        logged
    )
    assert "secret-on-the-command-line" not in logged and "gitpass9876" not in logged
