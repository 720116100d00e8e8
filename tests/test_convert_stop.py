"""A stop in the middle of a conversion: a real `trainpod run convert` process gets a real SIGTERM while it
writes the merged model, and must end at once, exit 143, publish nothing and release the run's lease.

A spot pod gets SIGKILL 5 s after the SIGTERM. Convert looked at the stop only between tasks, so a merge of
a large model ran on into the SIGKILL with the lease held, and the next start on another host waited its
300 s out. The driver below holds the merge at its first tensor until the SIGTERM has come, then lets the
merge go on, as a long one would.

.venv/bin/pytest -q tests/test_convert_stop.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainpod.errors import ExitCode

from convert_support import make_adapter, make_base
from support import run_trainpod, sigterm_once_marked

DRIVER = """
import ctypes, os, runpy, sys, threading
from pathlib import Path
from trainpod import preemption
from trainpod.convert import output

signalled = threading.Event()
preemption.call_at_first_signal(signalled.set)
real_write_tensors = output.Staging.write_tensors


def one_endless_c_call():
    # Like one shard written by save_pretrained: a C call that releases the GIL and runs on through
    # signals, so the signal's Python handler never gets its turn. A mutex locked twice never returns.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    Path(os.environ["STOP_MARKER"]).touch()
    libc.pthread_mutex_lock(mutex)


def write_tensors(self, name, file, fill):
    def fill_and_wait_for_the_stop(tensor_name, slot):
        fill(tensor_name, slot)
        if os.environ.get("STUCK_IN_C"):
            one_endless_c_call()
        if not signalled.is_set():
            Path(os.environ["STOP_MARKER"]).touch()
            while not signalled.is_set():  # the test's SIGTERM comes while this merge is under way
                signalled.wait(0.01)
    real_write_tensors(self, name, file, fill_and_wait_for_the_stop)

output.Staging.write_tensors = write_tensors
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    root = tmp_path / "volume"
    base = make_base(root / "models" / "base")
    make_adapter(base, root / "runs" / "ft" / "export" / "adapter")
    return root


def convert_args(volume: Path) -> tuple[str, ...]:
    config = volume / "convert.yaml"
    config.write_text(
        json.dumps({"name": "ft", "base_model": str(volume / "models" / "base"), "task": ["merge"]})
    )
    return ("run", "convert", "--config", str(config))


def start_merge_and_stop_it(volume: Path, tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    """Start the convert, wait until the merge is under way, SIGTERM it; its exit code and output."""
    return sigterm_once_marked(DRIVER, convert_args(volume), volume, tmp_path / "merging", env, "merge")


def test_a_sigterm_during_a_merge_ends_it_at_once_with_nothing_published_and_the_lease_released(
    volume: Path, tmp_path: Path
) -> None:
    code, out = start_merge_and_stop_it(volume, tmp_path, {})
    export = volume / "runs" / "ft" / "export"
    assert code == ExitCode.PREEMPTED, f"a stop mid-merge must exit 143:\n{out}"
    assert not (export / "merged").exists(), f"a merge stopped midway was published:\n{out}"
    assert not (volume / "runs" / "ft" / "LEASE").exists(), (
        "the stopped convert kept the run's lease: a new pod on another host would wait out its TTL"
    )
    assert "stopped by SIGTERM" in out and "Traceback" not in out, out

    resumed = run_trainpod(*convert_args(volume), volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert (export / "merged" / "manifest.json").is_file()
    assert not list(export.glob("*.tmp-*")), "the next start must remove what the stopped merge left"


def test_a_sigterm_during_one_long_write_releases_the_lease_and_exits_143_before_the_window_ends(
    volume: Path, tmp_path: Path
) -> None:
    """The merge is stuck in one C call that never returns (save_pretrained writing a 50 GB shard, made
    endless): the signal's handler cannot run, so a thread releases the lease and exits 143."""
    code, out = start_merge_and_stop_it(volume, tmp_path, {"STUCK_IN_C": "1"})
    assert code == ExitCode.PREEMPTED, f"a stop during one long write must still exit 143:\n{out}"
    assert not (volume / "runs" / "ft" / "LEASE").exists(), f"the lease was not released:\n{out}"
    assert not (volume / "runs" / "ft" / "export" / "merged").exists()
    resumed = run_trainpod(*convert_args(volume), volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert not list((volume / "runs" / "ft" / "export").glob("*.tmp-*"))


def test_a_stopped_tasks_temp_folder_goes_at_the_next_start_even_when_the_task_is_no_longer_configured(
    volume: Path, tmp_path: Path
) -> None:
    code, out = start_merge_and_stop_it(volume, tmp_path, {})
    assert code == ExitCode.PREEMPTED, out
    export = volume / "runs" / "ft" / "export"
    assert list(export.glob("merged.tmp-*")), "the stopped merge leaves its temp folder, as a kill does"
    config = volume / "mlx.yaml"
    config.write_text(
        json.dumps({"name": "ft", "base_model": str(volume / "models" / "base"), "task": ["mlx"]})
    )
    result = run_trainpod("run", "convert", "--config", str(config), volume=volume)
    assert result.returncode == ExitCode.DONE, result.stdout + result.stderr
    assert not list(export.glob("*.tmp-*")), "the merge's temp folder was left for good"
