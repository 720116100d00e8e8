"""Publish a folder another program wrote as a committed checkpoint, through the store's one commit path.

    trainpod checkpoint commit RUN --step N DIR      (cli.py; the HF callback calls it too)

Every file under DIR is moved into the store's `step-<N>.tmp-<id>/` (copied when DIR is on another
filesystem, or with keep_source), fsynced and hashed; then the manifest, the rename and LATEST, as
for the stock trainers. A kill at any instant leaves either the previous LATEST or the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import numbers
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainpod.checkpoint.store import (
    LATEST,
    MANIFEST,
    RANK_RNG_FOLDER,
    CheckpointStore,
    CommittedCheckpoint,
    step_dir_name,
    step_of,
)
from trainpod.errors import InputError

log = logging.getLogger(__name__)


def files_to_publish(source: Path) -> list[str]:
    """The relative names of every file under `source`; refuses what a checkpoint cannot hold."""
    if not source.is_dir():
        raise InputError(f"{source} is not a directory; pass the folder your program wrote its checkpoint to")
    names, problems = [], []
    for path in sorted(source.rglob("*")):
        name = path.relative_to(source).as_posix()
        if path.is_symlink():
            problems.append(f"{name} is a symbolic link (write the file itself)")
        elif path.is_file():
            names.append(name)
    if MANIFEST in names:
        problems.append(f"{MANIFEST} is reserved for the manifest trainpod writes (rename yours)")
    if not names:
        problems.append("it holds no files")
    if problems:
        raise InputError(f"cannot commit {source} as a checkpoint: " + "; ".join(problems))
    return names


def commit_directory(
    store: CheckpointStore,
    step: int,
    source: Path,
    metadata: dict[str, Any],
    keep_source: bool = False,
    eval_loss: float | None = None,
    score: tuple[str, float] | None = None,
) -> CommittedCheckpoint:
    """Publish `source` as `step-<step>` and make it LATEST; `source` is consumed unless keep_source. `score` as
    CheckpointStore.commit's: what best-k retention ranks by in place of `eval_loss`."""
    step = whole_step(step)
    refuse_the_stores_own_folder(store, source)
    names = files_to_publish(source)
    refuse_older_step(store, step)
    if (store.root / step_dir_name(step)).exists():
        log.warning("step-%d is committed already; the committed one is kept, %s is discarded", step, source)
    with store.writing(step) as pending:  # a failed commit (a full volume) removes its temp folder at once
        try:
            for name in names:
                if keep_source:
                    with open(source / name, "rb") as src, pending.open(name) as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                else:
                    pending.adopt(name, source / name)
            with _one_publish_at_a_time(store):
                # Again: a newer step may have been published while this one was written.
                refuse_older_step(store, step)
                committed = store.commit(pending, step, metadata, eval_loss, score=score)
        except BaseException:
            if not keep_source:
                _give_back(pending.dir, source, names)
            raise
    if not keep_source:
        _remove_empty_tree(source)
    return committed


def _give_back(temp: Path, source: Path, names: list[str]) -> None:
    """Move the files a failed commit took from `source` back there, before its temp folder is removed: a commit
    refused or failed after it adopted them (a newer step published meanwhile, the lease lost, a full volume) left
    the program's checkpoint nowhere, though its refusal tells the program to act on it. A file already published
    (the temp folder renamed into place) is not there to move."""
    for name in names:
        taken = temp / name
        if taken.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.move(taken, source / name)


@contextlib.contextmanager
def _one_publish_at_a_time(store: CheckpointStore) -> Iterator[None]:
    """Commits of one run publish one after the other (a trainer that runs `trainpod checkpoint commit` in the
    background overlaps them): an older step's LATEST written after a newer one's moved LATEST backwards, and
    the next start deleted the newer checkpoint as an interrupted commit. A volume without locks goes on as
    before.

    The lock is a file in this machine's temp folder named after the checkpoints folder: the commits that overlap
    run on the pod that holds the run's lease, and a network volume's flock may be missing or refused."""
    key = hashlib.sha256(str(store.root.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"trainpod-publish-{key}.lock", "a") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # the lock goes with the file's close


def refuse_the_stores_own_folder(store: CheckpointStore, source: Path) -> None:
    """A DIR that holds the checkpoints folder (the run folder, the checkpoints folder itself) would have
    its committed checkpoints and LATEST moved into the new one; a DIR the store names (`step-<N>/` written
    in place, `rng/`) was taken for the committed step-<N>, its files discarded and LATEST made to name a
    folder with no manifest. Both are refused (exit 2); a folder of another name in checkpoints/ is fine."""
    root, folder = store.root.resolve(), source.resolve()
    inside = folder.relative_to(root).parts[:1] if folder.is_relative_to(root) else None
    if folder == root or root.is_relative_to(folder):
        problem = f"it holds the checkpoints folder {store.root}, whose committed checkpoints it would move"
    elif inside and (
        inside[0] in (LATEST, RANK_RNG_FOLDER) or inside[0].startswith("step-") or ".tmp-" in inside[0]
    ):
        problem = f"{inside[0]} is a name the checkpoints folder {store.root} keeps for its own"
    else:
        return
    raise InputError(
        f"cannot commit {source} as a checkpoint: {problem}. Write the checkpoint to a folder of its own, "
        "like $TRAINPOD_RUN_DIR/scratch/step-<N>, and commit that"
    )


def refuse_a_checkpoints_folder_for_a_run(run_dir: Path, where: str) -> None:
    """A run folder that is a run's checkpoints folder ($TRAINPOD_CHECKPOINT_DIR, where $TRAINPOD_RUN_DIR was
    meant) made a store of its own in checkpoints/checkpoints/: `latest` found nothing there and the program
    started from scratch, and its commits landed where no start of the kit, `trainpod status`, `pull` or the
    crash-loop count looks. Refused (exit 2): the folder is $TRAINPOD_CHECKPOINT_DIR, or holds LATEST or a
    step-<N>/ folder of its own."""
    named = os.environ.get("TRAINPOD_CHECKPOINT_DIR")
    if named and run_dir.resolve() == Path(named).resolve():
        problem = "it is $TRAINPOD_CHECKPOINT_DIR, the run's checkpoints folder"
    elif (run_dir / LATEST).is_file() or _holds_a_step_folder(run_dir):
        problem = "it holds checkpoints itself (LATEST, step-<N>/): it is a run's checkpoints folder"
    else:
        return
    raise InputError(
        f"{where}={run_dir} is not a run folder: {problem}, and the checkpoints would go to "
        f"{run_dir / 'checkpoints'}, where no start, `trainpod status` or `trainpod pull` looks. Pass the run "
        f'folder, "$TRAINPOD_RUN_DIR" ({run_dir.parent})'
    )


def _holds_a_step_folder(folder: Path) -> bool:
    return folder.is_dir() and any(
        step_of(path.name) is not None and path.is_dir() for path in folder.iterdir()
    )


def whole_step(step: Any) -> int:
    """`step` as an int, for the user-facing doors: a float (`iter_num / accum`), a tensor or a negative number
    named the folder step-5.0 (step-tensor(5), step--1), which no start takes for a checkpoint, so the
    commit looked made and every start began from scratch. Refused (exit 2); numpy's integers are fine."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise InputError(
            f"step={step!r} is not a whole number >= 0: the checkpoint would be named step-{step}, which no "
            "start takes for a checkpoint, so every start would begin from scratch; pass an int, like int(step)"
        )
    return int(step)


def refuse_older_step(store: CheckpointStore, step: int) -> None:
    """A commit older than LATEST would move LATEST backwards, and the next start would delete every newer
    checkpoint as the leftover of an interrupted commit: refused (exit 2) for the user-facing doors."""
    latest = store._latest_name()
    newest = int(latest.removeprefix("step-")) if latest else None
    if newest is not None and step < newest and (store.root / latest).is_dir():
        raise InputError(
            f"step={step} is older than the newest committed checkpoint {store.root / latest}; committing it "
            "would move LATEST backwards and the next start would delete the newer checkpoints. Resume from "
            "the newest one (Checkpointer.restore(), `trainpod checkpoint latest`, the HF callback's "
            "resume_from_checkpoint()) and count steps on from it, or use a new run name"
        )


def verify_committed(store: CheckpointStore, step: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Check step-<step> (default: the one LATEST names) against its manifest, changing nothing."""
    name = step_dir_name(step) if step is not None else store._latest_name()
    if name is None:
        raise InputError(f"no committed checkpoint: {store.root}/LATEST is missing or unreadable")
    if step is not None and not (store.root / name).is_dir():  # not damaged: never made, or retention's
        there = ", ".join(path.name for _, path in store._step_dirs()) or "none"
        raise InputError(
            f"no checkpoint {name} in {store.root} (retention keeps the last keep_last and the best keep_best); "
            f"there: {there}"
        )
    manifest, reason = store.verify(store.root / name)
    if manifest is None:
        raise InputError(f"{store.root / name} is not a valid checkpoint: {reason}")
    return store.root / name, manifest


def _remove_empty_tree(root: Path) -> None:
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for folder in sorted(folders, key=lambda p: -len(p.parts)):
        try:
            folder.rmdir()
        except OSError:
            return  # something new appeared in it: leave it for the program
