"""The convert workload's hub task: an export folder pushed to a fake Hugging Face Hub on 127.0.0.1
(tests/fake_hub.py). A push and the preflight run as `trainpod run convert` runs on a pod; the rest call
run_convert here, with huggingface_hub pointed at the fake as HF_ENDPOINT would (a subprocess is 6 s)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import save as save_tensors

from trainpod.config.convert import ConvertConfig
from trainpod.config.loader import validate_tree
from trainpod.convert import output, run_convert
from trainpod.errors import ConfigError, ExitCode, InputError, TemporaryError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from fake_hub import FakeHub, running_hub
from support import run_trainpod, tree_snapshot

RUN = "ft"
WRITE_TOKEN = "fake-write-token-for-the-fake-hub"
READ_TOKEN = "fake-read-token-for-the-fake-hub"
REPO = "someone/tiny-ft"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with running_hub({WRITE_TOKEN: "write", READ_TOKEN: "read"}) as fake:
        yield fake


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    return tmp_path / "volume"


def export_folder(volume: Path, weights: bytes = b"\x01\x02" * 64, name: str = "merged") -> Path:
    """runs/ft/export/<name>/ as a conversion publishes it (manifest.json and all), without a merge to run."""
    import torch

    def write(staging: output.Staging) -> None:
        staging.folder.mkdir(parents=True)
        tensor = torch.frombuffer(bytearray(weights), dtype=torch.uint8)
        staging.write_file("model.safetensors", save_tensors({"w": tensor}))
        staging.write_file("config.json", b'{"model_type": "llama"}\n')

    target = volume / "runs" / RUN / "export" / name
    output.produce(target, {}, {"weights": weights.hex()}, write)
    return target


def hub_task(**task) -> dict:
    return {"kind": "hub", "source": "merged", "repo_id": REPO} | task


@pytest.fixture
def at_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch):
    """huggingface_hub in this process set up as HF_ENDPOINT=<the fake> and HF_HUB_DISABLE_XET=1 set it up
    at its import (they are read then), with HF_TOKEN set to `token`."""
    from huggingface_hub import constants

    def point(endpoint: str = hub.url, token: str = WRITE_TOKEN) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", token)

    point()
    return point


def push_here(volume: Path, **task) -> list[Path]:
    return run_convert(
        validate_tree(ConvertConfig, {"name": RUN, "task": [hub_task(**task)]}),
        Volume(volume),
        PreemptionWatch(),
    )


def push(volume: Path, hub: FakeHub, token: str | None = WRITE_TOKEN, **task):
    config = volume.parent / "hub.yaml"
    config.write_text(json.dumps({"name": RUN, "task": [hub_task(**task)]}))
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["HF_TOKEN"] = token or ""
    env["HF_HOME"] = str(volume.parent / "hf-home")  # no token of this machine's user
    return run_trainpod("run", "convert", "--config", str(config), volume=volume, env=env, timeout=120)


def pushed_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"}


def record_path(volume: Path, revision: str = "main") -> Path:
    return volume / "runs" / RUN / "hub" / f"someone--tiny-ft@{revision}.json"


def test_a_push_lands_the_folder_byte_identical_in_one_private_commit_and_records_it(
    volume: Path, hub: FakeHub
) -> None:
    folder = export_folder(volume)
    result = push(volume, hub)
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, out
    repo = hub.repos[REPO]
    assert repo.private, "a repo the push creates must be private unless the task says otherwise"
    files = repo.tree("main")
    assert {k: v for k, v in files.items() if k != ".gitattributes"} == pushed_files(folder)
    assert len(repo.history("main")) == 2, "the push must be one commit after the repo's first"
    assert hub.lfs_puts() == 1, "the safetensors file goes up by LFS, the config.json in the commit"
    record = json.loads(record_path(volume).read_text())
    assert record["commit"] == repo.branches["main"] and record["repo_id"] == REPO
    assert record["revision"] == "main" and record["source"] == "merged"
    assert "pushed merged to someone/tiny-ft" in result.stdout, (
        "the log (a pod's boot.log) says what went where"
    )
    assert WRITE_TOKEN not in out and WRITE_TOKEN not in record_path(volume).read_text()


def test_a_rerun_pushes_nothing_and_a_changed_source_pushes_a_new_commit(
    volume: Path, hub: FakeHub, at_hub, caplog: pytest.LogCaptureFixture
) -> None:
    export_folder(volume)
    [record] = push_here(volume)
    head = hub.repos[REPO].branches["main"]
    before = tree_snapshot(record.parent)

    caplog.set_level("INFO")
    assert push_here(volume) == [record]
    assert hub.repos[REPO].branches["main"] == head, "a rerun with the same source made a new commit"
    assert tree_snapshot(record.parent) == before
    assert "on the Hub already" in caplog.text and "skipping" in caplog.text

    folder = export_folder(volume, weights=b"\x03\x04" * 64)
    push_here(volume)
    repo = hub.repos[REPO]
    assert len(repo.history("main")) == 3, "a source made again must be pushed in one new commit"
    assert repo.tree("main")["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert json.loads(record.read_text())["commit"] == repo.branches["main"]


def test_status_says_where_on_the_hub_the_run_was_pushed(
    volume: Path, hub: FakeHub, at_hub, capsys: pytest.CaptureFixture
) -> None:
    from trainpod import cli

    export_folder(volume)
    push_here(volume, revision="exp")
    commit = hub.repos[REPO].branches["exp"]
    capsys.readouterr()
    assert cli.main(["status", RUN, "--volume", str(volume)]) == 0
    shown = capsys.readouterr().out
    assert f"on the hub  {REPO}@exp: merged, commit {commit[:12]} ({hub.url}/{REPO})" in shown, shown


def test_a_missing_branch_is_made_and_a_public_repo_is_made_public(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    folder = export_folder(volume)
    push_here(volume, revision="exp/lr-3e-4", private=False)
    repo = hub.repos[REPO]
    assert not repo.private
    assert repo.tree("exp/lr-3e-4")["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert "model.safetensors" not in repo.tree("main"), "the push went to main, not its branch"
    assert record_path(volume, "exp%2Flr-3e-4").is_file()


def test_a_missing_hf_token_is_exit_2_before_anything_is_written(volume: Path, hub: FakeHub) -> None:
    export_folder(volume)
    before = tree_snapshot(volume)
    result = push(volume, hub, token=None)
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.BAD_INPUT, out
    assert "HF_TOKEN is not set" in out and "write access to someone/tiny-ft" in out
    assert hub.requests == [], "the Hub was asked before the token was checked"
    assert tree_snapshot(volume) == before, "the preflight wrote to the volume (a lease, a run folder)"


def test_huggingface_hubs_offline_mode_is_exit_2_naming_it_before_any_request(
    volume: Path, hub: FakeHub, at_hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE=1 (set for reading a hub base from the volume) blocks every request huggingface_hub makes,
    with an OfflineModeIsEnabled, a ConnectionError: the push was exit 75 at every start until the run FAILED."""
    from huggingface_hub import constants

    export_folder(volume)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at its import
    with pytest.raises(InputError, match=r"HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) is set") as refused:
        push_here(volume)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    assert hub.requests == [] and not record_path(volume).exists()


@pytest.mark.parametrize(
    "token", [READ_TOKEN, "fake-token-the-fake-hub-does-not-know"], ids=["read-only", "unknown"]
)
def test_a_token_the_hub_refuses_is_exit_2_naming_hf_token_and_never_shown(
    volume: Path, hub: FakeHub, at_hub, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    export_folder(volume)
    at_hub(token=token)
    with pytest.raises(InputError) as refused:
        push_here(volume)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    assert "refused HF_TOKEN" in str(refused.value) and "write access to someone/tiny-ft" in str(
        refused.value
    )
    assert token not in str(refused.value) and token not in caplog.text
    assert not record_path(volume).exists() and REPO not in hub.repos


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("failure", [503, 429, "drop", "refused"])
def test_a_hub_that_fails_or_cannot_be_reached_is_exit_75_with_no_record(
    volume: Path, hub: FakeHub, at_hub, failure: int | str
) -> None:
    export_folder(volume)
    if failure == "refused":
        at_hub(endpoint=closed_port())
    else:
        hub.fail["/api/repos/create"] = failure
    with pytest.raises(TemporaryError) as failed:
        push_here(volume)
    assert failed.value.exit_code == ExitCode.TEMPORARY
    assert "the next start pushes again" in str(failed.value)
    assert not record_path(volume).exists()


def test_an_upload_the_storage_refuses_is_exit_75_not_a_refused_token(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    """An LFS object goes to a presigned link on the storage's host (S3 for the real Hub); its 403 (a link that
    expired during a slow upload) was said to be HF_TOKEN's, exit 2: the pod stopped, told to fix a good token."""
    folder = export_folder(volume)
    hub.fail["/lfs-objects/"] = 403
    with pytest.raises(TemporaryError, match="the Hub's storage refused an upload") as failed:
        push_here(volume)
    assert "HF_TOKEN" not in str(failed.value) and not record_path(volume).exists()
    del hub.fail["/lfs-objects/"]
    push_here(volume)  # the next start, with new links
    assert hub.repos[REPO].tree("main")["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_a_push_that_failed_after_its_upload_is_made_whole_at_the_next_start_without_uploading_again(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    folder = export_folder(volume)
    hub.fail["/commit/"] = 503  # the LFS object is up, the commit that would show it refused
    with pytest.raises(TemporaryError):
        push_here(volume)
    assert not record_path(volume).exists()
    assert "model.safetensors" not in hub.repos[REPO].tree("main"), "the Hub shows half a push"
    uploads = hub.lfs_puts()

    hub.fail.clear()
    push_here(volume)
    assert hub.lfs_puts() == uploads, "an object the Hub holds already was uploaded again"
    assert hub.repos[REPO].tree("main")["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert len(hub.repos[REPO].history("main")) == 2 and record_path(volume).is_file()


def test_a_source_changed_after_its_manifest_is_exit_2_and_nothing_is_pushed(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    folder = export_folder(volume)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\xff")  # same size, other bytes
    with pytest.raises(InputError) as torn:
        push_here(volume)
    assert f"{folder} does not match its manifest.json" in str(torn.value)
    assert "model.safetensors" in str(torn.value) and "kind: merge" in str(torn.value)
    assert hub.requests == [] and not record_path(volume).exists()


def test_a_file_added_after_the_manifest_is_exit_2_and_nothing_is_pushed(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    folder = export_folder(volume)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="notes.txt is not in it"):
        push_here(volume)
    assert hub.requests == []


def test_a_source_no_task_made_is_exit_2_naming_the_folder_and_the_task_that_makes_it(
    volume: Path, hub: FakeHub, at_hub
) -> None:
    folder = volume / "runs" / RUN / "export" / "merged"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(InputError) as missing:
        push_here(volume)
    assert str(folder) in str(missing.value) and "kind: merge" in str(missing.value)
    assert hub.requests == []


def hub_config(**task) -> ConvertConfig:
    return validate_tree(ConvertConfig, {"name": RUN, "task": [{"kind": "hub", "source": "merged"} | task]})


@pytest.mark.parametrize("repo_id", ["tiny-ft", "someone/tiny--ft", "a/b/c", "someone/tiny ft", "/tiny-ft"])
def test_a_repo_id_that_is_no_owner_slash_name_is_a_config_error_naming_the_field(repo_id: str) -> None:
    with pytest.raises(ConfigError) as raised:
        hub_config(repo_id=repo_id)
    assert raised.value.exit_code == ExitCode.BAD_INPUT
    assert f"task.0.hub.repo_id = {repo_id!r}" in str(raised.value), str(raised.value)


def test_a_source_outside_the_export_folder_and_two_pushes_to_one_branch_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="source"):
        hub_config(repo_id=REPO, source="../checkpoints")
    with pytest.raises(ConfigError, match="same repo and branch"):
        validate_tree(
            ConvertConfig,
            {"name": RUN, "task": [{"kind": "hub", "source": s, "repo_id": REPO} for s in ("merged", "mlx")]},
        )
    task = hub_config(repo_id=REPO).task[0]
    assert task.private is True and task.revision == "main"


@pytest.fixture
def finetuned(volume: Path, tmp_path: Path) -> Path:
    """A tiny base model and a run `ft` whose export/adapter is a LoRA of it; the base's folder."""
    from convert_support import make_adapter, make_base

    base = make_base(tmp_path / "base", hidden=16, layers=1)
    make_adapter(base, volume / "runs" / RUN / "export" / "adapter")
    return base


def test_a_merge_then_a_push_in_one_config_pushes_the_folder_the_merge_made(
    volume: Path, hub: FakeHub, at_hub, finetuned: Path
) -> None:
    config = validate_tree(
        ConvertConfig, {"name": RUN, "base_model": str(finetuned), "task": ["merge", hub_task()]}
    )
    merged, record = run_convert(config, Volume(volume), PreemptionWatch())
    assert record == record_path(volume)
    assert {k: v for k, v in hub.repos[REPO].tree("main").items() if k != ".gitattributes"} == pushed_files(
        merged
    )
    assert "README.md" in pushed_files(merged), "the merge's model card goes up with it"
    assert hub.model_cards == [
        {
            "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "tags": ["trainpod", "lora", "merged"],
        }
    ]


def test_a_push_before_the_task_that_makes_its_source_is_exit_2(
    volume: Path, hub: FakeHub, at_hub, finetuned: Path
) -> None:
    export_folder(volume)  # an older merge, which the merge task of this config would replace after the push
    config = validate_tree(
        ConvertConfig, {"name": RUN, "base_model": str(finetuned), "task": [hub_task(), "merge"]}
    )
    with pytest.raises(InputError, match=r"task 2 \(merge\) makes after it"):
        run_convert(config, Volume(volume), PreemptionWatch())
    assert hub.requests == []


def test_hf_xets_refusal_of_the_token_is_exit_2_naming_hf_token_and_its_network_errors_exit_75() -> None:
    """The image uploads to the real Hub through hf_xet, whose errors no fake serves: its own classes, mapped."""
    import hf_xet

    from trainpod.convert.hub import hub_error

    task = hub_config(repo_id=REPO).task[0]
    try:
        try:
            raise hf_xet.XetAuthenticationError("token refused")
        except hf_xet.XetAuthenticationError as exc:
            raise RuntimeError("Error while uploading 'model.safetensors' to the Hub.") from exc
    except RuntimeError as wrapped:
        refused = hub_error(wrapped, task, 2, "https://huggingface.co")
    assert (
        isinstance(refused, InputError)
        and "refused HF_TOKEN" in str(refused)
        and "task 2 (hub)" in str(refused)
    )
    assert isinstance(
        hub_error(ConnectionResetError(104, "reset"), task, 2, "https://huggingface.co"), TemporaryError
    )
    assert hub_error(ValueError("a bug"), task, 2, "https://huggingface.co") is None, (
        "a failure neither the Hub's nor the network's is a crash"
    )
