"""`trainpod checkpoint latest/commit/verify`: the checkpoint protocol for trainers in any language."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from trainpod.cli import main


@pytest.fixture(autouse=True)
def sigterm_restored():
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def written(tmp_path: Path, name: str = "out", **files: bytes) -> Path:
    folder = tmp_path / name
    for file, data in (files or {"weights.bin": b"w" * 100, "sub/state.txt": b"7"}).items():
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_bytes(data)
    return folder


def test_latest_prints_nothing_for_a_run_without_checkpoints(tmp_path, capsys):
    assert main(["checkpoint", "latest", "fresh-run", "--volume", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "runs").exists(), "asking for the latest checkpoint writes nothing"


def test_commit_moves_the_folder_in_and_latest_prints_only_its_path(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["checkpoint", "commit", run, "--step", "4", str(written(tmp_path))]) == 0
    assert not (tmp_path / "out").exists(), "the folder is moved into the store, not copied"
    capsys.readouterr()
    assert main(["checkpoint", "latest", run]) == 0
    assert capsys.readouterr().out == f"{tmp_path}/run/checkpoints/step-4\n"
    assert (tmp_path / "run/checkpoints/step-4/sub/state.txt").read_bytes() == b"7"


def test_commit_with_keep_source_copies_and_leaves_the_folder(tmp_path):
    source = written(tmp_path)
    assert (
        main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "1", str(source), "--keep-source"])
        == 0
    )
    assert (source / "weights.bin").exists()


def test_latest_skips_a_damaged_newest_checkpoint_and_verify_names_the_damage(tmp_path, capsys):
    run = str(tmp_path / "run")
    main(["checkpoint", "commit", run, "--step", "1", str(written(tmp_path, "a"))])
    main(["checkpoint", "commit", run, "--step", "2", str(written(tmp_path, "b"))])
    (tmp_path / "run/checkpoints/step-2/weights.bin").write_bytes(b"x" * 100)
    capsys.readouterr()
    assert main(["checkpoint", "verify", run]) == 2
    assert "weights.bin does not match its sha256" in capsys.readouterr().err
    assert main(["checkpoint", "verify", run, "1"]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "latest", run]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}/run/checkpoints/step-1"


def test_verify_of_a_step_that_is_not_there_says_so_and_names_the_ones_that_are(tmp_path, capsys):
    """A step retention deleted read "step-1 is not a valid checkpoint: manifest.json is missing", as if a
    checkpoint there were damaged."""
    run = str(tmp_path / "run")
    for step in (1, 2, 3):
        main(["checkpoint", "commit", run, "--step", str(step), str(written(tmp_path, f"s{step}"))])
    capsys.readouterr()
    assert main(["checkpoint", "verify", run, "1"]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint step-1 in {tmp_path}/run/checkpoints" in err and "there: step-3, step-2" in err, (
        err
    )
    assert "not a valid checkpoint" not in err


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"manifest.json": b"{}"}, "manifest.json is reserved"),
        ({}, "holds no files"),
    ],
)
def test_commit_refuses_a_folder_it_cannot_publish_with_exit_2(tmp_path, capsys, files, message):
    source = tmp_path / "out"
    source.mkdir()
    for name, data in files.items():
        (source / name).write_bytes(data)
    assert main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "3", str(source)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run/checkpoints/LATEST").exists()


def test_commit_refuses_symbolic_links(tmp_path, capsys):
    source = written(tmp_path)
    os.symlink(source / "weights.bin", source / "link.bin")
    assert main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "3", str(source)]) == 2
    assert "link.bin is a symbolic link" in capsys.readouterr().err
    assert (source / "weights.bin").exists(), "a refused folder is left as it was"


@pytest.mark.parametrize(
    "source",
    ["run/checkpoints/step-3", "run/checkpoints", "run"],
    ids=["written-in-place-as-step-N", "the-checkpoints-folder", "the-run-folder"],
)
def test_commit_of_a_folder_the_store_owns_is_exit_2_and_every_committed_checkpoint_stays(
    tmp_path, capsys, source
):
    run = tmp_path / "run"
    assert main(["checkpoint", "commit", str(run), "--step", "2", str(written(tmp_path, "first"))]) == 0
    written(tmp_path, "run/checkpoints/step-3")  # a trainer writing straight into $TRAINPOD_CHECKPOINT_DIR
    capsys.readouterr()
    assert main(["checkpoint", "commit", str(run), "--step", "3", str(tmp_path / source)]) == 2
    assert "Write the checkpoint to a folder of its own" in capsys.readouterr().err
    assert (run / "checkpoints/LATEST").read_text() == "step-2\n", "LATEST names no folder without a manifest"
    assert main(["checkpoint", "verify", str(run)]) == 0
    assert (run / "checkpoints/step-3/weights.bin").exists(), "the refused folder is left as it was"


def test_commit_of_an_empty_dir_is_exit_2_and_leaves_the_current_folder_alone(tmp_path, capsys, monkeypatch):
    code = written(tmp_path, "repo", **{"train.sh": b"#!/bin/sh\n"})
    monkeypatch.chdir(code)  # the trainer's workdir: its code
    assert main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "5", ""]) == 2
    assert "DIR is empty" in capsys.readouterr().err
    assert (code / "train.sh").exists(), "the trainer's own folder is not moved into a checkpoint"
    assert not (tmp_path / "run/checkpoints/LATEST").exists()


def test_an_older_commit_overlapping_a_newer_one_never_moves_latest_backwards(tmp_path, capsys, monkeypatch):
    """A trainer committing in the background (`trainpod checkpoint commit ... &`): step 10's large files were
    still being hashed when step 15 was published, then step 10 wrote LATEST, and the next `latest` deleted the
    committed step-15 as an interrupted commit."""
    import threading

    from trainpod.checkpoint import CheckpointStore
    from trainpod.checkpoint.directory import commit_directory
    from trainpod.checkpoint.store import PendingCheckpoint
    from trainpod.errors import InputError

    older_written, newer_published, refused = threading.Event(), threading.Event(), []
    adopt = PendingCheckpoint.adopt

    def adopt_slowly_for_step_10(pending, name, source):
        adopt(pending, name, source)
        if pending.dir.name.startswith("step-10."):
            older_written.set()
            assert newer_published.wait(60)

    monkeypatch.setattr(PendingCheckpoint, "adopt", adopt_slowly_for_step_10)

    def commit_step_10():
        try:
            commit_directory(CheckpointStore(tmp_path / "run/checkpoints"), 10, written(tmp_path, "a"), {})
        except InputError as exc:
            refused.append(str(exc))

    older = threading.Thread(target=commit_step_10)
    older.start()
    assert older_written.wait(60)
    assert (
        main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "15", str(written(tmp_path, "b"))])
        == 0
    )
    newer_published.set()
    older.join(60)
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-15\n"
    assert refused and "older than the newest committed checkpoint" in refused[0]
    capsys.readouterr()
    assert main(["checkpoint", "latest", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == f"{tmp_path}/run/checkpoints/step-15\n"
    assert not list((tmp_path / "run/checkpoints").glob("step-10*")), "the refused commit leaves nothing"
    # ... and the program's folder as it was: its files had been moved into the refused commit's temp folder,
    # then removed with it, though the refusal tells the program to resume and commit them on from there.
    assert (tmp_path / "a/weights.bin").read_bytes() == b"w" * 100 and (tmp_path / "a/sub/state.txt").exists()


def test_a_run_name_resolves_under_the_volume(tmp_path, capsys):
    assert (
        main(
            [
                "checkpoint",
                "commit",
                "my-run",
                "--step",
                "9",
                str(written(tmp_path)),
                "--volume",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (tmp_path / "runs/my-run/checkpoints/LATEST").read_text().strip() == "step-9"


def test_a_commit_on_a_full_volume_exits_5_and_leaves_no_temp_folder(tmp_path, capsys, monkeypatch):
    """A full volume mid-copy gave a traceback (exit 1) and left the partial copy in a temp folder, holding
    the space a retry needed until the next start."""
    import errno
    import shutil

    from trainpod.checkpoint import directory

    run = tmp_path / "run"
    assert main(["checkpoint", "commit", str(run), "--step", "1", str(written(tmp_path, "a"))]) == 0
    real = shutil.copyfileobj

    def copy_until_full(src, dst, length=0):
        if src.name.endswith("state.txt"):  # the second file: part of it is written, then the volume is full
            dst.write(src.read(1))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(src, dst, length)

    monkeypatch.setattr(directory.shutil, "copyfileobj", copy_until_full)
    source = written(tmp_path, "b")
    capsys.readouterr()
    assert main(["checkpoint", "commit", str(run), "--step", "2", str(source), "--keep-source"]) == 5
    assert "no space left on the volume" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-1"]
    assert (source / "weights.bin").exists()


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--keep-last", "1"], None, "--keep-last='1'"),
        (["--keep-last", "-1"], None, "--keep-last='-1'"),
        ([], "two", "TRAINPOD_KEEP_LAST='two'"),
        ([], "0", "TRAINPOD_KEEP_LAST='0'"),
        ([], "³", "TRAINPOD_KEEP_LAST='³'"),  # a digit to str.isdigit, no number to int(): a ValueError
    ],
)
def test_a_retention_below_two_or_not_a_number_is_exit_2_naming_it(
    tmp_path, capsys, monkeypatch, args, env, named
):
    """Was a traceback (exit 1) for a non-number or a negative count ('³' too, which str.isdigit passes), and
    keep_last=1 was accepted: retention then left no older checkpoint to fall back to when the newest fails
    verification."""
    if env is not None:
        monkeypatch.setenv("TRAINPOD_KEEP_LAST", env)
    run = tmp_path / "run"
    source = written(tmp_path)
    assert main(["checkpoint", "commit", str(run), "--step", "1", str(source), *args]) == 2
    err = capsys.readouterr().err
    assert named in err and ">= 2" in err, err
    assert (source / "weights.bin").exists() and not (run / "checkpoints").exists()


def test_latest_beside_a_live_writer_removes_nothing_of_its_commit_in_flight(tmp_path, capsys, monkeypatch):
    """`trainpod checkpoint latest` from a shell on the pod while the run trained removed the temp folder of
    the run's commit in flight as a leftover (and a step renamed just before LATEST): that commit failed."""
    from trainpod.checkpoint import CheckpointStore, Lease

    monkeypatch.delenv("TRAINPOD_LEASE_HELD", raising=False)
    run = tmp_path / "run"
    assert main(["checkpoint", "commit", str(run), "--step", "1", str(written(tmp_path, "a"))]) == 0
    lease = Lease(run / "LEASE", ttl_seconds=60)
    lease.acquire()  # the training run, alive
    try:
        store = CheckpointStore(run / "checkpoints")
        pending = store.begin(2)
        pending.write_bytes("weights.bin", b"the first file of the commit in flight")
        capsys.readouterr()
        assert main(["checkpoint", "latest", str(run)]) == 0
        assert capsys.readouterr().out == f"{run}/checkpoints/step-1\n"
        pending.write_bytes("state.txt", b"2")
        assert store.commit(pending, 2, {}).step == 2
    finally:
        lease.release()
    leftover = store.begin(3)  # the writer is gone: what it left is removed again
    assert main(["checkpoint", "latest", str(run)]) == 0
    assert not leftover.dir.exists()


def test_commit_keeps_the_best_checkpoints_trainpod_keep_best_asks_for(tmp_path, capsys, monkeypatch):
    """TRAINPOD_KEEP_BEST (the command config's checkpoint.keep_best) was read by the Checkpointer and the HF
    callback alone: a commit through the CLI kept the last keep_last and deleted the run's best checkpoint,
    though the door that scored it keeps it. It now keeps the best keep_best by eval loss too."""
    from trainpod.checkpoint import CheckpointStore
    from trainpod.checkpoint.directory import commit_directory

    monkeypatch.setenv("TRAINPOD_KEEP_BEST", "1")
    run = tmp_path / "run"
    scored = CheckpointStore(run / "checkpoints", keep_last=2, keep_best=1)  # as the HF callback commits
    for step, loss in ((1, 2.5), (2, 1.25), (3, 3.0), (4, 4.0)):
        commit_directory(scored, step, written(tmp_path, f"s{step}"), {}, eval_loss=loss)
    assert main(["checkpoint", "commit", str(run), "--step", "5", str(written(tmp_path, "s5"))]) == 0
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-2", "step-4", "step-5"], "the last 2 and the best (step 2, eval loss 1.25)"


def test_commit_with_an_eval_loss_is_ranked_by_it(tmp_path, monkeypatch):
    """A trainer in any language scores its own commits for best-k (TRAINPOD_KEEP_BEST), as the Python doors do."""
    monkeypatch.setenv("TRAINPOD_KEEP_BEST", "1")
    run = str(tmp_path / "run")
    for step, loss in ((1, "2.5"), (2, "1.25"), (3, "3.0"), (4, "4.0")):
        source = str(written(tmp_path, f"s{step}"))
        assert main(["checkpoint", "commit", run, "--step", str(step), source, "--eval-loss", loss]) == 0
    kept = sorted(p.name for p in (tmp_path / "run/checkpoints").glob("step-*"))
    assert kept == ["step-2", "step-3", "step-4"]
    assert main(["checkpoint", "verify", run, "2"]) == 0


@pytest.mark.parametrize(("args", "env", "named"), [(["--keep-best", "-1"], None, "--keep-best='-1'"),
                                                    ([], "one", "TRAINPOD_KEEP_BEST='one'"),
                                                    ([], "³", "TRAINPOD_KEEP_BEST='³'")])  # fmt: skip
def test_a_keep_best_that_is_not_a_whole_number_is_exit_2_naming_it(
    tmp_path, capsys, monkeypatch, args, env, named
):
    if env is not None:
        monkeypatch.setenv("TRAINPOD_KEEP_BEST", env)
    source = written(tmp_path)
    assert main(["checkpoint", "commit", str(tmp_path / "run"), "--step", "1", str(source), *args]) == 2
    assert named in capsys.readouterr().err
    assert (source / "weights.bin").exists()


@pytest.mark.parametrize("action", ["commit", "latest"])
def test_an_empty_run_an_unset_variable_is_exit_2_and_nothing_is_written(tmp_path, capsys, action):
    """`trainpod checkpoint commit "$TRAINPOD_RUN_DIR"` with the variable unset (a trainer started outside the
    command workload, a typo in its name) committed into the volume's runs/checkpoints/, which is no run's
    folder: the run never saw its checkpoints, and `latest ""` read them back from there."""
    source = written(tmp_path)
    extra = ["--step", "1", str(source)] if action == "commit" else []
    assert main(["checkpoint", action, "", *extra, "--volume", str(tmp_path / "volume")]) == 2
    assert "RUN '' is neither" in capsys.readouterr().err
    assert not (tmp_path / "volume").exists() and (source / "weights.bin").exists()


def test_a_commit_beside_a_live_writer_of_the_run_is_exit_75_and_commits_nothing(
    tmp_path, capsys, monkeypatch
):
    """A commit from outside the kit (a shell on the pod, a second machine on the volume) into a run another
    process trains moved LATEST and retention under it. It is refused while that writer's lease lives; the
    kit's own program (TRAINPOD_LEASE_HELD=1) and a child of the lease's holder still commit."""
    import subprocess
    import sys

    monkeypatch.delenv("TRAINPOD_LEASE_HELD", raising=False)
    run = tmp_path / "run"
    assert main(["checkpoint", "commit", str(run), "--step", "1", str(written(tmp_path, "a"))]) == 0
    holder = subprocess.Popen(  # the training run: another process, alive, holding the run's lease
        [sys.executable, "-c", "import sys, time\nfrom trainpod.checkpoint import Lease\n"
         f"Lease({str(run / 'LEASE')!r}, ttl_seconds=60).acquire()\nprint('held', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        outside = written(tmp_path, "b")
        capsys.readouterr()
        assert main(["checkpoint", "commit", str(run), "--step", "2", str(outside)]) == 75
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "nothing was committed" in err
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == [
            "step-1"
        ]
        assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-1"
        assert (outside / "weights.bin").read_bytes() == b"w" * 100  # DIR left as it was

        monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")  # the program the kit holds the lease for
        assert main(["checkpoint", "commit", str(run), "--step", "2", str(outside)]) == 0
    finally:
        holder.kill()
        holder.wait()

    from trainpod.checkpoint import Lease

    monkeypatch.delenv("TRAINPOD_LEASE_HELD")
    lease = Lease(run / "LEASE", ttl_seconds=60)
    lease.acquire()  # this process holds it (the Python Checkpointer): its child's commit is its own
    try:
        child = subprocess.run(
            [sys.executable, "-m", "trainpod", "checkpoint", "commit", str(run), "--step", "3",
             str(written(tmp_path, "c"))],
            capture_output=True, text=True, env=os.environ.copy(),
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
    finally:
        lease.release()
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-3"


@pytest.mark.parametrize("action", ["commit", "latest"])
def test_the_checkpoints_folder_given_for_the_run_is_exit_2_naming_the_run_folder(
    tmp_path, capsys, monkeypatch, action
):
    """`trainpod checkpoint latest "$TRAINPOD_CHECKPOINT_DIR"` (the variable beside TRAINPOD_RUN_DIR) made a store
    of its own in checkpoints/checkpoints/: `latest` printed nothing, so the trainer started from scratch, and its
    commits landed where no start of the kit, `trainpod status` or `pull` looks."""
    run = tmp_path / "run"
    assert main(["checkpoint", "commit", str(run), "--step", "4", str(written(tmp_path))]) == 0
    capsys.readouterr()
    source = written(tmp_path, "next")
    extra = ["--step", "5", str(source)] if action == "commit" else []
    monkeypatch.delenv("TRAINPOD_CHECKPOINT_DIR", raising=False)
    assert main(["checkpoint", action, str(run / "checkpoints"), *extra]) == 2, "a folder holding LATEST"
    assert f'"$TRAINPOD_RUN_DIR" ({run})' in capsys.readouterr().err
    empty = tmp_path / "fresh/checkpoints"
    empty.mkdir(parents=True)
    monkeypatch.setenv("TRAINPOD_CHECKPOINT_DIR", str(empty))
    assert main(["checkpoint", action, str(empty), *extra]) == 2, (
        "the variable's folder, no checkpoint in it yet"
    )
    assert "it is $TRAINPOD_CHECKPOINT_DIR" in capsys.readouterr().err
    assert not (run / "checkpoints/checkpoints").exists() and not (empty / "checkpoints").exists()
    assert (source / "weights.bin").exists(), "nothing was committed"
    assert (run / "checkpoints/LATEST").read_text() == "step-4\n"
