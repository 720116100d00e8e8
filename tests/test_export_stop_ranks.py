"""A stop during the final export of a two-rank run (gloo on CPU, `--nproc-per-node 2`): rank 0, the lease
holder, lets the run's lease go at the SIGTERM while the export's collective runs on, publishes nothing after,
and every rank exits 143 once the collective ends; the next start makes the export again.

A spot pod gets SIGKILL 5 s after the SIGTERM. The export of several ranks ran on after the stop (it is a
collective: FSDP gathers the weights on every rank), so an export of a large model met the SIGKILL with the
lease held and the next start on another host waited out its TTL (90 s). Each test below holds a rank of the
export (a hook imported into both ranks as sitecustomize) until the lease is gone, which it is only if rank 0
let it go while the export was still under way; a hold that outlasts HOLD_S gives up and says so.

.venv/bin/pytest -q tests/test_export_stop_ranks.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trainpod.errors import ExitCode

from support import RUN, TINY_PRETRAIN, exported_weights, run_trainpod, start_trainpod, tree_snapshot

pytestmark = pytest.mark.slow

HOLD_S = 60  # far more than rank 0 needs to let the lease go; only a run that never does waits it out

HOOK = """
import contextlib, os, time
from pathlib import Path

hold, rank = os.environ.get("HOLD"), os.environ.get("RANK")
marker = Path(os.environ.get("STOP_MARKER", "."))


def until(done):
    deadline = time.monotonic() + float(os.environ["HOLD_S"])
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not done():
        marker.with_name(marker.name + ".gave-up").touch()


def lease_gone():
    return not Path(os.environ["RUN_LEASE"]).exists()


if hold == "gather" and rank == "1":
    # Rank 1 comes late to the gather, so rank 0 waits inside the collective (one C call) meanwhile.
    import trainpod.train.sharding as sharding

    real_gather = sharding.full_weights

    def late_gather(model):
        marker.touch()
        until(lease_gone)
        return real_gather(model)

    sharding.full_weights = late_gather

if hold == "before-rename" and rank == "0":
    # Rank 0 has written its export and not yet renamed it into place when the stop comes; it goes on only
    # once another start has taken the run over and finished it (GO), as a slow volume might.
    from trainpod.preemption import PreemptionWatch

    real_abandoning = PreemptionWatch.abandoning

    @contextlib.contextmanager
    def then_held(self):
        with real_abandoning(self):
            yield
        marker.touch()
        until(lambda: Path(os.environ["GO"]).exists())

    PreemptionWatch.abandoning = then_held
"""

PRETRAIN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    *("--set", "train.max_steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0"),
)
TWO_FSDP = ("--nproc-per-node", "2", "--set", "train.parallel=fsdp")
TWO_DDP = ("--nproc-per-node", "2")


def fresh_volume(tmp_path: Path, dataset: Path, name: str) -> Path:
    volume = tmp_path / name
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(dataset / folder, volume / folder)
    return volume


def start_held(
    args: tuple[str, ...], volume: Path, tmp_path: Path, hold: str
) -> tuple[subprocess.Popen, Path]:
    """Start two ranks with the hook; return the launcher and the marker the held rank touches."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    marker = tmp_path / "held"
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "HOLD": hold,
        "HOLD_S": str(HOLD_S),
        "STOP_MARKER": str(marker),
        "RUN_LEASE": str(volume / "runs" / RUN / "LEASE"),
        "GO": str(tmp_path / "go"),
    }
    return start_trainpod(*args, volume=volume, env=env), marker


def wait_for(what: str, done, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not done() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not done():
        proc.kill()
        pytest.fail(f"{what} never happened:\n{proc.communicate()[0]}")


def finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=HOLD_S + 60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the stopped export never ended:\n{proc.communicate()[0]}")


@pytest.fixture(scope="module")
def uninterrupted_fsdp(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> bytes:
    volume = fresh_volume(tmp_path_factory.mktemp("fsdp"), tiny_dataset_volume, "uninterrupted")
    result = run_trainpod(*PRETRAIN, *TWO_FSDP, volume=volume)
    assert result.returncode == ExitCode.DONE, result.stdout + result.stderr
    return exported_weights(volume)


def test_a_sigterm_during_a_two_rank_export_lets_the_lease_go_while_the_gather_runs_on_and_the_next_start_exports_again(
    tmp_path: Path, tiny_dataset_volume: Path, uninterrupted_fsdp: bytes
) -> None:
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "volume")
    run = volume / "runs" / RUN
    proc, marker = start_held((*PRETRAIN, *TWO_FSDP), volume, tmp_path, "gather")
    wait_for("the export's gather", marker.exists, proc)
    proc.send_signal(signal.SIGTERM)  # the launcher forwards it to both ranks, as torchrun does
    out = finish(proc)

    assert not marker.with_name("held.gave-up").exists(), (
        f"rank 0 held the run's lease through the export's gather after the SIGTERM; a new pod on another host "
        f"would wait out its TTL:\n{out}"
    )
    assert proc.returncode == ExitCode.PREEMPTED, f"a stop during the export must exit 143:\n{out}"
    assert not (run / "LEASE").exists(), out
    assert not (run / "DONE").exists(), f"a run whose export was stopped was marked DONE:\n{out}"
    assert not (run / "export" / "hf").exists(), f"an export stopped midway was published:\n{out}"
    assert json.loads((run / "status.json").read_text())["state"] == "preempted"
    assert "Traceback" not in out, out

    resumed = run_trainpod(*PRETRAIN, *TWO_FSDP, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert "resumed from step-4" in resumed.stdout
    assert not list((run / "export").glob("*.tmp-*")), (
        "the next start must remove what the stopped export left"
    )
    assert exported_weights(volume) == uninterrupted_fsdp, "the export made again is not the last step's"


def test_a_rank_0_that_let_the_lease_go_never_publishes_over_the_start_that_took_the_run_over(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    """The stop comes between rank 0's export writes and their rename into place. Another start takes the
    released lease, removes the old export's temp folder, exports and marks the run DONE; the old rank 0,
    let go on only then, must not rename its export over that one, nor write the run's status."""
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "volume")
    run = volume / "runs" / RUN
    proc, marker = start_held((*PRETRAIN, *TWO_DDP), volume, tmp_path, "before-rename")
    wait_for("rank 0's export writes", marker.exists, proc)
    proc.send_signal(signal.SIGTERM)
    wait_for("the release of the run's lease", lambda: not (run / "LEASE").exists(), proc)

    takeover = run_trainpod(*PRETRAIN, volume=volume)  # one rank: another pod's start, in effect
    assert takeover.returncode == ExitCode.DONE, takeover.stdout + takeover.stderr
    assert "resumed from step-4" in takeover.stdout
    published = tree_snapshot(run / "export")
    (tmp_path / "go").touch()
    out = finish(proc)

    assert not marker.with_name("held.gave-up").exists(), out
    assert proc.returncode == ExitCode.PREEMPTED, f"a stop during the export must exit 143:\n{out}"
    assert tree_snapshot(run / "export") == published, (
        f"the stopped rank 0 published its export after letting the run's lease go:\n{out}"
    )
    assert json.loads((run / "status.json").read_text())["state"] == "done", (
        f"the stopped rank 0 wrote the status of a run it no longer held:\n{out}"
    )
    assert "Traceback" not in out, out
