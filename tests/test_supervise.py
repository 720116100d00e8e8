"""Supervisor scenarios against the fake RunPod API (the mock of RunPod). The pod's work is
simulated by writing what the workload writes (DONE, status.json, FAILED) into a tmp volume; an
injected clock makes backoff and cost instant: no test sleeps."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import yaml

from trainpod import atomic, cli
from trainpod.config.deploy import DeployConfig
from trainpod.errors import ConfigError
from trainpod.remote.s3 import S3Target, VolumeS3
from trainpod.runpod.deploy import deploy
from trainpod.runpod.finish import FAILED_MARKER, STARTS_FILE, UNFIT_MARKER, after_workload
from trainpod.runpod.supervise import RunView, Supervisor
from trainpod.volume import Volume

from fake_runpod import KEY, api_env, client_for

GPUS = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def deploy_config(**supervise) -> DeployConfig:
    return DeployConfig.model_validate(
        {
            "run": "tiny",
            "workload": "pretrain",
            "config": "configs/pretrain/tiny.yaml",
            "image": {"name": "ghcr.io/org/trainpod:0.1.0"},
            "pod": {"gpu_types": GPUS},
            "volume": {"name": "vol", "data_center": "EU-RO-1"},
            "budget": {"budget_usd": 10},
            "supervise": {"backoff_s": 30, "max_failed_starts": 3, **supervise},
        }
    )


@pytest.fixture
def volume(tmp_path: Path) -> Volume:
    vol = Volume(tmp_path / "volume")
    vol.run("tiny").create()
    return vol


def supervisor(fake, volume, clock=None, **policy) -> Supervisor:
    cfg = deploy_config(**policy)
    state = (volume.run("tiny").root if volume else volume_less_state()) / "supervise.json"
    return Supervisor(client_for(fake), cfg, volume, state, clock=clock or Clock(), sleep=lambda s: None)


def volume_less_state() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp())


def the_pod(fake) -> dict:
    (pod,) = fake.pods_named("tiny-pretrain")
    return pod


def test_interrupted_twice_then_done(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None and "is RUNNING (spent $0.00); nothing to do" in caplog.text
    pod_id = the_pod(fake)["id"]
    for restart in (1, 2):
        fake.interrupt(pod_id)
        assert sup.step() is None
        assert the_pod(fake)["desiredStatus"] == "RUNNING" and the_pod(fake)["id"] == pod_id
        assert f"pod EXITED and the run not DONE: started pod {pod_id} (restart {restart}/50)" in caplog.text
    atomic.write_json(volume.run("tiny").done, {"step": 40})
    assert sup.step() == 0
    assert the_pod(fake)["desiredStatus"] == "EXITED", "a pod still running after DONE is stopped"
    assert "run is DONE; supervising ends" in caplog.text
    assert len(fake.calls("POST", "/pods/")) == 3  # two starts and the final stop


def test_start_refused_then_a_new_pod_on_the_same_volume_with_the_same_env(fake, volume, caplog):
    deployed = deploy(client_for(fake), deploy_config())
    first = deployed.pod
    fake.refuse_start.add(first.id)
    fake.no_capacity.add(GPUS[0])
    fake.interrupt(first.id)
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() is None
    new = the_pod(fake)
    assert new["id"] != first.id and first.id not in fake.pods, "the replaced pod is terminated"
    assert new["networkVolumeId"] == deployed.volume.id and new["env"] == first.env
    assert new["gpu"]["id"] == GPUS[1], "the next GPU type in the config's order"
    assert f"start of pod {first.id} refused (500)" in caplog.text and "created pod" in caplog.text


def test_a_replacement_goes_on_the_old_pods_volume_though_the_yaml_names_another_since(fake, volume):
    """RunPod's pods carry their network volume only when asked (includeNetworkVolume): unasked, the replacement
    of a pod whose start was refused went on the volume the edited YAML names, a new empty one made for it,
    and the run started over there, billed twice, its checkpoints left behind."""
    deployed = deploy(client_for(fake), deploy_config())
    fake.refuse_start.add(deployed.pod.id)
    fake.interrupt(deployed.pod.id)
    moved = deploy_config()
    moved.volume.name = "vol2"  # edited for the next run, while this one is still supervised
    sup = Supervisor(client_for(fake), moved, volume, volume.run("tiny").root / "supervise.json",
                     clock=Clock(), sleep=lambda s: None)  # fmt: skip
    assert sup.step() is None
    assert the_pod(fake)["networkVolumeId"] == deployed.volume.id, "the run goes on where its checkpoints are"
    assert list(fake.volumes) == [deployed.volume.id], "no second volume made"


def test_a_gone_pod_is_created_again(fake, volume):
    deployed = deploy(client_for(fake), deploy_config())
    client_for(fake).terminate_pod(deployed.pod.id)
    assert supervisor(fake, volume).step() is None
    assert the_pod(fake)["networkVolumeId"] == deployed.volume.id


def test_done_ends_with_0_when_the_pod_terminated_itself_since_the_look(fake, volume):
    """TRAINPOD_ON_FINISH=terminate: the pod is gone between the supervisor's listing and its stop."""
    deploy(client_for(fake), deploy_config())
    pod_id = the_pod(fake)["id"]
    atomic.write_json(volume.run("tiny").done, {"step": 40})
    handle = fake.handle

    def terminated_meanwhile(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "GET" and raw_path.startswith("/v1/pods"):
            fake.pods.pop(pod_id, None)
        return answer

    fake.handle = terminated_meanwhile
    assert supervisor(fake, volume).step() == 0


def test_the_runs_failure_marker_stops_supervising(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    fake.interrupt(the_pod(fake)["id"])
    atomic.write_json(volume.run("tiny").root / FAILED_MARKER, {"reason": "3 failed starts in a row"})
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() == 2
    assert the_pod(fake)["desiredStatus"] == "EXITED", "a FAILED run is not started again"
    assert "run FAILED (3 failed starts in a row); not restarting" in caplog.text


def interrupted_pod_that_cannot_come_back(fake) -> str:
    """A deployed pod, interrupted, whose start RunPod refuses, with no GPU free for a new one."""
    deploy(client_for(fake), deploy_config())
    pod_id = the_pod(fake)["id"]
    fake.refuse_start.add(pod_id)
    fake.no_capacity.update(GPUS)
    fake.interrupt(pod_id)
    return pod_id


def test_failed_starts_back_off_exponentially_and_are_bounded(fake, volume, caplog):
    interrupted_pod_that_cannot_come_back(fake)
    fake.create_outage = True  # RunPod having trouble, not a shortage: that is waited out (below)
    clock = Clock()
    sup = supervisor(fake, volume, clock)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None and "next attempt in 30 s" in caplog.text
    clock.now += 10
    creates = len(fake.calls("POST", "/pods"))
    assert sup.step() is None and "next start attempt in 20 s" in caplog.text
    assert len(fake.calls("POST", "/pods")) == creates, "no attempt during the backoff"
    clock.now += 20
    assert sup.step() is None and "next attempt in 60 s" in caplog.text
    clock.now += 60
    assert sup.step() == 75
    assert "3 failed starts in a row" in caplog.text


def test_no_free_machine_is_waited_out_at_the_longest_backoff_and_the_pod_made_once_one_is(
    fake, volume, caplog
):
    """RunPod's 'no instances available' (spot's common shortage) counted as a failed start, so a supervisor ended
    (exit 75) after max_failed_starts, minutes of backoff: on a laptop, the run stayed down until the user came
    back, though a machine came free soon after. Nothing runs or bills while it waits."""
    interrupted_pod_that_cannot_come_back(fake)
    clock = Clock()
    sup = supervisor(fake, volume, clock, max_backoff_s=120)
    caplog.set_level(logging.INFO, "trainpod")
    waits = []
    for _ in range(8):  # well past max_failed_starts=3
        caplog.clear()
        assert sup.step() is None, caplog.text
        assert "no machine free" in caplog.text and "trainpod stop tiny" in caplog.text, caplog.text
        waits.append(int(caplog.text.split("next attempt in ")[1].split(" s")[0]))
        clock.now += waits[-1]
    assert waits == [30, 60, 120, 120, 120, 120, 120, 120]
    fake.no_capacity.clear()
    caplog.clear()
    assert sup.step() is None and "created" in caplog.text.lower(), caplog.text
    assert [p["desiredStatus"] for p in fake.pods.values()].count("RUNNING") == 1


def test_restarts_are_bounded(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume, max_restarts=1)
    fake.interrupt(the_pod(fake)["id"])
    assert sup.step() is None
    fake.interrupt(the_pod(fake)["id"])
    assert sup.step() == 2


def test_a_run_that_makes_progress_between_interruptions_is_restarted_past_max_restarts(fake, volume):
    """A week-long spot run is interrupted more often than supervise.max_restarts: the bound is for restarts
    that get the run nowhere. Before, the supervisor gave up (exit 2) after max_restarts interruptions of a
    run that resumed and trained on after each."""
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume, max_restarts=2)
    for step in range(10, 60, 10):  # five interruptions, each after the run went on from the last restart
        atomic.write_json(volume.run("tiny").status, {"step": step})
        fake.interrupt(the_pod(fake)["id"])
        assert sup.step() is None
        assert the_pod(fake)["desiredStatus"] == "RUNNING"
    fake.interrupt(the_pod(fake)["id"])  # no progress since the last restart: these count
    assert sup.step() is None
    fake.interrupt(the_pod(fake)["id"])
    assert sup.step() == 2


def test_budget_spent_on_the_volume_stops_the_pod(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    atomic.write_json(volume.run("tiny").status, {"step": 5, "cost_usd": 10.5})
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() == 3
    assert the_pod(fake)["desiredStatus"] == "EXITED"
    assert "spent $10.50 of the $10.00 budget" in caplog.text


def test_budget_from_the_api_alone_counts_the_running_pods_price(fake):
    deploy(client_for(fake), deploy_config())
    clock = Clock()
    sup = supervisor(fake, None, clock)
    assert sup.step() is None
    clock.now += 4 * 3600  # 4 h at $2.00/hr: $8 of $10
    assert sup.step() is None
    clock.now += 1 * 3600 + 1
    assert sup.step() == 3


def test_hours_without_a_look_are_not_charged_at_the_price_of_a_pod_started_since(fake):
    """The supervisor's last look saw the pod EXITED (nothing billing); five hours later the user
    deploys again and supervises: those hours cost nothing, the run's $10 budget is not spent."""
    deploy(client_for(fake), deploy_config())
    fake.interrupt(the_pod(fake)["id"])
    clock = Clock()
    sup = supervisor(fake, None, clock, max_restarts=0)  # a look that leaves the EXITED pod as it is
    assert sup.step() == 2
    clock.now += 5 * 3600
    deploy(client_for(fake), deploy_config())  # started again: $2.00/hr from now on
    assert sup.step() is None, "nothing has billed since the last look"
    assert the_pod(fake)["desiredStatus"] == "RUNNING"


def test_without_the_volume_an_exited_pod_is_started_and_the_log_says_done_is_unknown(fake, caplog):
    deploy(client_for(fake), deploy_config())
    fake.interrupt(the_pod(fake)["id"])
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, None).step() is None
    assert "the volume is not mounted here: DONE is unknown" in caplog.text


def test_a_rejected_key_stops_with_a_clear_message(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume)
    fake.key = "fake-rotated-key-for-tests"  # the supervisor's key is no longer the account's
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() == 2
    assert "RUNPOD_API_KEY rejected" in caplog.text and KEY not in caplog.text


def test_supervise_once_from_the_command_line(fake, volume, tmp_path, monkeypatch, capsys):
    import yaml

    deploy(client_for(fake), deploy_config())
    fake.interrupt(the_pod(fake)["id"])
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    args = ["supervise", "tiny", "--config", str(path), "--once", "--volume", str(volume.root)]
    assert cli.main(args) == 0
    assert the_pod(fake)["desiredStatus"] == "RUNNING"
    assert "started pod" in capsys.readouterr().out
    atomic.write_json(volume.run("tiny").done, {})
    assert cli.main(args) == 0
    assert (volume.root / "runs/.tiny.supervise.json").is_file(), "--once runs share their state"


def machine_unfit_in_the_pod(fake, volume, pod_id: str) -> None:
    """What `trainpod boot` does after its host check exits 4: the in-pod finish hook, its own key."""
    env = {**api_env(fake), "RUNPOD_POD_ID": pod_id}
    assert after_workload(4, volume.run("tiny"), env, "pretrain") == 4


def test_exit_4_stops_the_pod_and_the_supervisor_replaces_it_with_the_same_volume_env_and_gpu_order(
    fake, volume, caplog
):
    deployed = deploy(client_for(fake), deploy_config())
    first = deployed.pod
    machine_unfit_in_the_pod(fake, volume, first.id)
    assert fake.pods[first.id]["desiredStatus"] == "EXITED", (
        "the pod stops itself: a restart is the same machine"
    )
    assert not (volume.run("tiny").root / STARTS_FILE).exists(), "exit 4 is no failed start of the run"
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() is None
    new = the_pod(fake)
    assert new["id"] != first.id and first.id not in fake.pods, "replaced and the old pod terminated"
    assert not fake.calls("POST", f"/pods/{first.id}/start"), "the unfit machine is never started again"
    assert new["networkVolumeId"] == deployed.volume.id and new["env"] == first.env
    (_, _, body) = fake.calls("POST", "/pods")[-1]
    assert body["gpuTypeIds"] == GPUS and body["gpuTypePriority"] == "custom"
    assert "on a machine that cannot run the image (exit 4) and the run not DONE: created pod" in caplog.text
    assert not (volume.run("tiny").root / UNFIT_MARKER).exists()


def test_replacements_in_a_row_are_bounded_and_end_with_exit_4(fake, volume, caplog):
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume, max_replacements=1)
    machine_unfit_in_the_pod(fake, volume, the_pod(fake)["id"])
    assert sup.step() is None
    machine_unfit_in_the_pod(fake, volume, the_pod(fake)["id"])
    creates = len(fake.calls("POST", "/pods"))
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() == 4
    assert len(fake.calls("POST", "/pods")) == creates, "no third pod"
    assert "1 new pods in a row landed on machines that cannot run the image" in caplog.text


def test_giving_up_on_unfit_machines_terminates_the_last_pod_so_a_deploy_again_never_starts_it(
    fake, volume, caplog
):
    """At the bound the last unfit pod was left stopped, and `trainpod deploy` (the way on that the message names)
    started it again: a stopped pod keeps its machine, the one that cannot run the image, so it exited 4 again.
    It is terminated, as a replacement would have terminated it; the network volume keeps the run."""
    cfg = deploy_config()
    deploy(client_for(fake), cfg)
    sup = supervisor(fake, volume, max_replacements=1)
    machine_unfit_in_the_pod(fake, volume, the_pod(fake)["id"])
    assert sup.step() is None
    unfit = the_pod(fake)["id"]
    machine_unfit_in_the_pod(fake, volume, unfit)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() == 4
    assert unfit not in fake.pods, "the pod on the unfit machine is terminated, not left stopped"
    assert f"terminated pod {unfit}: its machine cannot run the image" in caplog.text
    assert "deploy again (the volume keeps the run)" in caplog.text
    again = deploy(client_for(fake), cfg)
    assert again.action == "created" and again.pod.id != unfit
    assert not fake.calls("POST", f"/pods/{unfit}/start"), "the unfit machine is never started again"


def test_a_plain_interruption_between_two_exit_4s_resets_the_replacement_count(fake, volume):
    deploy(client_for(fake), deploy_config())
    sup = supervisor(fake, volume, max_replacements=1)
    machine_unfit_in_the_pod(fake, volume, the_pod(fake)["id"])
    assert sup.step() is None
    fake.interrupt(the_pod(fake)["id"])  # the replacement ran; then a spot interruption
    assert sup.step() is None
    machine_unfit_in_the_pod(fake, volume, the_pod(fake)["id"])
    assert sup.step() is None, "one replacement in a row again, within the bound"


@pytest.mark.parametrize("copies", [0, 2], ids=["none", "several"])
def test_supervise_without_a_config_refuses_unless_exactly_one_deploy_config_has_the_run(
    tmp_path, monkeypatch, capsys, copies
):
    import yaml

    folder = tmp_path / "configs" / "deploy"
    folder.mkdir(parents=True)
    for index in range(copies):
        (folder / f"tiny-{index}.yaml").write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINPOD_CONFIG", raising=False)
    assert cli.main(["supervise", "tiny", "--once"]) == 2
    out = capsys.readouterr().out
    assert "pass --config configs/deploy/X.yaml" in out
    assert ("no YAML under" in out) if copies == 0 else ("2 YAMLs under" in out and "tiny-1.yaml" in out)


def test_trainpod_stop_is_not_undone_by_the_supervisor(fake, volume, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume.root))
    deploy(client_for(fake), deploy_config())
    assert cli.main(["stop", "tiny"]) == 0
    assert (volume.root / "runs/.tiny.STOPPED").exists()
    assert supervisor(fake, volume).step() == 0
    from trainpod.runpod.supervise import state_path

    laptop = Supervisor(client_for(fake), deploy_config(), None, state_path(None, "tiny"), clock=Clock())
    assert laptop.step() == 0, "a supervisor on this machine without the volume"
    assert the_pod(fake)["desiredStatus"] == "EXITED"


def test_a_supervisor_looking_while_trainpod_stop_runs_does_not_start_the_stopped_pod_again(
    fake, volume, tmp_path, monkeypatch
):
    """`trainpod stop` stopped the pods first and recorded STOPPED after: a supervisor looking in between (a
    loop elsewhere, supervise.yml's run) saw an EXITED pod and no STOPPED, took it for an interruption and
    started it again, billing, with the stop already reported done. The stop is recorded first now."""
    from trainpod.runpod import deploy as deploying

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume.root))
    deploy(client_for(fake), deploy_config())
    elsewhere = supervisor(fake, volume)
    stop_run = deploying.stop_run
    looks = []

    def stop_then_a_look(*args, **kwargs):
        stopped = stop_run(*args, **kwargs)
        looks.append(elsewhere.step())
        return stopped

    monkeypatch.setattr(deploying, "stop_run", stop_then_a_look)
    assert cli.main(["stop", "tiny"]) == 0
    assert looks == [0], "the supervisor saw the stop"
    assert the_pod(fake)["desiredStatus"] == "EXITED", "the stopped pod stays stopped"


def test_a_stop_recorded_while_a_supervisor_on_this_machine_looks_is_not_erased_by_its_state(
    fake, tmp_path, monkeypatch
):
    """Away from the volume and its S3 API the stop lives in this machine's supervisor state alone. A loop
    supervisor read that file at the start of a look and wrote it back at the end: a `trainpod stop` recorded in
    between was erased, and the next look started the stopped pod again."""
    from trainpod.runpod.supervise import mark_stopped, state_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "laptop"))
    first = deploy(client_for(fake), deploy_config()).pod
    sup = Supervisor(client_for(fake), deploy_config(), None, state_path(None, "tiny"), clock=Clock())
    assert sup.step() is None
    look = sup.unit.look

    def look_while_the_user_stops(*args, **kwargs):
        seen = look(*args, **kwargs)
        mark_stopped("tiny", None)  # `trainpod stop tiny` in another terminal, then its stop of the pods
        return seen

    monkeypatch.setattr(sup.unit, "look", look_while_the_user_stops)
    assert sup.step() is None
    monkeypatch.setattr(sup.unit, "look", look)
    client_for(fake).stop_pod(first.id)
    assert sup.step() == 0, "the next look sees the stop"
    assert the_pod(fake)["desiredStatus"] == "EXITED"


def test_the_supervise_pods_exit_75_leaves_a_backoff_for_its_restarted_container(fake, volume):
    interrupted_pod_that_cannot_come_back(fake)
    fake.create_outage = True
    clock = Clock()
    for _ in range(3):
        code = supervisor(fake, volume, clock).step()
        clock.now += 1000
    assert code == 75
    clock.now -= 1000
    calls = len(fake.calls("POST"))
    assert supervisor(fake, volume, clock).step() is None  # RunPod restarted the container at once
    assert len(fake.calls("POST")) == calls, "no attempt straight after the restart"


def test_a_look_that_fails_unforeseen_is_logged_and_tried_again_but_not_forever(
    fake, volume, monkeypatch, caplog
):
    deploy(client_for(fake), deploy_config())
    real_read, failures = RunView.read, iter([True, True, False, True, True, True, True, True])

    def stale_handle_now_and_then(volume_, run):  # a network volume's hiccup (ESTALE) while reading the run
        if next(failures):
            raise OSError(116, "Stale file handle")
        return real_read(volume_, run)

    monkeypatch.setattr(RunView, "read", stale_handle_now_and_then)
    sup = supervisor(fake, volume)
    with pytest.raises(OSError, match="Stale file handle"):
        sup.run()  # two failures, one good look, then five in a row: a bug that recurs ends it
    assert caplog.text.count("look failed (") == 2 + 4
    assert "look failed (2/5 in a row)" in caplog.text and "look failed (4/5 in a row)" in caplog.text
    assert "is RUNNING (spent $0.00); nothing to do" in caplog.text


@pytest.fixture
def volume_s3(fake, s3_server, monkeypatch) -> VolumeS3:
    """The deployed run's network volume as a bucket of a real S3 server, named by its RunPod id."""
    import boto3

    deploy(client_for(fake), deploy_config())
    (volume_id,) = fake.volumes
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "user_2f21CfO73Mm2Uq2lEGFiEF24IPw")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rps_FAKESECRETFORTESTS0123456789")
    monkeypatch.setenv("TRAINPOD_S3_ENDPOINT_URL", s3_server)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket=volume_id)
    # The server lives for the session and each test's fake RunPod names its volume alike: an earlier
    # test's DONE or STOPPED must not end this one's supervisor.
    for leftover in s3.list_objects_v2(Bucket=volume_id).get("Contents", []):
        s3.delete_object(Bucket=volume_id, Key=leftover["Key"])
    return VolumeS3(S3Target(volume_id, "EU-RO-1", s3_server))


def test_away_from_the_volume_its_s3_api_shows_failed_and_done(fake, volume_s3):
    """A laptop or CI supervisor saw neither: it started a FAILED or DONE run's pod again at every look."""
    fake.interrupt(the_pod(fake)["id"])
    sup = Supervisor(client_for(fake), deploy_config(), None, volume_less_state() / "s.json",
                     clock=Clock(), sleep=lambda s: None, volume_s3=volume_s3)  # fmt: skip
    volume_s3.put_bytes("runs/tiny/FAILED", json.dumps({"reason": "budget exhausted (exit 3)"}).encode())
    assert sup.step() == 2
    assert the_pod(fake)["desiredStatus"] == "EXITED", "a FAILED run is not started again"
    volume_s3.remove("runs/tiny/FAILED")
    volume_s3.put_bytes("runs/tiny/DONE", b"{}")
    assert sup.step() == 0
    assert the_pod(fake)["desiredStatus"] == "EXITED", "a DONE run is not started again"


@pytest.mark.parametrize("fault", ["drop", "503"])
def test_one_failed_s3_read_of_a_done_runs_marker_does_not_start_its_pod_again(
    fake, volume_s3, faulty_s3, fault
):
    """A connection reset while receiving DONE made the whole look blind: the pod that stopped itself at DONE
    looked interrupted and was started again (a boot paid for, to stop again). Reads that fail are tried
    again; the S3 server is real (moto), the failures come from a proxy in front of it."""
    fake.interrupt(the_pod(fake)["id"])  # the pod stopped itself after DONE
    volume_s3.put_bytes("runs/tiny/DONE", b"{}")
    through_proxy = VolumeS3(S3Target(volume_s3.bucket, "EU-RO-1", faulty_s3.url), sleep=lambda s: None)
    sup = Supervisor(client_for(fake), deploy_config(), None, volume_less_state() / "s.json",
                     clock=Clock(), sleep=lambda s: None, volume_s3=through_proxy)  # fmt: skip
    faulty_s3.break_next("runs/tiny/DONE", kind=fault)
    assert sup.step() == 0
    assert faulty_s3.broken == 1, "the proxy broke the read of DONE"
    assert the_pod(fake)["desiredStatus"] == "EXITED", "a DONE run is not started again"


def test_a_look_whose_s3_reads_keep_failing_starts_nothing_for_a_few_looks_then_goes_by_the_api(
    fake, volume_s3, faulty_s3, caplog
):
    """Could not read is not absent: while the reads of DONE fail (after their retries) the supervisor waits
    rather than start a pod that may have stopped itself at DONE; an S3 API down for longer is no reason to
    leave an interrupted run down, so after UNREADABLE_LOOKS_BEFORE_BLIND looks the pods alone decide."""
    from trainpod.runpod.supervise import UNREADABLE_LOOKS_BEFORE_BLIND

    fake.interrupt(the_pod(fake)["id"])
    through_proxy = VolumeS3(S3Target(volume_s3.bucket, "EU-RO-1", faulty_s3.url), sleep=lambda s: None)
    sup = Supervisor(client_for(fake), deploy_config(), None, volume_less_state() / "s.json",
                     clock=Clock(), sleep=lambda s: None, volume_s3=through_proxy)  # fmt: skip
    faulty_s3.break_next("runs/tiny/DONE", faults=1000)
    for _ in range(UNREADABLE_LOOKS_BEFORE_BLIND):
        with caplog.at_level(logging.INFO, logger="trainpod.supervise"):
            assert sup.step() is None
        assert the_pod(fake)["desiredStatus"] == "EXITED", caplog.text
    assert "not starting it on a guess" in caplog.text
    assert sup.step() is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING", "then the API alone: the interrupted run comes back"


def test_supervise_from_a_laptop_reads_the_markers_through_s3_when_its_key_is_exported(
    fake, volume_s3, tmp_path, monkeypatch
):
    import yaml

    fake.interrupt(the_pod(fake)["id"])
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted-here"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    volume_s3.put_bytes("runs/tiny/DONE", b"{}")
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 0
    assert the_pod(fake)["desiredStatus"] == "EXITED"


def test_a_stop_from_a_laptop_reaches_supervisors_elsewhere_through_s3_and_deploy_clears_it(
    fake, volume_s3, tmp_path, monkeypatch
):
    """The scheduled supervise.yml keeps its own state: only the volume's STOPPED tells it of a laptop's stop."""
    import yaml

    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted-here"))
    path = tmp_path / "deploy.yaml"
    tree = deploy_config().model_dump(mode="json")
    tree["budget"]["hourly_usd"] = 2.0  # deploy refuses a budget the pod could not count without its price
    path.write_text(yaml.safe_dump(tree))
    monkeypatch.setenv("TRAINPOD_CONFIG", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "laptop"))
    assert cli.main(["stop", "tiny"]) == 0
    assert volume_s3.read("runs/.tiny.STOPPED") is not None
    assert not volume_s3.files("runs/tiny/"), "a stop of a run that never started makes no run folder"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ci-runner"))
    assert cli.main(["supervise", "tiny", "--once"]) == 0
    assert the_pod(fake)["desiredStatus"] == "EXITED", "the stopped run is not brought back"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "laptop"))
    assert cli.main(["deploy", str(path)]) == 0
    assert volume_s3.read("runs/.tiny.STOPPED") is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING"


def on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path):
    """The RunPod key of `fake`, no S3 key, a volume path that is not mounted here, a cache of its own."""
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "TRAINPOD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted-here"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "laptop"))


def test_a_stop_that_no_supervisor_elsewhere_can_see_says_so(fake, tmp_path, monkeypatch, capsys):
    """README: with neither the volume here nor RunPod's S3 key, STOPPED is recorded nowhere a scheduled supervisor
    (supervise.yml) looks, and it starts the run again. The stop said nothing of it: the pod came back and billed."""
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    deploy(client_for(fake), deploy_config())
    assert cli.main(["stop", "tiny"]) == 0
    out = capsys.readouterr().out
    assert the_pod(fake)["desiredStatus"] == "EXITED"
    assert "STOPPED is not recorded on the volume" in out and "SUPERVISE_RUN" in out, out


def test_a_pod_gone_before_the_first_look_is_created_again_as_deployed_not_as_the_yaml_says(
    fake, tmp_path, monkeypatch, capsys
):
    """`deploy --on-demand --secrets-from-env` of a spot YAML, then the pod gone (terminated, or a spot pod
    RunPod removed) before any supervisor saw it: with no pod to copy from, the supervisor went by the YAML and
    made a spot pod holding secret references that name no RunPod secret. Deploy records what it rented where
    supervisors look; here a laptop's supervisor, in this machine's state."""
    import yaml

    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    path = tmp_path / "deploy.yaml"
    tree = deploy_config().model_dump(mode="json")
    tree["budget"]["hourly_usd"] = 2.0  # deploy refuses a budget the pod could not count without its price
    tree["secrets"] = ["HF_TOKEN"]
    path.write_text(yaml.safe_dump(tree))
    assert tree["pod"]["spot"] is True
    assert cli.main(["deploy", str(path), "--on-demand", "--secrets-from-env", "--force"]) == 0
    out = capsys.readouterr().out
    assert "runs/.tiny.DEPLOYED is not recorded on the volume" in out and "supervise.yml" in out, out
    client_for(fake).terminate_pod(the_pod(fake)["id"])
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 0
    new = the_pod(fake)
    assert new["interruptible"] is False, "deployed on demand: the new pod is too"
    assert new["env"]["HF_TOKEN"] == "hf_realsecretvalue123", "deployed with the value: the new pod has it"


def secrets_config() -> DeployConfig:
    cfg = deploy_config()
    cfg.secrets = ["HF_TOKEN", "WANDB_API_KEY"]
    return cfg


SHELL_SECRETS = {"HF_TOKEN": "hf_realsecretvalue123", "WANDB_API_KEY": "wandb_realsecret456"}


def test_a_gone_pod_deployed_with_secret_values_is_created_again_with_them(fake, volume, monkeypatch):
    """deploy --secrets-from-env sent values, not RunPod secrets: the new pod needs them too (from the
    supervisor's own environment), and the supervisor's state on the volume never holds one."""
    for name, value in SHELL_SECRETS.items():
        monkeypatch.setenv(name, value)
    cfg = secrets_config()
    first = deploy(client_for(fake), cfg, dict(SHELL_SECRETS)).pod
    state = volume.run("tiny").root / "supervise.json"
    sup = Supervisor(client_for(fake), cfg, volume, state, clock=Clock(), sleep=lambda s: None)
    assert sup.step() is None  # the pod RUNNING: the supervisor sees how its secrets were sent
    client_for(fake).terminate_pod(first.id)  # reclaimed, and gone from the account
    assert sup.step() is None
    new = the_pod(fake)
    assert new["id"] != first.id
    assert {n: new["env"][n] for n in SHELL_SECRETS} == SHELL_SECRETS, "the new pod lost the secrets' values"
    assert not any(value in state.read_text() for value in SHELL_SECRETS.values())


def test_a_gone_pod_with_secret_values_the_supervisor_lacks_is_not_created_blind(fake, volume, monkeypatch):
    cfg = secrets_config()
    first = deploy(client_for(fake), cfg, dict(SHELL_SECRETS)).pod
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", SHELL_SECRETS["WANDB_API_KEY"])
    sup = Supervisor(client_for(fake), cfg, volume, volume.run("tiny").root / "supervise.json",
                     clock=Clock(), sleep=lambda s: None)  # fmt: skip
    assert sup.step() is None
    client_for(fake).terminate_pod(first.id)
    with pytest.raises(ConfigError) as raised:
        sup.step()
    assert "HF_TOKEN" in str(raised.value) and "--secrets-from-env" in str(raised.value)
    assert "WANDB_API_KEY" not in str(raised.value).split("deploy")[0]
    assert not fake.pods_named("tiny-pretrain"), "no pod is made to run without its secrets"


def test_a_gone_pod_deployed_with_runpod_secrets_keeps_the_references(fake, volume, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")  # in the supervisor's shell, never sent
    cfg = secrets_config()
    first = deploy(client_for(fake), cfg).pod
    sup = supervisor(fake, volume)
    sup.config.secrets = cfg.secrets
    assert sup.step() is None
    client_for(fake).terminate_pod(first.id)
    assert sup.step() is None
    assert the_pod(fake)["env"]["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}"
    assert "hf_realsecretvalue123" not in str(fake.requests)


def test_a_supervisor_that_sees_neither_the_volume_nor_its_s3_api_says_so_once_at_start_with_the_fix(
    fake, tmp_path, monkeypatch, capfd
):
    """From the API alone a DONE or FAILED run looks like an interrupted one (no exit code in RunPod's
    Pod, v1 or v2): the user must learn at start, not after max_restarts paid restarts."""
    import yaml

    deploy(client_for(fake), deploy_config())
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config(max_restarts=7).model_dump(mode="json")))
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 0
    out = capfd.readouterr()
    (warning,) = [line for line in (out.out + out.err).splitlines() if "WARNING" in line]
    for needed in (
        "DONE",
        "FAILED",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "supervise.max_restarts (7)",
    ):
        assert needed in warning, f"{needed!r} missing from the start warning: {warning}"


def test_a_run_deployed_on_demand_is_never_brought_back_as_spot_by_a_supervisor_reading_the_spot_yaml(
    fake, volume
):
    """`deploy --on-demand` of a spot YAML, then a supervisor elsewhere (cron, CI, a supervise pod) with
    the YAML alone: its new pods (start refused, or the pod gone) were spot, interruptible against the
    user's choice; the reverse made a spot run's new pods on-demand, at about twice the price."""
    cfg = deploy_config()
    cfg.pod.spot = False  # what --on-demand did for the deploy
    first = deploy(client_for(fake), cfg).pod
    sup = supervisor(fake, volume)  # the YAML: spot
    assert sup.config.pod.spot is True
    assert sup.step() is None
    fake.refuse_start.add(first.id)
    fake.interrupt(first.id)
    assert sup.step() is None  # start refused: a new pod on the same volume
    (second,) = fake.pods_named("tiny-pretrain")
    assert second["id"] != first.id and second["interruptible"] is False, "the replacement became spot"
    client_for(fake).terminate_pod(second["id"])  # gone: nothing left to copy
    assert sup.step() is None
    assert the_pod(fake)["interruptible"] is False, "the new pod became spot"


def a_spot_yaml_with_a_secret(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "deploy.yaml"
    tree = deploy_config().model_dump(mode="json")
    tree["budget"]["hourly_usd"] = 2.0  # deploy refuses a budget the pod could not count without its price
    tree["secrets"] = ["HF_TOKEN"]
    path.write_text(yaml.safe_dump(tree))
    assert tree["pod"]["spot"] is True
    return path


def test_a_supervisor_elsewhere_makes_a_pod_gone_before_its_first_look_as_deployed_through_s3(
    fake, volume_s3, tmp_path, monkeypatch
):
    """`deploy --on-demand --secrets-from-env` from a laptop, the pod gone before the scheduled supervise.yml
    (its own state, the volume through S3) ever saw it: the deploy's record lived in the laptop's state alone,
    so the runner made a spot pod with secret references that name no RunPod secret. The record now travels
    beside the run through the volume's S3 API, holding no value."""
    client_for(fake).terminate_pod(the_pod(fake)["id"])  # the volume exists (its bucket too); no pod left
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted-here"))
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    path = a_spot_yaml_with_a_secret(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "laptop"))
    assert cli.main(["deploy", str(path), "--on-demand", "--secrets-from-env", "--force"]) == 0
    client_for(fake).terminate_pod(the_pod(fake)["id"])
    record = volume_s3.read("runs/.tiny.DEPLOYED")
    assert record is not None and b"hf_realsecretvalue123" not in record, record
    assert volume_s3.folders("runs/") == [], "a deploy makes no run folder: the run never started"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ci-runner"))
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 0
    new = the_pod(fake)
    assert new["interruptible"] is False, "deployed on demand: the new pod is too"
    assert new["env"]["HF_TOKEN"] == "hf_realsecretvalue123", "deployed with the value: the new pod has it"


def test_a_supervise_pod_on_the_volume_makes_a_pod_gone_before_its_first_look_as_deployed(
    fake, tmp_path, monkeypatch
):
    """The supervise workload on the volume, deployed before the run's pod ever booted: runs/<run>/ did not
    exist, so the deploy recorded nothing there and the supervise pod made a spot pod. The record lies beside
    the run folder, never in it: a run that never started has no folder, and `trainpod ls` shows no run."""
    from trainpod.remote.listing import LocalFiles, volume_lines

    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    volume = Volume(tmp_path / "volume")
    volume.root.mkdir()
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume.root))
    path = a_spot_yaml_with_a_secret(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    assert cli.main(["deploy", str(path), "--on-demand", "--force"]) == 0
    client_for(fake).terminate_pod(the_pod(fake)["id"])
    assert not volume.run("tiny").root.exists(), "a deploy makes no run folder: boot's first start makes it"
    assert not [line for line in volume_lines(LocalFiles(volume.root)) if line.startswith("runs/")]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "supervise-pod"))
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 0
    new = the_pod(fake)
    assert new["interruptible"] is False, "deployed on demand: the new pod is too"
    assert new["env"]["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}", "deployed with references: so is it"


def test_a_pod_seen_overrides_an_older_deploy_record_and_a_newer_deploy_record_replaces_it(
    fake, tmp_path, monkeypatch
):
    """The record is what the newest deploy rented: a pod the supervisor saw since is what the run has (it is
    made again as seen), and a deploy after that sighting (--on-demand now) is followed once its pod is gone."""
    from trainpod.runpod.supervise import DeployRecord, deploy_record_key, record_deployment

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "deploying-laptop"))
    volume = Volume(tmp_path / "volume")
    volume.root.mkdir()
    record_deployment("tiny", volume, spot=False, secrets_as_values=False)
    deploy(client_for(fake), deploy_config())  # then a spot pod, by a deploy that reached no volume
    sup = Supervisor(client_for(fake), deploy_config(), volume, tmp_path / "supervise-pod.json",
                     clock=Clock(), sleep=lambda s: None)  # fmt: skip
    assert sup.step() is None
    client_for(fake).terminate_pod(the_pod(fake)["id"])
    assert sup.step() is None
    assert the_pod(fake)["interruptible"] is True, "made as the pod seen, not as the older record"

    record_deployment("tiny", volume, spot=False, secrets_as_values=False)
    newer = DeployRecord.parse((volume.root / deploy_record_key("tiny")).read_bytes())
    assert newer is not None and newer.spot is False
    client_for(fake).terminate_pod(the_pod(fake)["id"])
    assert sup.step() is None
    assert the_pod(fake)["interruptible"] is False, "the newer deploy's record: on demand"


def test_a_supervise_pod_looking_before_the_runs_first_start_makes_no_run_folder_for_a_refused_start_to_mark(
    fake, tmp_path, monkeypatch
):
    """The supervise pod on the volume kept its state in runs/<run>/supervise.json: its first look made the run
    folder before the run's first start, whose refusal (exit 2, a missing dataset) then found a folder and marked
    the run FAILED, a run that never started. Its state lies beside the run folder now, as the deploy record does."""
    from trainpod.runpod.supervise import supervise

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    volume = Volume(tmp_path / "volume")
    (volume.root / "runs").mkdir(parents=True)
    deploy(client_for(fake), deploy_config())
    assert supervise(deploy_config(), volume, once=True, client=client_for(fake), clock=Clock()) == 0
    assert not volume.run("tiny").root.exists(), "a supervisor's look makes no run folder"
    after_workload(2, volume.run("tiny"), {}, "pretrain")  # the first start refused: bad input
    assert not (volume.run("tiny").root / FAILED_MARKER).exists()
    fake.interrupt(the_pod(fake)["id"])
    assert supervise(deploy_config(), volume, once=True, client=client_for(fake), clock=Clock()) == 0
    assert the_pod(fake)["desiredStatus"] == "RUNNING", "its state (restarts) read back from beside the run"
    assert not volume.run("tiny").root.exists()


def test_trainpod_stop_of_a_run_that_never_started_makes_no_run_folder_yet_supervisors_see_it(
    fake, tmp_path, monkeypatch
):
    """`trainpod stop` wrote runs/<run>/STOPPED (and, mounted, the supervisor's state in runs/<run>/): a run that
    never started got a folder, which boot takes for a started run at its refused first start."""
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    volume = Volume(tmp_path / "volume")
    (volume.root / "runs").mkdir(parents=True)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume.root))
    deploy(client_for(fake), deploy_config())
    assert cli.main(["stop", "tiny"]) == 0
    assert not volume.run("tiny").root.exists(), "a stop makes no run folder"
    sup = Supervisor(client_for(fake), deploy_config(), volume, tmp_path / "elsewhere.json", clock=Clock())
    assert sup.step() == 0, "a supervisor with state of its own sees the stop on the volume"
    assert the_pod(fake)["desiredStatus"] == "EXITED"


def test_a_volume_with_the_supervisor_state_and_stop_inside_the_run_folder_is_still_read_and_cleared(
    fake, volume, tmp_path, monkeypatch
):
    """Volumes supervised before the state and STOPPED moved beside the run folder: their runs/<run>/STOPPED still
    keeps the run down, their runs/<run>/supervise.json still counts, and `trainpod deploy` clears the stop."""
    from trainpod.runpod.supervise import SupervisorState, mark_stopped, state_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    deploy(client_for(fake), deploy_config())
    run_folder = volume.run("tiny").root
    atomic.write_json(run_folder / "supervise.json", {"restarts": 7})
    assert SupervisorState.load(state_path(volume, "tiny")).restarts == 7
    atomic.write_json(run_folder / "STOPPED", {"unix": 1.0})
    assert Supervisor(client_for(fake), deploy_config(), volume, state_path(volume, "tiny")).step() == 0
    mark_stopped("tiny", volume, stopped=False)  # what `trainpod deploy` does first
    assert not (run_folder / "STOPPED").exists()
    fake.interrupt(the_pod(fake)["id"])
    assert Supervisor(client_for(fake), deploy_config(), volume, state_path(volume, "tiny")).step() is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING"
    assert SupervisorState.load(state_path(volume, "tiny")).restarts == 8, "counted on from the old state"


def test_a_deploy_that_reaches_no_volume_replaces_an_older_deploy_record_through_its_pod(
    fake, tmp_path, monkeypatch
):
    """An earlier `deploy --on-demand` recorded runs/.<run>.DEPLOYED; a later deploy as the YAML says (spot) from a
    laptop that reaches neither the volume nor its S3 API recorded nothing, and said nothing (no flag given): the
    older record stayed in force, and a supervise pod whose first look found the pod gone made it on demand. The
    deploy gives its record to the pod (TRAINPOD_DEPLOYED), whose boot writes it on the volume when it is newer."""
    from trainpod import boot as boot_module
    from trainpod.runpod.supervise import DeployRecord, deploy_record_key, record_deployment

    volume = Volume(tmp_path / "volume")
    volume.root.mkdir()
    record_deployment(
        "tiny", volume, spot=False, secrets_as_values=False
    )  # the earlier deploy, mounted there
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    assert cli.main(["deploy", str(a_spot_yaml_with_a_secret(tmp_path)), "--force"]) == 0
    pod = the_pod(fake)
    assert pod["interruptible"] is True
    # The pod boots on the volume (its config is refused here, exit 2: the record is the deploy's, not the run's).
    environ = {
        **pod["env"],
        "TRAINPOD_VOLUME": str(volume.root),
        "TRAINPOD_CONFIG": str(tmp_path / "absent.yaml"),
    }
    assert boot_module.boot(environ) == 2
    record = DeployRecord.parse((volume.root / deploy_record_key("tiny")).read_bytes())
    assert record is not None and record.spot is True and record.secrets_as_values is False
    assert not volume.run("tiny").root.exists()

    client_for(fake).terminate_pod(pod["id"])
    sup = Supervisor(
        client_for(fake), deploy_config(), volume, tmp_path / "supervise-pod.json", clock=Clock()
    )
    assert sup.step() is None
    assert the_pod(fake)["interruptible"] is True, "made as the newest deploy rented it: spot"


def test_a_pod_started_again_never_puts_back_the_record_of_the_deploy_that_made_it(
    fake, tmp_path, monkeypatch
):
    """A pod keeps its env for life: started again after newer deploys recorded theirs, its boot must not write
    its older record over them, nor may deploy take the record's time in its env for a change of config."""
    from trainpod import boot as boot_module
    from trainpod.runpod.supervise import DeployRecord, deploy_record_key, record_deployment

    volume = Volume(tmp_path / "volume")
    volume.root.mkdir()
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    path = a_spot_yaml_with_a_secret(tmp_path)
    assert cli.main(["deploy", str(path), "--force"]) == 0
    first = the_pod(fake)
    record_deployment("tiny", volume, spot=False, secrets_as_values=True)  # newer, as another deploy would
    client_for(fake).stop_pod(first["id"])
    assert cli.main(["deploy", str(path), "--force"]) == 0
    assert the_pod(fake)["id"] == first["id"], "the same config: the pod is started again, not replaced"
    environ = {
        **first["env"],
        "TRAINPOD_VOLUME": str(volume.root),
        "TRAINPOD_CONFIG": str(tmp_path / "absent.yaml"),
    }
    assert boot_module.boot(environ) == 2
    record = DeployRecord.parse((volume.root / deploy_record_key("tiny")).read_bytes())
    assert record is not None and record.secrets_as_values is True, "the newer record stays"


def test_supervise_refuses_the_shipped_placeholder_image_before_it_rents_a_pod(
    fake, tmp_path, monkeypatch, capsys
):
    """The README's `trainpod supervise finetune-qlora --config configs/deploy/finetune-spot.yaml`, run as
    shipped: deploy refuses ghcr.io/YOUR_ORG/..., but the supervisor found no pod and rented one with it, a
    paid GPU pulling an image no registry serves."""
    import yaml

    from trainpod.runpod.supervise import supervise

    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted-here"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree = deploy_config().model_dump(mode="json")
    tree["image"]["name"] = "ghcr.io/YOUR_ORG/trainpod:0.1.0"
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(tree))

    assert cli.main(["supervise", "tiny", "--config", str(path), "--once"]) == 2
    assert (
        "image.name='ghcr.io/YOUR_ORG/trainpod:0.1.0' is the shipped placeholder" in capsys.readouterr().out
    )
    assert not fake.pods_named("tiny-pretrain") and not fake.templates, "nothing is rented or made"
    with pytest.raises(ConfigError, match="shipped placeholder"):  # as the supervise workload calls it
        supervise(DeployConfig.model_validate(tree), None, once=True, client=client_for(fake))
    assert not fake.pods_named("tiny-pretrain")


def test_supervise_refuses_a_volume_flag_that_names_no_folder_instead_of_going_blind(
    fake, tmp_path, monkeypatch, capsys
):
    import yaml

    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    typo = tmp_path / "volum"
    assert cli.main(["supervise", "tiny", "--config", str(path), "--once", "--volume", str(typo)]) == 2
    assert f"volume {typo} does not exist here" in capsys.readouterr().out
    assert not fake.pods_named("tiny-pretrain"), "no pod made for a run whose DONE it could not see"


@contextlib.contextmanager
def s3_refusing_the_key(monkeypatch, tmp_path):
    """RunPod's S3 API refusing the exported S3 key (revoked, a typo in it) at every request, with the run's deploy
    config as TRAINPOD_CONFIG (its volume looked up by name through the API)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import yaml

    class RefusingS3(BaseHTTPRequestHandler):
        def _refuse(self):
            body = b"<Error><Code>InvalidAccessKeyId</Code><Message>no such key</Message></Error>"
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _refuse  # noqa: N815 - http.server's names

        def log_message(self, *_):
            pass

    s3 = ThreadingHTTPServer(("127.0.0.1", 0), RefusingS3)
    threading.Thread(target=s3.serve_forever, daemon=True).start()
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    monkeypatch.setenv("TRAINPOD_CONFIG", str(path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "user_2f21CfO73Mm2Uq2lEGFiEF24IPw")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rps_FAKESECRETFORTESTS0123456789")
    monkeypatch.setenv("TRAINPOD_S3_ENDPOINT_URL", f"http://127.0.0.1:{s3.server_port}")
    try:
        yield path
    finally:
        s3.shutdown()
        s3.server_close()


def test_a_stop_whose_record_on_the_volume_fails_still_stops_the_pods_and_says_what_is_not_recorded(
    fake, tmp_path, monkeypatch, capsys
):
    """RunPod's S3 API refusing the S3 key (revoked, a typo in it) or unreachable while the user stops a run: the
    record of the stop failed (exit 2 or 75) before any pod was stopped, and every GPU went on billing."""
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    deploy(client_for(fake), deploy_config())
    with s3_refusing_the_key(monkeypatch, tmp_path):
        assert cli.main(["stop", "tiny"]) == 0
    out = capsys.readouterr().out
    assert the_pod(fake)["desiredStatus"] == "EXITED", "the pod is stopped: it bills no more"
    assert "STOPPED is not recorded on the volume" in out and "S3 API key was refused" in out, out
    assert "SUPERVISE_RUN" in out, "what to do about a supervisor elsewhere"
    from trainpod.runpod.supervise import SupervisorState, state_path

    stopped_here = SupervisorState.load(state_path(None, "tiny")).stopped_unix
    assert stopped_here is not None, "this machine's supervisor knows"


def test_a_deploy_whose_clear_of_the_stop_fails_says_what_failed_and_keeps_the_stop_here_too(
    fake, tmp_path, monkeypatch, capsys
):
    """A deploy refuses to go on while the run's STOPPED on the volume cannot be removed (a supervisor elsewhere
    reading it would leave the new pod down after an interruption), but it said only S3's 'could not remove
    s3://...', not that this was the deploy's clear of the user's stop, that nothing was made, nor the ways on;
    and it had cleared this machine's record of the stop first, so a supervisor here going by the API alone (S3
    unreadable) started the stopped pod again though the deploy was refused."""
    from trainpod.runpod.supervise import SupervisorState, state_path

    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    deploy(client_for(fake), deploy_config())
    with s3_refusing_the_key(monkeypatch, tmp_path) as path:
        assert cli.main(["stop", "tiny"]) == 0
        capsys.readouterr()
        assert cli.main(["deploy", str(path)]) == 2
    out = capsys.readouterr().out
    assert "deploy refused" in out and "runs/.tiny.STOPPED" in out and "trainpod stop" in out, out
    assert "S3 API key was refused" in out and "nothing was made or started" in out
    assert "rm " in out, "how to remove it by hand"
    assert the_pod(fake)["desiredStatus"] == "EXITED", "nothing started"
    stopped_here = SupervisorState.load(state_path(None, "tiny")).stopped_unix
    assert stopped_here is not None, "this machine keeps the stop"


def test_a_deploy_whose_clear_of_the_stop_on_the_mounted_volume_fails_is_one_message_not_a_traceback(
    fake, tmp_path, monkeypatch, capsys
):
    """An I/O error removing runs/.<run>.STOPPED from the volume mounted here (a network volume's FUSE) was an
    OSError no handler took: a traceback and exit 1."""
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    volume = tmp_path / "volume"
    (volume / "runs/.tiny.STOPPED/unremovable").mkdir(parents=True)  # unlink() fails on it as on an I/O error
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume))
    deploy(client_for(fake), deploy_config())
    fake.interrupt(the_pod(fake)["id"])
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    assert cli.main(["deploy", str(path)]) == 75
    out = capsys.readouterr().out
    assert "deploy refused" in out and f"on the volume at {volume}" in out and "Traceback" not in out, out
    assert the_pod(fake)["desiredStatus"] == "EXITED", "nothing started"


def test_a_supervisor_whose_account_has_no_funds_ends_saying_so_instead_of_backing_off(fake, volume, caplog):
    """A 402 to the replacement's create (the account's balance spent) was a failed start backed off and tried
    again until 'N failed starts in a row ... try again later or add GPU types' (exit 75), which RunPod restarts
    a supervise pod on; no later try is paid for until funds are added, as with a key RunPod refuses."""
    interrupted_pod_that_cannot_come_back(fake)
    fake.out_of_funds = True
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() == 2
    assert "balance" in caplog.text and "add GPU types" not in caplog.text


def test_a_first_deploy_with_the_s3_key_exported_says_nothing_of_a_volume_it_is_about_to_make(
    fake, s3_server, tmp_path, monkeypatch, capsys
):
    """Before the pod, deploy clears the run's STOPPED on the volume through S3, its id looked up by name: on a first
    deploy there is no volume yet, and the deploy warned 'not reading the run's markers through S3: no network volume
    named ...; `trainpod deploy CONFIG` creates it', the very command running, as if it had failed to."""
    on_a_laptop_that_sees_neither_the_volume_nor_its_s3_api(fake, monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "user_2f21CfO73Mm2Uq2lEGFiEF24IPw")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rps_FAKESECRETFORTESTS0123456789")
    monkeypatch.setenv("TRAINPOD_S3_ENDPOINT_URL", s3_server)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy_config().model_dump(mode="json")))
    assert cli.main(["deploy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no network volume named" not in out and "not reading the run's markers" not in out, out
    assert the_pod(fake)["desiredStatus"] == "RUNNING"
