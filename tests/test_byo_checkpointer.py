"""The checkpoint API for custom loops (trainpod.Checkpointer): commit, verified restore, stop, lease."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
from collections import namedtuple

import numpy as np
import pytest
import torch

from trainpod import Checkpointer

from support import refused_with_exit_2


class TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2 and nanoGPT


@pytest.fixture
def signals_restored():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def trained_pair(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.head(model.embed(torch.tensor([1, 2, 3]))).sum().backward()
    optimizer.step()
    return model, optimizer


def test_committed_state_restores_weights_optimizer_extra_and_rng_exactly(tmp_path):
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        random.seed(7)
        ckpt.commit(5, model=model, optimizer=optimizer, extra={"data_position": 40})
        expected_draw = (random.random(), torch.rand(3))
    fresh, fresh_optimizer = trained_pair(seed=1)
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        restored = ckpt.restore()
        assert restored.step == 5 and restored.extra == {"data_position": 40}
        assert restored.names == ["model", "optimizer"]
        restored.load("model", fresh)
        restored.load("optimizer", fresh_optimizer)
        restored.restore_rng()
        assert random.random() == expected_draw[0]
        assert torch.equal(torch.rand(3), expected_draw[1])
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.head.weight is fresh.embed.weight, "tied weights must stay tied after a restore"
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())


def test_objects_load_with_weights_only_and_tied_tensors_are_stored_once(tmp_path):
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        committed = ckpt.commit(1, model=model, optimizer=optimizer)
    torch.load(committed.path / "optimizer.pt", weights_only=True)  # raises if anything needs unpickling
    import safetensors

    with safetensors.safe_open(committed.path / "model.safetensors", framework="pt") as f:
        assert len(list(f.keys())) == 1, "the tied head weight must not be written a second time"


def commit_two_and_damage_the_newest(run):
    """Steps 1 and 2 committed, then step 2's weights damaged; returns step 2's checkpoint."""
    model, _ = trained_pair()
    with Checkpointer(run, keep_last=3, watch_signals=False) as ckpt:
        ckpt.commit(1, model=model, extra={"at": 1})
        newest = ckpt.commit(2, model=model, extra={"at": 2})
    weights = newest.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3] + b"xyz")
    return newest


def test_restore_falls_back_to_the_older_checkpoint_when_the_newest_is_corrupt(tmp_path):
    commit_two_and_damage_the_newest(tmp_path / "run")
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        restored = ckpt.restore()
    assert (restored.step, restored.extra) == (1, {"at": 1})
    assert (tmp_path / "run/checkpoints/LATEST").read_text().strip() == "step-1"


@pytest.mark.parametrize("moved_before", ["verify", "_file_digests"])
def test_every_rank_restoring_at_once_falls_back_together_when_the_newest_is_corrupt(
    tmp_path, monkeypatch, moved_before
):
    """Every rank restores (the HF callback's resume_from_checkpoint() runs on each): the first rank to find
    the damaged checkpoint moves it aside, and the others, which had listed it or were hashing its files,
    crashed (FileNotFoundError, exit 1) instead of falling back to the older one with it."""
    from trainpod.checkpoint import CheckpointStore

    newest = commit_two_and_damage_the_newest(tmp_path / "run")
    original = getattr(CheckpointStore, moved_before)

    def another_rank_moves_it_aside_first(store, path):
        damaged = newest.path if moved_before == "verify" else path.parent
        if damaged.name == "step-2" and damaged.exists():
            CheckpointStore(store.root)._quarantine(damaged)
        return original(store, path)

    monkeypatch.setattr(CheckpointStore, moved_before, another_rank_moves_it_aside_first)
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")  # the kit (or rank 0) holds the lease
    restored = Checkpointer(tmp_path / "run", watch_signals=False).open().restore()
    assert (restored.step, restored.extra) == (1, {"at": 1})
    assert len(list((tmp_path / "run/checkpoints").glob("step-2.invalid-*"))) == 1


def test_retention_keeps_the_newest_k(tmp_path):
    model, _ = trained_pair()
    with Checkpointer(tmp_path / "run", keep_last=2, watch_signals=False) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.commit(step, model=model)
    kept = sorted(p.name for p in (tmp_path / "run/checkpoints").glob("step-*"))
    assert kept == ["step-3", "step-4"]


def test_a_second_writer_on_the_same_run_ends_with_its_line_and_exit_75_the_first_ones_lease_kept(
    tmp_path, caplog
):
    """Run alone, the TemporaryError out of open() was a traceback and exit 1: a crash counted, where the README's
    table gives exit 75 for a run leased by another writer (a duplicate pod, not counted)."""
    second = Checkpointer(tmp_path / "run", watch_signals=False)
    with Checkpointer(tmp_path / "run", watch_signals=False) as first:
        with (
            caplog.at_level(logging.ERROR, logger="trainpod.checkpointer"),
            pytest.raises(SystemExit) as exited,
        ):
            second.open()
        assert exited.value.code == 75
        assert "leased by another writer" in caplog.text and caplog.records[-1].getMessage() == "exiting 75"
        assert second.lease is None and (tmp_path / "run/LEASE").exists(), "the first writer's lease stays"
        assert first.lease is not None and not first.lease.lost.is_set()


def test_under_the_command_workload_the_kit_holds_the_lease_for_the_program(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        assert ckpt.lease is None
        assert not (tmp_path / "run/LEASE").exists()


def test_run_alone_under_torchrun_rank_0_holds_the_lease_for_every_rank(tmp_path, monkeypatch):
    """Every rank makes a Checkpointer (the HF callback on each): the others crashed with exit 75, the run
    'leased by another writer', their own rank 0."""
    monkeypatch.delenv("TRAINPOD_LEASE_HELD", raising=False)
    monkeypatch.setenv("RANK", "0")
    with Checkpointer(tmp_path / "run", watch_signals=False) as rank0:
        monkeypatch.setenv("RANK", "1")
        with Checkpointer(tmp_path / "run", watch_signals=False) as rank1:
            assert rank1.lease is None and rank0.lease is not None
    assert not (tmp_path / "run/LEASE").exists(), "rank 0 released it"


def test_the_run_folder_and_window_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPOD_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TRAINPOD_CHECKPOINT_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TRAINPOD_PREEMPTION_WINDOW_S", "2.5")
    ckpt = Checkpointer(watch_signals=False)
    assert ckpt.run_dir == tmp_path / "run"
    assert ckpt.store.root == tmp_path / "elsewhere"
    assert ckpt.watch.window_seconds == 2.5


def test_without_a_run_folder_the_program_ends_with_exit_2_naming_the_variables(monkeypatch, caplog):
    for name in ("TRAINPOD_RUN_DIR", "TRAINPOD_RUN"):
        monkeypatch.delenv(name, raising=False)
    refused_with_exit_2(lambda: Checkpointer(watch_signals=False), caplog)
    assert "no run folder: pass Checkpointer(run_dir=...), or set TRAINPOD_RUN_DIR" in caplog.text


def test_sigterm_sets_stop_requested_and_the_window_decides_whether_a_commit_fits(tmp_path, signals_restored):
    model, _ = trained_pair()
    with Checkpointer(tmp_path / "run", window_seconds=30) as ckpt:
        ckpt.commit(1, model=model)
        assert not ckpt.stop_requested and ckpt.seconds_left() == float("inf")
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.stop_requested
        assert ckpt.commit_fits(), "a tiny commit fits in 30 s"
        ckpt.watch.window_seconds = 0.0
        assert not ckpt.commit_fits(), "no commit fits once the window has passed"


def test_exit_preempted_releases_the_lease_and_exits_143(tmp_path):
    ckpt = Checkpointer(tmp_path / "run", watch_signals=False).open()
    with pytest.raises(SystemExit) as stopped:
        ckpt.exit_preempted()
    assert stopped.value.code == 143
    assert not (tmp_path / "run/LEASE").exists()


EXITS_AFTER_A_CYCLE = """
import gc, sys
from trainpod import Checkpointer
class Noted:
    def __del__(self):
        open(sys.argv[2], "w").write("collected at exit")
ckpt = Checkpointer(sys.argv[1], watch_signals=False).open()
gc.collect()
garbage = Noted()
garbage.me = garbage  # a reference cycle: only the collector frees it
del garbage
ckpt.exit_preempted()
"""


def test_exit_preempted_leaves_the_interpreters_last_collection_out(tmp_path):
    """The collection at exit traversed the whole heap after the stop's commit: 1.5 CPU-seconds with torch and
    transformers loaded (the HF example), 4-5 s on a busy machine, so the kit's SIGKILL at the end of the window
    came before the program's exit, and the kit's own exit after the platform's SIGKILL (its lease unreleased)."""
    import subprocess
    import sys

    note = tmp_path / "collected"
    result = subprocess.run(
        [sys.executable, "-c", EXITS_AFTER_A_CYCLE, str(tmp_path / "run"), str(note)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 143, result.stderr
    assert not note.exists(), "the exit ran a collection of the heap"
    assert not (tmp_path / "run/LEASE").exists(), "atexit and the lease's release still run"


@pytest.mark.parametrize(
    "read, said",
    [
        (
            lambda r, model: r.load("ema", model),
            r"holds no state named 'ema' \(it holds \['model', 'optimizer'\]\)",
        ),
        (lambda r, model: r.tensors("ema"), "holds no state named 'ema'.*restored.names"),
        (lambda r, model: r.object("ema"), "holds no state named 'ema'"),
        (
            lambda r, model: r.tensors("optimizer"),
            r"'optimizer' .* is an object, not tensors.*restored.object",
        ),
        (lambda r, model: r.object("model"), r"'model' .* is tensors, not an object.*restored.tensors"),
    ],
    ids=["load", "tensors", "object", "tensors-of-an-object", "object-of-tensors"],
)
def test_reading_a_name_that_was_not_committed_ends_the_program_with_exit_2_naming_what_it_holds(
    tmp_path, caplog, read, said
):
    """Was an InputError (load) or a FileNotFoundError (tensors, object) out of the program's restore: a traceback
    and exit 1, met again at every start. The lease is released at the exit."""
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(3, model=model, optimizer=optimizer)
        restored = ckpt.restore()
        refused_with_exit_2(lambda: read(restored, model), caplog)
        assert ckpt.lease is None and not (tmp_path / "run/LEASE").exists(), "released"
    assert re.search(said, caplog.text), caplog.text


class WiderModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)  # the program's model grew since the commit
        self.head = torch.nn.Linear(8, 11, bias=False)


@pytest.mark.parametrize(
    "target, said",
    [
        (lambda: WiderModel(), r"'model' in checkpoint step-3 does not fit the WiderModel.*size mismatch"),
        (
            lambda: torch.optim.AdamW(WiderModel().parameters(), lr=1e-2),
            r"'optimizer' in checkpoint step-3 does not fit the AdamW",
        ),
    ],
    ids=["model", "optimizer"],
)
def test_a_state_that_does_not_fit_its_target_ends_the_program_with_exit_2_keeping_the_checkpoint(
    tmp_path, caplog, target, said
):
    """torch's RuntimeError (a model of other sizes) or ValueError (an optimizer of other groups) out of the
    program's restore was a traceback and exit 1 at every start, counted until the run was FAILED."""
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(3, model=model, optimizer=optimizer)
        restored = ckpt.restore()
        name = "model" if "model" in said else "optimizer"
        refused_with_exit_2(lambda: restored.load(name, target()), caplog)
        assert not (tmp_path / "run/LEASE").exists(), "released"
    assert re.search(said, caplog.text), caplog.text
    assert "start a new run name (TRAINPOD_RUN)" in caplog.text
    assert (tmp_path / "run/checkpoints/step-3/model.safetensors").exists(), "the checkpoint stays"


def test_restoring_the_rng_of_a_checkpoint_committed_without_it_ends_the_program_with_exit_2(
    tmp_path, caplog
):
    """commit(rng=False) writes no rng.pt: restore_rng() was a FileNotFoundError out of the program's restore, a
    traceback and exit 1 at every start."""
    model, _ = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(3, model=model, rng=False)
        refused_with_exit_2(ckpt.restore().restore_rng, caplog)
        assert not (tmp_path / "run/LEASE").exists(), "released"
    assert "checkpoint step-3 holds no RNG state (rng.pt): it was committed with rng=False" in caplog.text


def test_the_manifest_records_the_writer_and_every_file(tmp_path):
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        committed = ckpt.commit(2, model=model, optimizer=optimizer)
    manifest = json.loads((committed.path / "manifest.json").read_text())
    assert manifest["metadata"]["writer"] == "trainpod.Checkpointer"
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "rng.pt", "extra.json"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_model_optimizer_and_cuda_rng_round_trip_exactly(tmp_path):
    torch.manual_seed(0)
    model = TiedModel().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model.head(model.embed(torch.tensor([1, 2, 3], device="cuda"))).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(1, model=model, optimizer=optimizer)
        expected = torch.rand(4, device="cuda")
    fresh = TiedModel().cuda()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        restored = ckpt.restore()
        restored.load("model", fresh)
        restored.load("optimizer", fresh_optimizer)
        restored.restore_rng()
    assert torch.equal(torch.rand(4, device="cuda"), expected), "the CUDA generator continues where it was"
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.embed.weight.device.type == "cuda"


def test_a_step_older_than_latest_is_exit_2_and_the_newer_checkpoints_stay(tmp_path, caplog):
    # Committed, LATEST moved backwards, and the next start deleted step-200 and step-300 as leftovers.
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:
        for step in (100, 200, 300):
            ckpt.commit(step, model=model)
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:  # a start that forgot restore()
        refused_with_exit_2(lambda: ckpt.commit(10, model=model), caplog)
    assert (
        "step=10 is older than the newest committed checkpoint" in caplog.text and "step-300" in caplog.text
    )
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:
        ckpt.commit(300, model=model)  # the same step again stays allowed (a stop right after a resume)
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:
        assert ckpt.restore().step == 300
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-200", "step-300"]


@pytest.mark.parametrize(
    "step", [10 / 2, -1, torch.tensor(5), True], ids=["float", "negative", "tensor", "bool"]
)
def test_a_step_that_is_no_whole_number_is_exit_2_not_committed_where_no_start_finds_it(
    tmp_path, step, caplog
):
    # step-5.0 was committed and named by LATEST, restore() found no step-<N> and every start began anew.
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:
        ckpt.commit(3, model=model)
        refused_with_exit_2(lambda: ckpt.commit(step, model=model), caplog)
        assert re.search(r"step=.* is not a whole number >= 0.*int\(step\)", caplog.text), caplog.text
        ckpt.commit(
            np.int64(4), model=model
        )  # numpy's integers (a step counted in an array) are whole numbers
    with Checkpointer(tmp_path, watch_signals=False) as ckpt:
        assert ckpt.restore().step == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-3", "step-4"]


TWO_RANK_LOOP = """
import sys, time
import torch
import torch.distributed as dist
from trainpod import Checkpointer

dist.init_process_group("gloo")
rank, run = dist.get_rank(), sys.argv[1]
model = torch.nn.Linear(4, 4)
with Checkpointer(run) as ckpt:
    step = 0
    while True:
        grad = torch.ones(4)
        dist.all_reduce(grad)  # DDP's gradient all-reduce, in every step
        with torch.no_grad():
            model.weight.add_(grad.sum() * 1e-4)
        step += 1
        open(f"{run}/rank{rank}.step", "w").write(str(step))
        time.sleep(0.02)
        stop = ckpt.should_stop()
        if (rank == 0 or sys.argv[2] == "every-rank") and (step % 2 == 0 or (stop and ckpt.commit_fits())):
            ckpt.commit(step, model=model)
        if stop:
            open(f"{run}/rank{rank}.stopped", "w").write(str(step))
            ckpt.exit_preempted()
"""


@pytest.mark.parametrize("committing", ["rank-0", "every-rank"])
def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_its_commit(tmp_path, committing):
    """Each rank read its own flag: rank 1 stopped after step N, and rank 0 went on into step N+1's
    all-reduce, which failed (gloo; NCCL hangs) before it committed: the stop's commit was lost. And a
    rank that exited with its gloo group open was at times aborted at exit (SIGABRT), not 143. A loop that
    commits on every rank (README's, run under torchrun; every 2 steps here, so that the race shows) had
    both ranks rename the same step into place, and the second crashed (ENOTEMPTY)."""
    import socket
    import subprocess
    import sys
    import time

    from support import child_env

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "loop.py").write_text(TWO_RANK_LOOP)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "loop.py"), str(run), committing],
            env=child_env(
                {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ),
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 60
        while not (run / "rank1.step").exists() or int((run / "rank1.step").read_text() or 0) < 20:
            assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), "the ranks never ran"
            time.sleep(0.01)
        ranks[1].send_signal(signal.SIGTERM)  # one rank alone, as when the signal reaches them apart
        codes = [rank.wait(timeout=30) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    stopped = [
        (run / f"rank{r}.stopped").read_text() for r in range(2) if (run / f"rank{r}.stopped").exists()
    ]
    assert codes == [143, 143] and len(stopped) == 2 and stopped[0] == stopped[1], (codes, stopped)
    assert (run / "checkpoints/LATEST").read_text().strip() == f"step-{stopped[0]}", (
        "the stop's commit was lost"
    )


def test_should_stop_without_torch_distributed_is_this_processs_own_flag(tmp_path, signals_restored):
    ckpt = Checkpointer(tmp_path / "run", watch_signals=True)
    assert not ckpt.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckpt.should_stop() and ckpt.stop_requested


PER_RANK_STREAMS = """
import json, random, sys
import numpy as np
import torch
import torch.distributed as dist
from trainpod import Checkpointer

dist.init_process_group("gloo")
rank, run, out = dist.get_rank(), sys.argv[1], sys.argv[2]
torch.manual_seed(1000 + rank)  # a stream per rank, as nanoGPT seeds them (1337 + rank)
random.seed(2000 + rank)
np.random.seed(3000 + rank)
with Checkpointer(run, watch_signals=False) as ckpt:
    restored = ckpt.restore()
    if restored is None:
        torch.rand(3), random.random(), np.random.rand()  # step 1's batches and dropout
        ckpt.commit(1)  # on every rank, as README's loop does
    else:
        restored.restore_rng()
    draws = [torch.rand(1).item(), random.random(), float(np.random.rand())]  # step 2's
    open(f"{out}.rank{rank}.json", "w").write(json.dumps(draws))
dist.destroy_process_group()
"""


def run_two_ranks(script, *args: str) -> None:
    import socket
    import subprocess
    import sys

    from support import child_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=child_env(
                {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ),
        )
        for rank in range(2)
    ]
    try:
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            rank.kill()


def test_under_torchrun_every_rank_resumes_on_its_own_rng_stream(tmp_path):
    """Rank 0 alone committed, with its own RNG state, and restore_rng() loaded that one on every rank: a
    loop whose ranks draw from streams of their own (seeded by rank; dropout, batch sampling) resumed with
    every rank on rank 0's stream, drawing rank 0's batches and dropout masks from then on."""
    (tmp_path / "ranks.py").write_text(PER_RANK_STREAMS)
    run_two_ranks(tmp_path / "ranks.py", str(tmp_path / "run"), str(tmp_path / "uninterrupted"))
    run_two_ranks(tmp_path / "ranks.py", str(tmp_path / "run"), str(tmp_path / "resumed"))
    uninterrupted, resumed = (
        [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in range(2)]
        for name in ("uninterrupted", "resumed")
    )
    assert uninterrupted[0] != uninterrupted[1], "the ranks were seeded alike: the test shows nothing"
    assert resumed == uninterrupted, "a rank resumed on another rank's RNG stream, not its own"


def test_a_rank_other_than_0_restoring_leaves_rank_0s_commit_in_flight_alone(tmp_path, monkeypatch):
    """Rank 1 restored (and swept `*.tmp-*` as a kill's leftovers) while rank 0 was already writing step 1
    into its temp folder: rank 0's write failed with FileNotFoundError (seen in make test, two ranks)."""
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(1)
    in_flight = tmp_path / "run" / "checkpoints" / "step-2.tmp-0123456789ab"
    in_flight.mkdir()
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")  # rank 0 holds the lease
    monkeypatch.setenv("RANK", "1")
    restored = Checkpointer(tmp_path / "run", watch_signals=False).open().restore()
    assert restored is not None and restored.step == 1
    assert in_flight.is_dir(), "rank 1 removed rank 0's commit in flight"


def test_a_rank_without_an_rng_state_of_its_own_restores_rank_0s_and_says_why(tmp_path, monkeypatch, caplog):
    """A loop that commits on rank 0 only writes no state for the other ranks; a torn or rotten file is
    not loaded either."""
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        torch.manual_seed(5)
        ckpt.commit(1)  # rank 0 alone
        rank_0_draw = torch.rand(2)
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")  # rank 0 holds the lease
    monkeypatch.setenv("RANK", "1")
    ckpt = Checkpointer(tmp_path / "run", watch_signals=False).open()
    for damage in ["missing", "sha256"]:
        caplog.clear()
        ckpt.restore().restore_rng()
        assert torch.equal(torch.rand(2), rank_0_draw)
        assert "rank 1 restores rank 0's RNG state" in caplog.text and damage in caplog.text, caplog.text
        torch.manual_seed(6)
        ckpt.commit(1)  # this rank's own, for the next round to damage
        written = ckpt.rank_rng.path(1, 1)
        data = bytearray(written.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the state (the bulk of the file): bit rot
        written.write_bytes(data)


def test_ranks_rng_files_go_with_their_checkpoints_and_with_commits_that_never_happened(
    tmp_path, monkeypatch
):
    run = tmp_path / "run"
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")
    as_rank_0 = Checkpointer(run, keep_last=2, watch_signals=False).open()
    monkeypatch.setenv("RANK", "1")
    as_rank_1 = Checkpointer(run, keep_last=2, watch_signals=False).open()
    rng_files = run / "checkpoints/rng"
    for step in (1, 2, 3):
        as_rank_1.commit(step)
        monkeypatch.setenv("RANK", "0")
        as_rank_0.commit(step)
        monkeypatch.setenv("RANK", "1")
    assert sorted(p.name for p in rng_files.iterdir()) == ["step-2.rank-1.pt", "step-3.rank-1.pt"]
    as_rank_1.commit(4)  # rank 0 was killed before committing step 4
    (rng_files / "step-3.rank-1.pt.tmp-0123456789ab").write_bytes(b"torn")  # a kill mid-write
    before_resume = (rng_files / "step-3.rank-1.pt").read_bytes()
    torch.manual_seed(9)
    assert Checkpointer(run, watch_signals=False).restore().step == 3
    assert sorted(p.name for p in rng_files.iterdir()) == ["step-2.rank-1.pt", "step-3.rank-1.pt"]
    as_rank_1.commit(3)  # a stop right after the resume: the committed step-3 stays, and its state with it
    assert (rng_files / "step-3.rank-1.pt").read_bytes() == before_resume
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "rng", "step-2", "step-3"]
    from trainpod.checkpoint import CheckpointStore
    from trainpod.checkpoint.directory import verify_committed

    assert verify_committed(CheckpointStore(run / "checkpoints"))[0].name == "step-3"


def test_at_a_stop_the_other_ranks_save_their_rng_state_whenever_rank_0_commits(tmp_path, monkeypatch):
    """README's loop commits at a stop where `ckpt.commit_fits()`, which each rank answers. Rank 0 answered by
    its last commit's measured time, another rank (which writes only its RNG state) by a guess from the
    checkpoint's size at 200 MB/s: rank 0 committed the stop's step and rank 1 left its RNG state out, so the
    resumed rank 1 drew rank 0's stream. (A 0.7 s window here stands for 5 s with a 1.5 GB checkpoint, which
    the guess puts at 8 s, written in 2 on a fast disk.)"""
    run = tmp_path / "run"
    model = torch.nn.Linear(64, 64)
    monkeypatch.setenv("TRAINPOD_LEASE_HELD", "1")  # the kit holds the run's lease for a command program
    ranks = {}
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        ranks[rank] = Checkpointer(run, window_seconds=0.7, watch_signals=False).open()

    def loop_step(step: int, stop: bool) -> None:
        """README's loop after `step` on each rank (rank 1's commit first, as ranks run apart)."""
        for rank in (1, 0):
            monkeypatch.setenv("RANK", str(rank))
            if stop:
                ranks[rank].watch.request("SIGTERM")
            torch.manual_seed(100 * rank + step)  # each rank's own stream
            if step % 2 == 0 or (stop and ranks[rank].commit_fits()):
                ranks[rank].commit(step, model=model)

    loop_step(2, stop=False)
    loop_step(3, stop=True)
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-3", "rank 0's commit fits the window"
    monkeypatch.setenv("RANK", "1")
    torch.manual_seed(100 + 3)
    expected = torch.rand(3)
    Checkpointer(run, watch_signals=False).open().restore().restore_rng()
    assert torch.equal(torch.rand(3), expected), "rank 1 resumed on rank 0's RNG stream, not its own"


def test_a_state_that_would_not_load_back_is_exit_2_at_the_commit_not_at_every_restore(tmp_path, caplog):
    """A state with a numpy value (a position counted in an array, np.random.get_state()) was committed, and
    every later start failed to restore it: torch.load(weights_only=True) refuses numpy's types, so the run
    could not resume from any checkpoint it had made since. The commit now says so, and commits nothing."""
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        ckpt.commit(1, model=model, optimizer=optimizer, sampler={"epoch": 0, "position": 5})
        refused_with_exit_2(
            lambda: ckpt.commit(
                2, model=model, optimizer=optimizer, sampler={"epoch": 0, "position": np.int64(9)}
            ),
            caplog,
        )
        assert re.search(r"sampler.*would not load back.*numpy.*int\(x\)", caplog.text), caplog.text
        restored = ckpt.restore()
        assert restored.step == 1
        assert restored.object("sampler") == {"epoch": 0, "position": 5}


Position = namedtuple("Position", "epoch index")  # module level: pickle finds a class by its name


def test_a_state_holding_a_named_tuple_is_refused_with_the_same_message_not_a_type_error(tmp_path, caplog):
    """The check rebuilds the state's containers without their tensors: a namedtuple, which cannot be rebuilt
    from one iterable, crashed the commit with a TypeError (exit 1) instead of saying what would not load."""
    model, optimizer = trained_pair()
    with Checkpointer(tmp_path / "run", watch_signals=False) as ckpt:
        refused_with_exit_2(
            lambda: ckpt.commit(
                1, model=model, optimizer=optimizer, sampler={"at": Position(0, torch.tensor(5))}
            ),
            caplog,
        )
    assert re.search(r"sampler.*would not load back.*Position", caplog.text), caplog.text


@pytest.mark.parametrize("given", [{"keep_last": 1}, {"keep_last": 0}, {"env": "1"}])
def test_a_checkpointer_keeping_fewer_than_two_checkpoints_is_exit_2_as_the_workloads_refuse_it(
    given, tmp_path, monkeypatch, caplog
):
    """checkpoint.keep_last and `trainpod checkpoint commit --keep-last` refuse 1: a newest checkpoint that fails
    verification at the next start then has no older one to fall back to, and the run starts over. The
    Checkpointer took it, from its argument or TRAINPOD_KEEP_LAST, and kept one."""
    if "env" in given:
        monkeypatch.setenv("TRAINPOD_KEEP_LAST", given["env"])
    where = "TRAINPOD_KEEP_LAST" if "env" in given else r"Checkpointer\(keep_last=\.\.\.\)"
    refused_with_exit_2(
        lambda: Checkpointer(tmp_path / "run", keep_last=given.get("keep_last"), watch_signals=False), caplog
    )
    assert re.search(rf"{where}=\d: keep at least 2 checkpoints", caplog.text), caplog.text
    assert not (tmp_path / "run").exists(), "nothing is made for a refused setting"


@pytest.mark.parametrize("variable", ["TRAINPOD_KEEP_LAST", "TRAINPOD_KEEP_BEST"])
@pytest.mark.parametrize("value", ["³", "two"])
def test_a_retention_variable_that_is_no_whole_number_is_exit_2_naming_it(
    tmp_path, monkeypatch, caplog, variable, value
):
    """'³' is a digit to str.isdigit but no number to int(): the Checkpointer crashed with a ValueError traceback
    (exit 1), where 'two' was refused with its line."""
    monkeypatch.setenv(variable, value)
    refused_with_exit_2(lambda: Checkpointer(tmp_path / "run", watch_signals=False), caplog)
    assert f"{variable}={value!r} is not a whole number; set it like {variable}=2" in caplog.text, caplog.text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["five", "nan", "inf", "-3"])
def test_a_stop_window_that_is_no_number_of_seconds_is_exit_2_naming_it(tmp_path, monkeypatch, caplog, value):
    """float() took 'nan', 'inf' and '-3' for TRAINPOD_PREEMPTION_WINDOW_S: a window no commit at a stop could be
    measured against."""
    monkeypatch.setenv("TRAINPOD_PREEMPTION_WINDOW_S", value)
    refused_with_exit_2(lambda: Checkpointer(tmp_path / "run", watch_signals=False), caplog)
    assert f"TRAINPOD_PREEMPTION_WINDOW_S={value!r} is not a number of seconds >= 0" in caplog.text, (
        caplog.text
    )


class TakenOverWhileItsStateIsRead:
    """A state whose state_dict() takes long (a gather of a large model, a stalled network volume): meanwhile
    another pod takes the run's lease over, and this process's heartbeat finds it taken."""

    def __init__(self, lease):
        self.lease = lease

    def state_dict(self):
        held = json.loads(self.lease.path.read_text())
        held["owner"] = {"id": "rival", "host": "elsewhere", "pid": 7, "pod_id": "pod-rival"}
        self.lease.path.write_text(json.dumps(held))
        assert self.lease.lost.wait(10), "the heartbeat must find the lease another writer's"
        return {"position": 2}


def test_a_commit_during_which_the_lease_was_taken_over_is_not_published(tmp_path):
    """The lease was looked at before a commit only: one lost during it (minutes for a large model on the
    network volume) was published all the same, LATEST and retention moved under the writer that took the run
    over. It is now refused at the commit point (exit 75), LATEST left as it was."""
    from trainpod.checkpoint import Lease

    run = tmp_path / "run"
    run.mkdir()
    model, optimizer = trained_pair()
    ckpt = Checkpointer(run, watch_signals=False)
    ckpt.lease = Lease(run / "LEASE", ttl_seconds=0.8)  # a heartbeat every 0.2 s
    ckpt.lease.acquire()
    with ckpt.open():
        ckpt.commit(1, model=model)
        with pytest.raises(SystemExit) as exited:
            ckpt.commit(2, model=model, loader=TakenOverWhileItsStateIsRead(ckpt.lease))
        assert exited.value.code == 75
    checkpoints = run / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "step-1"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == ["step-1"]
    assert json.loads((run / "LEASE").read_text())["owner"]["id"] == "rival", "the new writer's lease stays"


LOSES_ITS_LEASE = """
import json, sys
from pathlib import Path
import torch
from trainpod import Checkpointer
run = Path(sys.argv[1])
with Checkpointer(run, watch_signals=False) as ckpt:
    ckpt.commit(1, weights={"w": torch.zeros(2)})
    held = json.loads((run / "LEASE").read_text())
    held["owner"] = {"id": "rival", "host": "elsewhere", "pid": 7, "pod_id": "pod-rival"}
    (run / "LEASE").write_text(json.dumps(held))  # another pod took the run over: this one stalled
    ckpt.lease.lost.set()  # what its next heartbeat finds
    ckpt.commit(2, weights={"w": torch.ones(2)})
print("went on after the lease was lost")
"""


def test_a_loop_run_alone_whose_lease_was_lost_exits_75_naming_the_writer_that_took_the_run_over(tmp_path):
    """Run outside the command workload, the loop's commit raised TemporaryError: a traceback and exit 1, a crash
    to count, where the README's table gives exit 75 for a run leased by another writer (as the HF callback
    and the kit's own workloads end). It is one error line and exit 75, nothing committed, the lease left."""
    import subprocess
    import sys

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", LOSES_ITS_LEASE, str(run)], capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 75, output
    assert "another writer (pod pod-rival, host elsewhere, pid 7) took this run over" in output, output
    assert "step 2 is not committed" in output and "Traceback" not in output, output
    assert "went on" not in output
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-1"
    assert json.loads((run / "LEASE").read_text())["owner"]["id"] == "rival", "the new writer's lease stays"


def test_a_first_commit_on_a_full_volume_exits_5_naming_the_step_not_a_crash(tmp_path, monkeypatch):
    """Run alone, a commit that filled the volume was an OSError out of the loop: exit 1, retried at every
    start into the same full volume. It is exit 5 with the volume's line, the first commit as any later one."""
    import errno

    from trainpod.checkpoint.writer import CheckpointWriter

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CheckpointWriter, "commit", full)
    ckpt = Checkpointer(tmp_path / "run", watch_signals=False).open()
    with pytest.raises(SystemExit) as exited:
        ckpt.commit(1, weights={"w": torch.zeros(2)})
    assert exited.value.code == 5
    assert not (tmp_path / "run/LEASE").exists(), "released"


def test_a_checkpointer_given_the_checkpoints_folder_for_its_run_is_exit_2(tmp_path, monkeypatch, caplog):
    """Checkpointer(os.environ["TRAINPOD_CHECKPOINT_DIR"]) restored nothing from checkpoints/checkpoints/ and
    committed there, where no start of the kit, `trainpod status` or `pull` looks."""
    folder = tmp_path / "run/checkpoints"
    folder.mkdir(parents=True)
    monkeypatch.setenv("TRAINPOD_CHECKPOINT_DIR", str(folder))
    refused_with_exit_2(lambda: Checkpointer(folder, watch_signals=False), caplog)
    assert re.search(r"TRAINPOD_CHECKPOINT_DIR.*TRAINPOD_RUN_DIR", caplog.text), caplog.text
    assert not (folder / "checkpoints").exists()


REFUSED_COMMITS = """
import sys, numpy as np, torch
from trainpod import Checkpointer
ckpt = Checkpointer(sys.argv[1]).open()
ckpt.commit(10, model=torch.nn.Linear(2, 2))
refused = {"older": (5, {}), "float": (12 / 2, {}), "numpy": (11, {"sampler": {"position": np.int64(9)}})}
step, states = refused[sys.argv[2]]
ckpt.commit(step, model=torch.nn.Linear(2, 2), **states)
print("went on after the refused commit")
"""


def exits_2(program: str, run, refused: str) -> str:
    """Run `program` (python -c) on the run folder `run` with the case `refused`: its output, once it exited 2."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", program, str(run), refused], capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    return output


@pytest.mark.parametrize(
    "refused, said",
    [
        ("older", "step=5 is older than the newest committed checkpoint"),
        ("float", "step=6.0 is not a whole number >= 0"),
        ("numpy", "the state 'sampler' would not load back"),
    ],
)
def test_a_program_whose_commit_is_refused_exits_2_with_one_line_and_the_committed_step_stays(
    tmp_path, refused, said
):
    """The README promises exit 2 for these: the refusal was an InputError out of the program's loop, a traceback
    and exit 1, a crash that every start repeated (and counted) into the same refusal."""
    run = tmp_path / "run"
    output = exits_2(REFUSED_COMMITS, run, refused)
    assert said in output and "Traceback" not in output and "went on" not in output, output
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-10"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-10"], (
        "nothing else written"
    )
    assert not (run / "LEASE").exists(), "the lease is released at the exit"


REFUSED_SETUPS = """
import os, sys, torch
from trainpod import Checkpointer
run, case = sys.argv[1], sys.argv[2]
with Checkpointer(run) as ckpt:
    ckpt.commit(10, model=torch.nn.Linear(2, 2))
if case == "keep_last":
    Checkpointer(run, keep_last=1)
elif case == "checkpoints folder":
    Checkpointer(os.path.join(run, "checkpoints"))
elif case == "env":
    os.environ["TRAINPOD_KEEP_BEST"] = "\u00b3"
    Checkpointer(run)
else:
    with Checkpointer(run) as ckpt:
        ckpt.restore().load("ema", torch.nn.Linear(2, 2))
print("went on after the refusal")
"""


@pytest.mark.parametrize(
    "refused, said",
    [
        ("keep_last", "Checkpointer(keep_last=...)=1: keep at least 2 checkpoints"),
        ("checkpoints folder", "checkpoints is not a run folder: it holds checkpoints itself"),
        ("env", "TRAINPOD_KEEP_BEST='\u00b3' is not a whole number"),
        ("load", "checkpoint step-10 holds no state named 'ema'"),
    ],
)
def test_a_program_whose_checkpointer_or_restore_is_refused_exits_2_with_one_line_and_nothing_touched(
    tmp_path, refused, said
):
    """Each was an error out of the program (InputError; a ValueError for '\u00b3'): a traceback and exit 1, a
    crash that every start repeated (and counted) into the same refusal. The committed step stays as it was, no
    store is made in the wrong folder, and the lease is released."""
    run = tmp_path / "run"
    output = exits_2(REFUSED_SETUPS, run, refused)
    assert "Traceback" not in output and "went on" not in output, output
    *_, line, last = output.splitlines()
    assert said in line and last == "exiting 2", output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-10"], (
        "nothing else written"
    )
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-10"
    assert not (run / "LEASE").exists(), "the lease is released at the exit"
