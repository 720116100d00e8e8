"""What a pod does after its workload exits (runpod/finish.py), against the fake RunPod API (the
mock of RunPod): TRAINPOD_ON_FINISH stop/terminate/idle with the pod's own key, and the crash-loop
counter on the volume that marks the run FAILED and stops the pod."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod import atomic
from trainpod import boot as boot_module
from trainpod.checkpoint.lease import Lease
from trainpod.errors import TemporaryError
from trainpod.preemption import first_signal_seen
from trainpod.runpod.finish import (
    FAILED_MARKER,
    KILLED,
    START_MARKER,
    STARTS_FILE,
    after_workload,
    begin_start,
)
from trainpod.volume import Volume

from fake_runpod import api_env, client_for
from support import (
    RUN,
    TINY_DATAGEN,
    TINY_PRETRAIN,
    child_env,
    signal_when_step_reached,
    start_trainpod,
    status_step,
)


@pytest.fixture
def pod(fake) -> dict:
    body = {"name": "tiny-pretrain", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"], "interruptible": True}
    pod = fake.pods[client_for(fake).create_pod(body).id]
    fake.requests.clear()
    return pod


def pod_env(fake, pod, **extra) -> dict[str, str]:
    return {**api_env(fake), "RUNPOD_POD_ID": pod["id"], **extra}


def command_pod(
    fake, pod, tmp_path, name: str, program: str, max_failed_starts: int
) -> tuple[Path, Path, dict[str, str]]:
    """A pod's environment for `trainpod boot` of a command run `name` running `program` (its prog.py): the
    repo folder, the volume and the env."""
    workdir, volume = tmp_path / "repo", tmp_path / "volume"
    workdir.mkdir()
    volume.mkdir()
    (workdir / "prog.py").write_text(program)
    config = tmp_path / "command.yaml"
    config.write_text(f"name: {name}\ncommand: [python, prog.py]\nworkdir: {workdir}\n")
    env = {
        **pod_env(fake, pod),
        "TRAINPOD_VOLUME": str(volume),
        "TRAINPOD_WORKLOAD": "command",
        "TRAINPOD_CONFIG": str(config),
        "TRAINPOD_MAX_FAILED_STARTS": str(max_failed_starts),
    }
    return workdir, volume, env


@pytest.fixture
def run(tmp_path):
    run = Volume(tmp_path).run("tiny")
    run.create()
    return run


@pytest.mark.parametrize(
    ("action", "expected"), [("stop", "EXITED"), ("terminate", None), ("idle", "RUNNING")]
)
def test_after_done_the_pod_acts_on_trainpod_on_finish(fake, pod, run, action, expected):
    env = pod_env(fake, pod, TRAINPOD_ON_FINISH=action)
    assert after_workload(0, run, env, "pretrain") == 0
    status = fake.pods[pod["id"]]["desiredStatus"] if pod["id"] in fake.pods else None
    assert status == expected
    if action == "idle":
        assert fake.requests == []


def test_a_stop_answered_with_a_body_that_is_not_json_still_counts_as_done(fake, pod, run, caplog):
    """RunPod's description of POST /pods/{id}/stop declares no content for its 200, and RunPod's own
    clients take any non-JSON answer to a pod action as success. Decoding it raised out of the finish
    hook: the pod was stopped, but boot crashed after DONE."""
    from fake_runpod import LogStream

    handle = fake.handle

    def plain_text_answer(method, raw_path, headers, raw_body):
        status, result, extra = handle(method, raw_path, headers, raw_body)
        if raw_path.endswith("/stop") and status == 200:
            return status, LogStream(iter([b"Pod stopped"])), {"Content-Type": "text/plain"}
        return status, result, extra

    fake.handle = plain_text_answer
    with caplog.at_level(logging.INFO):
        assert after_workload(0, run, pod_env(fake, pod), "pretrain") == 0
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert f"asked RunPod to stop this pod ({pod['id']})" in caplog.text


def test_without_the_pods_key_it_says_so_and_exits_normally(fake, pod, run, caplog):
    env = {"RUNPOD_POD_ID": pod["id"], "TRAINPOD_RUNPOD_API_URL": fake.url}
    with caplog.at_level(logging.INFO):
        assert after_workload(0, run, env, "pretrain") == 0
    assert f"cannot stop pod {pod['id']}: RUNPOD_API_KEY is not set" in caplog.text
    assert fake.requests == [] and fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


def test_outside_a_pod_there_is_nothing_to_stop(fake, run, caplog):
    with caplog.at_level(logging.INFO):
        assert after_workload(0, run, {}, "pretrain") == 0
    assert "not in a RunPod pod (RUNPOD_POD_ID unset)" in caplog.text


def test_an_api_failure_while_stopping_keeps_the_exit_code(fake, pod, run, caplog):
    fake.fail_next(503, times=10)
    env = pod_env(fake, pod)
    from trainpod.runpod.client import RunPodClient

    def factory(environ):
        return RunPodClient.from_env(environ, sleep=lambda s: None)

    assert after_workload(0, run, env, "pretrain", client_factory=factory) == 0
    assert "could not stop this pod" in caplog.text and fake.key not in caplog.text


def test_failed_starts_are_counted_and_the_third_marks_the_run_failed_and_stops_the_pod(fake, pod, run):
    env = pod_env(fake, pod)
    for count in (1, 2):
        assert after_workload(1, run, env, "pretrain") == 1
        assert atomic.read_json(run.root / STARTS_FILE)["consecutive_failures"] == count
        assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "RunPod restarts the container"
    assert after_workload(75, run, env, "pretrain") == 75
    failed = atomic.read_json(run.root / FAILED_MARKER)
    assert failed["failures"] == 3 and "3 failed starts in a row, the last with exit 75" in failed["reason"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_successful_or_preempted_start_resets_the_count(fake, pod, run):
    env = pod_env(fake, pod, TRAINPOD_ON_FINISH="idle", TRAINPOD_MAX_FAILED_STARTS="2")
    after_workload(1, run, env, "pretrain")
    after_workload(143, run, env, "pretrain")
    assert not (run.root / STARTS_FILE).exists()
    after_workload(1, run, env, "pretrain")
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "1 failure since the reset, 2 allowed"


@pytest.mark.parametrize("workload", ["convert", "datagen"])
def test_a_convert_or_datagen_pod_under_a_runs_name_never_marks_that_run(fake, pod, run, workload):
    """A convert of a DONE run that keeps failing stops its pod, but the run stays DONE, not FAILED (a
    supervisor would stop the run's pods); its success leaves a FAILED training run FAILED."""
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="2")
    atomic.write_json(run.root / STARTS_FILE, {"consecutive_failures": 1, "last_exit_code": 1})
    for code in (1, 1):
        after_workload(code, run, env, workload, owns_run=False)
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "its own crash loop still stops the pod"
    assert atomic.read_json(run.root / f"starts-{workload}.json")["consecutive_failures"] == 2
    assert atomic.read_json(run.root / STARTS_FILE)["consecutive_failures"] == 1, "the run's count is its own"
    assert not (run.root / FAILED_MARKER).exists()
    after_workload(2, run, env, workload, owns_run=False)
    assert not (run.root / FAILED_MARKER).exists()

    atomic.write_json(run.root / FAILED_MARKER, {"reason": "the training's crash loop"})
    after_workload(0, run, pod_env(fake, pod, TRAINPOD_ON_FINISH="idle"), workload, owns_run=False)
    assert not (run.root / f"starts-{workload}.json").exists()
    assert (run.root / FAILED_MARKER).exists() and (run.root / STARTS_FILE).exists()


def test_bad_input_stops_the_pod_at_once_and_marks_an_existing_run(fake, pod, run):
    assert after_workload(2, run, pod_env(fake, pod), "pretrain") == 2
    assert "bad config or input (exit 2)" in atomic.read_json(run.root / FAILED_MARKER)["reason"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_full_volume_stops_the_pod_at_once_instead_of_a_restart_loop(fake, pod, run):
    assert after_workload(5, run, pod_env(fake, pod), "pretrain") == 5
    assert "volume full (exit 5)" in atomic.read_json(run.root / FAILED_MARKER)["reason"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert not (run.root / STARTS_FILE).exists(), "not counted as a failed start: it is final at once"


def test_a_done_runs_pod_booted_again_stops_and_never_marks_the_finished_run_failed(fake, pod, run, tmp_path):
    """The pod of a finished run started again (by hand, to reach the volume) after its branch was merged and
    deleted: the git sync's exit 2 wrote FAILED into the DONE run, and a supervisor then reported the finished
    run as FAILED (exit 2). A 75 counted failed starts in it the same way."""
    atomic.write_json(run.done, {"exit_code": 0})
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "1"],
                   cwd=repo, check=True)  # fmt: skip
    environ = pod_env(
        fake,
        pod,
        TRAINPOD_VOLUME=str(run.root.parent.parent),
        TRAINPOD_WORKLOAD="command",
        TRAINPOD_CONFIG="command.yaml",
        TRAINPOD_RUN=run.name,
        TRAINPOD_GIT_REPO=f"file://{repo}",
        TRAINPOD_GIT_REF="feature-merged-and-deleted",
    )
    assert boot_module.boot(environ) == 2
    assert not (run.root / FAILED_MARKER).exists(), "the run is DONE, not FAILED"
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "the pod stops as after DONE"

    fake.pods[pod["id"]]["desiredStatus"] = "RUNNING"
    assert after_workload(75, run, pod_env(fake, pod), "command") == 75
    assert not (run.root / STARTS_FILE).exists() and not (run.root / FAILED_MARKER).exists()
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_bad_input_leaves_a_volume_without_the_run_untouched(fake, pod, tmp_path):
    after_workload(2, Volume(tmp_path).run("new"), pod_env(fake, pod), "pretrain")
    assert list(tmp_path.iterdir()) == []
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_supervisor_pod_stops_itself_when_done_but_retries_a_temporary_failure(fake, pod, run):
    assert after_workload(75, run, pod_env(fake, pod), "supervise") == 75
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"
    assert after_workload(0, run, pod_env(fake, pod), "supervise") == 0
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert not (run.root / STARTS_FILE).exists(), "the supervisor's exits never count as the run's"


@pytest.mark.parametrize("value", ["three", "x", "0", "³"])  # '³': a digit to str.isdigit, a crash to int()
def test_a_malformed_max_failed_starts_exits_2_at_boot(tmp_path, capsys, value):
    environ = {
        "TRAINPOD_VOLUME": str(tmp_path),
        "TRAINPOD_WORKLOAD": "datagen",
        "TRAINPOD_CONFIG": str(TINY_DATAGEN),
        "TRAINPOD_MAX_FAILED_STARTS": value,
    }
    assert boot_module.boot(environ) == 2
    assert (
        f"TRAINPOD_MAX_FAILED_STARTS={value!r} is not a whole number >= 1; set it like"
        in capsys.readouterr().out
    )
    assert list(tmp_path.iterdir()) == []


def test_a_real_boot_stops_its_own_pod_after_done(fake, pod, tmp_path):
    env = child_env(
        {
            **pod_env(fake, pod),
            "TRAINPOD_VOLUME": str(tmp_path),
            "TRAINPOD_WORKLOAD": "datagen",
            "TRAINPOD_CONFIG": str(TINY_DATAGEN),
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert f"asked RunPod to stop this pod ({pod['id']})" in result.stdout
    assert fake.key not in result.stdout + result.stderr


def test_a_pod_given_a_budget_and_no_price_counts_its_cost_at_the_price_runpod_bills_it(fake, pod, volume):
    """deploy sends a single pod's budget without a price (which GPU type RunPod places it on decides that):
    the pod reads its own price with its pod-scoped key, and the budget stops the run (exit 3) as with a
    price given. Before, such a budget was exit 2 at every start, or no cap at all."""
    env = child_env(
        {
            **pod_env(fake, pod),
            "TRAINPOD_VOLUME": str(volume),
            "TRAINPOD_WORKLOAD": "pretrain",
            "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
            "TRAINPOD_BUDGET_USD": "0.000001",  # a fraction of a second at $2/h: spent at the first step
        }
    )
    env.pop("TRAINPOD_GPU_HOURLY_USD", None)
    result = subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"this pod's price, from RunPod: ${pod['costPerHr']:g}/h" in result.stdout + result.stderr
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "a spent budget stops the pod"
    assert fake.key not in result.stdout + result.stderr


def test_a_real_convert_boot_that_fails_under_a_done_runs_name_leaves_the_run_done(fake, pod, tmp_path):
    run = Volume(tmp_path).run("tiny")
    run.create()
    atomic.write_json(run.done, {"step": 10})
    env = child_env(
        {
            **pod_env(fake, pod),
            "TRAINPOD_VOLUME": str(tmp_path),
            "TRAINPOD_RUN": "tiny",
            "TRAINPOD_WORKLOAD": "convert",
            "TRAINPOD_CONFIG": str(tmp_path / "no-such-convert.yaml"),
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "bad input stops the pod at once"
    assert not (run.root / FAILED_MARKER).exists() and run.done.exists()


def test_a_convert_pod_whose_merge_the_oom_killer_took_is_counted_and_stops_at_the_bound(fake, pod, tmp_path):
    """A convert pod's merge killed without a word (no exit code) was counted nowhere: a DONE run has no START,
    and the container started again converted into the same kill at every start, billed for good."""
    run = Volume(tmp_path).run("tiny")
    run.create()
    atomic.write_json(run.done, {"step": 10})
    convert = tmp_path / "convert.yaml"
    convert.write_text("name: tiny\ntask:\n  - kind: export\n")
    env = {
        **pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="2"),
        "TRAINPOD_VOLUME": str(tmp_path),
        "TRAINPOD_RUN": "tiny",
        "TRAINPOD_WORKLOAD": "convert",
        "TRAINPOD_CONFIG": str(convert),
    }
    # What its start left when the kill came, as begin_start marks it; then this pod's container starts again.
    atomic.write_json(run.root / "START-convert", {"unix": 1.0, "latest": None, "pod": pod["id"]})
    boot_module.boot(dict(env))  # the export finds no checkpoint: exit 2 here, after the count
    assert atomic.read_json(run.root / "starts-convert.json")["consecutive_failures"] == 1
    atomic.remove(run.root / "starts-convert.json")
    fake.pods[pod["id"]]["desiredStatus"] = "RUNNING"
    atomic.write_json(run.root / "START-convert", {"unix": 1.0, "latest": None, "pod": pod["id"]})
    atomic.write_json(run.root / "starts-convert.json", {"consecutive_failures": 1, "last_exit_code": 137})
    assert boot_module.boot(dict(env)) == KILLED, "the bound: no conversion into the same kill"
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert run.done.exists() and not (run.root / FAILED_MARKER).exists(), "a convert never marks the run"


def test_a_conversions_marker_behind_a_newer_checkpoint_forgets_its_own_count_never_the_runs(fake, pod, run):
    """A conversion's start found dead behind a LATEST that moved since begins its own count again; it erased the
    run's starts.json instead, the training's crash loop count."""
    atomic.write_json(run.root / STARTS_FILE, {"consecutive_failures": 2, "last_exit_code": 1})
    atomic.write_json(run.root / "starts-convert.json", {"consecutive_failures": 1, "last_exit_code": 137})
    (run.checkpoints / "LATEST").parent.mkdir(parents=True, exist_ok=True)
    (run.checkpoints / "LATEST").write_text("step-20")
    atomic.write_json(run.root / "START-convert", {"unix": 1.0, "latest": "step-10", "pod": pod["id"]})
    assert begin_start(run, pod_env(fake, pod), "convert", owns_run=False) is None
    assert not (run.root / "starts-convert.json").exists(), "its own count begins again"
    assert atomic.read_json(run.root / STARTS_FILE)["consecutive_failures"] == 2, (
        "the run's count is the run's"
    )


# A start that died with boot's own process (a segfault, the OOM killer: no after_workload) leaves its
# START marker; the next start of the same pod counts it when no checkpoint was committed meanwhile.


def test_a_start_that_ended_without_a_word_and_committed_nothing_is_counted(fake, pod, run):
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="2")
    assert begin_start(run, env, "pretrain") is None  # this start dies here, taking boot with it
    assert atomic.read_json(run.root / START_MARKER)["pod"] == pod["id"]
    assert begin_start(run, env, "pretrain") is None, "one failure, two allowed: start again"
    starts = atomic.read_json(run.root / STARTS_FILE)
    assert (starts["consecutive_failures"], starts["last_exit_code"]) == (1, KILLED)
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"
    assert begin_start(run, env, "pretrain") == KILLED, "the second in a row: FAILED, not started"
    assert (
        "2 failed starts in a row, the last with exit 137"
        in atomic.read_json(run.root / FAILED_MARKER)["reason"]
    )
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert not (run.root / START_MARKER).exists()


def test_a_start_that_committed_a_checkpoint_or_ended_through_after_workload_is_not_counted(fake, pod, run):
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="1")
    begin_start(run, env, "pretrain")
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    (run.checkpoints / "LATEST").write_text("step-10\n")  # it committed, then was killed: it made progress
    assert begin_start(run, env, "pretrain") is None
    after_workload(143, run, pod_env(fake, pod, TRAINPOD_ON_FINISH="idle"), "pretrain")  # a clean spot stop
    assert not (run.root / START_MARKER).exists()
    assert begin_start(run, env, "pretrain") is None
    assert not (run.root / STARTS_FILE).exists() and fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


def test_another_pods_start_marker_is_not_held_against_this_pod(fake, pod, run):
    """Two pods on one run (a duplicate, or the old one still stopping): the other's START may be alive."""
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="1")
    atomic.write_json(run.root / START_MARKER, {"unix": 0, "latest": None, "pod": "another-pod"})
    assert begin_start(run, env, "pretrain") is None
    assert not (run.root / STARTS_FILE).exists()


def test_a_duplicate_pod_leaves_the_start_marker_of_the_pod_that_trains_as_it_is(fake, pod, run, monkeypatch):
    """A second pod on a run whose lease a live pod holds wrote its own START over that pod's, and removed it at
    its exit 75: a death of the training pod without a word (the OOM killer) then went uncounted, its count
    begun anew by nobody. The duplicate now marks nothing in the run."""
    monkeypatch.setenv("RUNPOD_POD_ID", "the-pod-that-trains")
    training = Lease(run.lease, ttl_seconds=60)
    training.acquire()
    try:
        begin_start(run, pod_env(fake, {"id": "the-pod-that-trains"}), "pretrain")
        trains = atomic.read_json(run.root / START_MARKER)
        monkeypatch.setenv("RUNPOD_POD_ID", pod["id"])
        env = pod_env(fake, pod)
        assert begin_start(run, env, "pretrain") is None
        assert atomic.read_json(run.root / START_MARKER) == trains, "the duplicate wrote over the START"
        assert after_workload(75, run, env, "pretrain") == 75
        assert atomic.read_json(run.root / START_MARKER) == trains, "the duplicate removed the START"
        assert not (run.root / STARTS_FILE).exists()
    finally:
        training.release()


def lease_of_a_pod_that_died(run, seconds_left: float) -> None:
    """The run's LEASE of a pod on another machine, killed before it could release it: live for `seconds_left`
    more, never renewed."""
    now = time.time()
    owner = {"id": "its-lease", "host": "another-machine", "pod_id": "the-pod-that-died", "pid": 1}
    atomic.write_json(run.lease, {"owner": owner, "heartbeat_unix": now, "expires_unix": now + seconds_left})


def takes_the_lease_over(run) -> Lease:
    """This pod's workload, waiting out the dead pod's lease and taking it over (the lifecycle's acquire)."""
    lease = Lease(run.lease, ttl_seconds=60)
    lease.takeover_settle_s = 0.0
    lease.acquire()
    return lease


def test_a_duplicate_that_takes_the_lease_over_marks_its_start_and_its_death_without_a_word_is_counted(
    fake, pod, run, monkeypatch
):
    """A pod that found the run leased by a live pod at boot wrote no START; when its workload then took the
    lease over (that pod had died, its lease expired unrenewed), it trained the run with no START of its own, and
    a death of it without a word (the OOM killer) was never counted: a crash loop of such starts never ended."""
    monkeypatch.setenv("RUNPOD_POD_ID", pod["id"])
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="1")
    atomic.write_json(run.root / START_MARKER, {"unix": 0, "latest": None, "pod": "the-pod-that-died"})
    lease_of_a_pod_that_died(run, seconds_left=1.5)
    assert begin_start(run, env, "pretrain") is None
    assert atomic.read_json(run.root / START_MARKER)["pod"] == "the-pod-that-died", (
        "a duplicate marks nothing"
    )
    takes_the_lease_over(run)  # and then dies there without a word, its lease left behind
    assert atomic.read_json(run.root / START_MARKER)["pod"] == pod["id"], "the run's writer has no START"
    assert not (run.root / STARTS_FILE).exists(), (
        "the dead pod's START is that pod's, not this pod's to count"
    )
    assert begin_start(run, env, "pretrain") == KILLED, "the start that took the run over died uncounted"
    assert atomic.read_json(run.root / FAILED_MARKER)["exit_code"] == KILLED
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_duplicate_stopped_while_it_waits_out_the_dead_pods_lease_leaves_no_start_at_its_takeover(
    fake, pod, run, monkeypatch
):
    """A spot stop that came while the duplicate's workload waited for the dead pod's lease to expire ran the
    first-signal hooks before the takeover wrote its START: that START outlived the platform's SIGKILL, and the
    next start counted the preemption as a death without a word."""
    monkeypatch.setenv("RUNPOD_POD_ID", pod["id"])
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="1")
    lease_of_a_pod_that_died(run, seconds_left=1.5)
    assert begin_start(run, env, "pretrain") is None
    first_signal_seen()  # the SIGTERM, as the workload's handler takes it, during the wait
    takes_the_lease_over(run)  # then the SIGKILL, before after_workload could remove anything
    assert not (run.root / START_MARKER).exists()
    assert begin_start(run, env, "pretrain") is None, "the preemption was counted as a death"
    assert not (run.root / STARTS_FILE).exists() and fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


def test_a_duplicate_refused_the_lease_leaves_nothing_for_a_later_acquire(fake, pod, run, monkeypatch):
    """What a duplicate leaves for its takeover is for its workload's one acquire: refused (the pod that trains
    renews its lease), a later acquire in the process marks nothing."""
    monkeypatch.setenv("RUNPOD_POD_ID", "the-pod-that-trains")
    training = Lease(run.lease, ttl_seconds=2)  # renewed every 0.5 s
    training.acquire()
    monkeypatch.setenv("RUNPOD_POD_ID", pod["id"])
    try:
        assert begin_start(run, pod_env(fake, pod), "pretrain") is None
        with pytest.raises(TemporaryError, match="leased by another writer"):
            Lease(run.lease).acquire()
    finally:
        training.release()
    takes_the_lease_over(run).release()
    assert not (run.root / START_MARKER).exists()


SILENTLY_KILLED_PROGRAM = """
import os, signal
os.kill(os.getppid(), signal.SIGKILL)  # the kit's process, as the OOM killer takes a pod's boot on one GPU
"""


def test_a_real_duplicate_boot_that_took_the_lease_over_and_died_without_a_word_is_counted(
    fake, pod, tmp_path
):
    workdir, volume, env = command_pod(
        fake, pod, tmp_path, "dup", SILENTLY_KILLED_PROGRAM, max_failed_starts=1
    )
    run = Volume(volume).run("dup")
    run.create()
    lease_of_a_pod_that_died(run, seconds_left=3)  # live at boot: this pod is a duplicate there
    boot = [sys.executable, "-m", "trainpod", "boot"]
    killed = subprocess.run(boot, env=child_env(env), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert "holds this run's lease" in killed.stdout, "no duplicate at boot: this test tests nothing"
    assert (run.root / START_MARKER).exists(), "the start that took the run over and died has no START"
    assert atomic.read_json(run.root / START_MARKER)["pod"] == pod["id"], killed.stdout
    again = subprocess.run(boot, env=child_env(env), capture_output=True, text=True, timeout=300)
    assert again.returncode == KILLED, again.stdout + again.stderr
    assert atomic.read_json(run.root / FAILED_MARKER)["exit_code"] == KILLED
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_real_boot_killed_with_its_workload_is_counted_at_the_next_start(fake, pod, volume):
    """The pretrain runs in boot's process on one GPU (CPU here): SIGKILL stands in for a segfault or the
    OOM killer. With TRAINPOD_MAX_FAILED_STARTS=1 the next start marks FAILED and stops the pod unstarted."""
    env = {
        **pod_env(fake, pod),
        "TRAINPOD_VOLUME": str(volume),
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
        "TRAINPOD_SET": "checkpoint.every_steps=1000",  # nothing is committed before the kill
        "TRAINPOD_MAX_FAILED_STARTS": "1",
    }
    boot = [sys.executable, "-m", "trainpod", "boot"]
    killed = start_trainpod(cmd=boot, volume=volume, env=env)
    output = signal_when_step_reached(killed, volume, 1, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, output
    run = Volume(volume).run(RUN)
    assert (run.root / START_MARKER).exists() and not (run.root / STARTS_FILE).exists()
    again = subprocess.run(boot, env=child_env(env), capture_output=True, text=True, timeout=300)
    assert again.returncode == KILLED, again.stdout + again.stderr
    assert "the previous start ended without a word" in again.stdout
    assert atomic.read_json(run.root / FAILED_MARKER)["exit_code"] == KILLED
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert status_step(volume) < 1000 and not (run.checkpoints / "LATEST").exists()


def test_a_duplicate_pod_that_finds_the_run_leased_by_a_live_pod_stops_itself_uncounted(
    fake, pod, run, monkeypatch, caplog
):
    monkeypatch.setenv("RUNPOD_POD_ID", "the-pod-that-trains")
    training = Lease(run.lease, ttl_seconds=2)  # renewed every 0.5 s
    training.acquire()
    try:
        monkeypatch.setenv("RUNPOD_POD_ID", pod["id"])
        with pytest.raises(TemporaryError, match="leased by another writer"):
            Lease(run.lease).acquire()  # what this pod's workload ran into: its exit 75
        assert after_workload(75, run, pod_env(fake, pod), "pretrain") == 75
    finally:
        training.release()
    assert "pod the-pod-that-trains holds this run's lease" in caplog.text
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "a duplicate restarted forever bills a GPU"
    assert not (run.root / STARTS_FILE).exists() and not (run.root / FAILED_MARKER).exists()


def test_a_duplicate_datagen_pod_that_finds_its_dataset_being_built_stops_itself_uncounted(
    fake, pod, tmp_path, monkeypatch, capsys
):
    # Its 75 came from the dataset's lease, not the run's: it was counted in starts-datagen.json, which the
    # pod building the dataset shares (one per name), so that pod's first hiccup later could stop it.
    monkeypatch.setenv("RUNPOD_POD_ID", "the-pod-that-builds")
    (tmp_path / "datasets").mkdir()
    building = Lease(tmp_path / "datasets" / ".tiny-stories.LEASE", ttl_seconds=2)  # renewed every 0.5 s
    building.acquire()
    try:
        environ = {
            **pod_env(fake, pod),
            "TRAINPOD_VOLUME": str(tmp_path),
            "TRAINPOD_WORKLOAD": "datagen",
            "TRAINPOD_CONFIG": str(TINY_DATAGEN),
        }
        assert boot_module.boot(environ) == 75
    finally:
        building.release()
    output = capsys.readouterr().out
    assert "dataset tiny-stories is leased by another writer" in output
    assert "pod the-pod-that-builds holds" in output and "this pod is a duplicate" in output
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", (
        "a duplicate restarted over and over bills a pod"
    )
    assert not (tmp_path / "runs" / "tiny-stories" / "starts-datagen.json").exists()


def test_a_75_is_counted_when_the_lease_left_is_this_pods_own_or_expires_unrenewed(fake, pod, run):
    env = pod_env(fake, pod)
    lease = {"owner": {"pod_id": pod["id"]}, "heartbeat_unix": time.time(), "expires_unix": time.time() + 60}
    atomic.write_json(run.lease, lease)  # this pod's earlier start, killed before it released its lease
    assert after_workload(75, run, env, "pretrain") == 75
    # Another pod's, killed before releasing it: never renewed, so not a pod training the run.
    atomic.write_json(run.lease, {**lease, "owner": {"pod_id": "gone"}, "expires_unix": time.time() + 1.5})
    assert after_workload(75, run, env, "pretrain") == 75
    assert atomic.read_json(run.root / STARTS_FILE)["consecutive_failures"] == 2
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


STUBBORN_PROGRAM = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a long download that never looks at the stop flag
open("program.pid", "w").write(str(os.getpid()))
time.sleep(300)
"""


def test_a_spot_stop_whose_sigkill_comes_before_the_workload_exits_is_not_counted(fake, pod, tmp_path):
    """SIGTERM, then RunPod's SIGKILL before the workload could exit (here a program that ignores SIGTERM;
    in a pod, a long preflight such as a base model's download): a preemption, not a start that died without
    a word, so the next start of the pod counts nothing."""
    workdir, volume, env = command_pod(fake, pod, tmp_path, "stubborn", STUBBORN_PROGRAM, max_failed_starts=1)
    boot = start_trainpod(cmd=[sys.executable, "-m", "trainpod", "boot"], volume=volume, env=env)
    run = Volume(volume).run("stubborn")
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "program.pid").exists():
            assert boot.poll() is None and time.monotonic() < deadline, boot.communicate()[0]
            time.sleep(0.05)
        assert (run.root / START_MARKER).exists()
        boot.send_signal(signal.SIGTERM)
        # Well inside the 5 s before the SIGKILL; without the first-signal hook it stays until the workload
        # exits, which is after the SIGKILL here.
        deadline = time.monotonic() + 4
        while (run.root / START_MARKER).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (run.root / START_MARKER).exists(), "START still there when RunPod's SIGKILL comes"
    finally:
        boot.kill()
        boot.communicate()
        os.kill(int((workdir / "program.pid").read_text()), signal.SIGKILL)
    assert begin_start(run, pod_env(fake, pod), "command") is None
    assert not (run.root / STARTS_FILE).exists() and not (run.root / FAILED_MARKER).exists()
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


def test_a_hand_made_pod_whose_boot_keeps_failing_before_its_run_is_known_stops_itself(
    fake, pod, tmp_path, monkeypatch
):
    """No TRAINPOD_RUN and a git sync that cannot reach its server (exit 75) before the config names the
    run: nothing counted these starts, and RunPod started the container again forever, billing."""
    from functools import partial

    from trainpod import gitsync

    monkeypatch.setattr(gitsync, "sync", partial(gitsync.sync, sleep=lambda s: None))
    env = pod_env(
        fake,
        pod,
        TRAINPOD_VOLUME=str(tmp_path),
        TRAINPOD_WORKLOAD="pretrain",
        TRAINPOD_CONFIG="configs/pretrain/tiny.yaml",
        TRAINPOD_GIT_REPO="http://127.0.0.1:9/nowhere.git",  # nothing listens on port 9: refused at once
    )
    for start in (1, 2):
        assert boot_module.boot(dict(env)) == 75
        assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", f"start {start}: RunPod restarts it"
    assert boot_module.boot(dict(env)) == 75
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "a crash loop before the run is known goes on"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run is marked"


def test_a_start_that_gets_to_its_run_clears_the_count_of_failures_before_it(fake, pod, tmp_path, run):
    env = pod_env(fake, pod, TRAINPOD_VOLUME=str(tmp_path), TRAINPOD_MAX_FAILED_STARTS="2")
    assert after_workload(75, None, env, "pretrain") == 75
    assert after_workload(143, run, env, "pretrain") == 143  # a start that knew its run, then a spot stop
    assert after_workload(75, None, env, "pretrain") == 75
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "1 failure since the last start that worked"


# A start that committed a newer checkpoint than the run had when it began made progress: a pod that crashes
# once per start but commits steps every time is no crash loop, and the count begins again at that start.

PROGRESS_THEN_CRASH = """
import os, sys
from trainpod import Checkpointer
if os.environ["COMMITS"] == "1":
    with Checkpointer() as ckpt:
        restored = ckpt.restore()
        step = restored.step + 1 if restored else 1
        ckpt.commit(step, extra={"step": step})
sys.exit(1)
"""


def test_a_pod_whose_every_start_commits_steps_then_crashes_is_no_crash_loop(fake, pod, tmp_path):
    """A spot pod crashing once per start (a leak, a flaky dataloader) after committing steps each time went
    FAILED and stopped at TRAINPOD_MAX_FAILED_STARTS, though every start moved the run on; starts that crash
    without committing still stop it."""
    _, volume, env = command_pod(fake, pod, tmp_path, "crashy", PROGRESS_THEN_CRASH, max_failed_starts=2)
    run = Volume(volume).run("crashy")

    def boot(commits: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "trainpod", "boot"],
            env=child_env({**env, "COMMITS": commits}),
            capture_output=True,
            text=True,
            timeout=300,
        )

    for start in (1, 2, 3):
        result = boot(commits="1")
        assert result.returncode == 75, result.stdout + result.stderr
        assert (run.checkpoints / "LATEST").read_text().strip() == f"step-{start}"
        assert not (run.root / FAILED_MARKER).exists(), f"start {start} committed a step: {result.stdout}"
        assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", f"start {start}: RunPod restarts it"
        assert atomic.read_json(run.root / STARTS_FILE)["consecutive_failures"] == 1
    result = boot(commits="0")  # the second failure in a row without progress: the loop guard stops it
    assert result.returncode == 75, result.stdout + result.stderr
    assert "2 failed starts in a row" in atomic.read_json(run.root / FAILED_MARKER)["reason"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_start_killed_after_committing_steps_begins_the_count_again(fake, pod, run):
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="2")
    assert after_workload(1, run, env, "pretrain") == 1  # a crash that committed nothing: 1 of 2
    begin_start(run, env, "pretrain")
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    (run.checkpoints / "LATEST").write_text("step-10\n")  # it committed, then the OOM killer took it
    assert begin_start(run, env, "pretrain") is None
    assert not (run.root / STARTS_FILE).exists(), "the start before this one moved the run on"
    assert after_workload(1, run, env, "pretrain") == 1
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "1 failure since the progress, 2 allowed"


@pytest.mark.parametrize("ended_by", [1, 2])
def test_a_run_whose_failed_marker_was_deleted_gets_its_failed_starts_anew(fake, pod, run, ended_by):
    """The supervisor says to fix the cause, delete FAILED and deploy again; the count of failed starts stayed at
    the crash loop's (or at the failures before an exit 2), so the first failure after the fix (a hub's 75)
    marked the run FAILED again at once and stopped its pod."""
    env = pod_env(fake, pod, TRAINPOD_MAX_FAILED_STARTS="3")
    for _ in range(3 if ended_by == 1 else 2):
        after_workload(1, run, env, "pretrain")
    if ended_by == 2:
        after_workload(2, run, env, "pretrain")  # a bad config, fixed since
    assert (run.root / FAILED_MARKER).exists() and fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    (run.root / FAILED_MARKER).unlink()  # the cause fixed, as the supervisor's message says
    fake.pods[pod["id"]]["desiredStatus"] = "RUNNING"  # deployed again
    assert after_workload(75, run, env, "pretrain") == 75
    assert not (run.root / FAILED_MARKER).exists(), "one failed start of three"
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"
