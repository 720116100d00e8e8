"""A deploy's `then`: the conversion a pod runs once its run is DONE, before it stops (docs/design.md, "Then: a
conversion after DONE"). Real boots against the fake RunPod API (the mock of RunPod), the supervisor's looks at
a volume whose markers the test writes, and the deploy's checks."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainpod import atomic, cli
from trainpod.boot import boot
from trainpod.config.deploy import DeployConfig
from trainpod.deploy_checks import config_problems
from trainpod.runpod.deploy import deploy, pod_env
from trainpod.runpod.finish import FAILED_MARKER, after_workload, begin_start
from trainpod.runpod.supervise import DeployRecord, Supervisor, SupervisorState, deploy_record_key
from trainpod.volume import Volume

from fake_runpod import api_env, client_for
from support import RUN, TINY_PRETRAIN, child_env

# Four steps of the tiny pretrain: a DONE run with a checkpoint in seconds. These overrides are the training
# config's: the conversion after it is loaded without them (its config has no `train`).
FOUR_STEPS = (
    "train.max_steps=4 train.warmup_steps=1 checkpoint.every_steps=2 train.eval_every=2 train.log_every=2"
)
EXPORT = f"name: {RUN}\ntask:\n  - kind: export\n    output: hf-final\n"


@pytest.fixture
def pod(fake) -> dict:
    body = {"name": f"{RUN}-pretrain", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"], "interruptible": True}
    pod = fake.pods[client_for(fake).create_pod(body).id]
    fake.requests.clear()
    return pod


def then_config(tmp_path: Path, text: str = EXPORT) -> Path:
    path = tmp_path / "convert.yaml"
    path.write_text(text)
    return path


def pretrain_pod_env(fake, pod, volume: Path, then: Path, **extra: str) -> dict[str, str]:
    return child_env(
        {
            **api_env(fake),
            "RUNPOD_POD_ID": pod["id"],
            "TRAINPOD_VOLUME": str(volume),
            "TRAINPOD_WORKLOAD": "pretrain",
            "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
            "TRAINPOD_SET": FOUR_STEPS,
            "TRAINPOD_THEN_CONFIG": str(then),
            **extra,
        }
    )


def boot_in_a_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_pod_converts_its_run_after_done_then_stops_and_started_again_converts_nothing_twice(
    fake, pod, volume, tmp_path
):
    env = pretrain_pod_env(fake, pod, volume, then_config(tmp_path))
    first = boot_in_a_child(env)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    run = Volume(volume).run(RUN)
    export = run.export / "hf-final"
    assert (export / "manifest.json").is_file(), out
    assert out.index("exported the model in HF format to") < out.index(
        f"asked RunPod to stop this pod ({pod['id']})"
    )
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "the pod stops after the conversion"
    record = atomic.read_json(run.then_record)
    assert (record["workload"], record["outcome"], record["exit"]) == ("convert", "done", 0)
    assert "hf-final" in (run.logs / "convert.log").read_text(), "the conversion's log is the run's too"

    # A stop during the conversion, or a deploy again: the pod boots, its DONE run's start exits at once,
    # and the conversion runs again, skipping what it made.
    made = (export / "manifest.json").stat().st_mtime_ns
    client_for(fake).start_pod(pod["id"])
    again = boot_in_a_child(env)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert "is already DONE" in out and "is up to date (same inputs and settings); skipping" in out
    assert (export / "manifest.json").stat().st_mtime_ns == made
    assert atomic.read_json(run.then_record)["unix"] > record["unix"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def refused_at_boot(tmp_path: Path, then_text: str = EXPORT, **extra: str) -> Path:
    """Boot a tiny pretrain on an empty volume with `then_text` after DONE (and `extra` in its environment): exit 2
    is asserted; the volume is returned to look at."""
    volume = tmp_path / "volume"
    volume.mkdir()
    env = {
        "TRAINPOD_VOLUME": str(volume),
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
        "TRAINPOD_THEN_CONFIG": str(then_config(tmp_path, then_text)),
        **extra,
    }
    assert boot(env) == 2
    return volume


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (f"name: {RUN}\ntask:\n  - kind: export\n    stepp: 3\n", "task.0.export.stepp"),
        (
            f"name: {RUN}\ntask:\n  - kind: hub\n    source: hf\n    repo_id: someone/tiny\n",
            "HF_TOKEN is not set",
        ),
    ],
    ids=["a typo", "a push without HF_TOKEN"],
)
def test_a_conversion_that_cannot_run_is_exit_2_at_boot_before_any_training(tmp_path, capsys, text, named):
    volume = refused_at_boot(tmp_path, text)
    assert named in capsys.readouterr().out
    assert not (volume / "runs" / RUN).exists(), "nothing trained, nothing written"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {"TRAINPOD_THEN_WORKLOAD": "pretrain"},
            "TRAINPOD_THEN_WORKLOAD='pretrain' is no conversion workload",
        ),
        (
            {"TRAINPOD_WORKLOAD": "datagen", "TRAINPOD_CONFIG": "configs/datagen/tiny.yaml"},
            "a conversion follows",
        ),
        ({"NUM_NODES": "2", "NODE_RANK": "0", "PRIMARY_ADDR": "10.0.0.1"}, "on a cluster of 2 nodes"),
    ],
    ids=["not a conversion", "after a workload that is never DONE", "on a cluster"],
)
def test_a_then_that_cannot_follow_is_exit_2_at_boot_naming_the_variable(tmp_path, capsys, extra, named):
    volume = refused_at_boot(tmp_path, **extra)
    assert named in capsys.readouterr().out
    assert not (volume / "runs").exists() or not any((volume / "runs").iterdir())


def done_command_run(tmp_path: Path) -> tuple[Path, Path]:
    """A volume holding a DONE command run (its start exits at once) and that run's config."""
    volume, workdir = tmp_path / "volume", tmp_path / "repo"
    workdir.mkdir()
    (workdir / "prog.py").write_text("raise SystemExit('never run: the run is DONE')\n")
    run = Volume(volume).run("mine")
    run.create()
    atomic.write_json(run.done, {"step": 3})
    config = tmp_path / "command.yaml"
    config.write_text(f"name: mine\ncommand: [python, prog.py]\nworkdir: {workdir}\n")
    return volume, config


def done_pod_env(fake, pod, volume: Path, config: Path, then: Path, **extra: str) -> dict[str, str]:
    """The environment of the pod of done_command_run's run, converting with `then` after DONE."""
    return {
        **api_env(fake),
        "RUNPOD_POD_ID": pod["id"],
        "TRAINPOD_VOLUME": str(volume),
        "TRAINPOD_WORKLOAD": "command",
        "TRAINPOD_CONFIG": str(config),
        "TRAINPOD_THEN_CONFIG": str(then),
        **extra,
    }


def test_a_conversion_that_fails_after_done_is_recorded_stops_the_pod_and_leaves_the_run_done(
    fake, pod, tmp_path, capsys
):
    volume, config = done_command_run(tmp_path)
    then = then_config(tmp_path, "name: mine\ntask:\n  - kind: export\n    step: 99\n")
    env = done_pod_env(fake, pod, volume, config, then)
    assert boot(env) == 2
    run = Volume(volume).run("mine")
    record = atomic.read_json(run.then_record)
    assert (record["outcome"], record["exit"]) == ("failed", 2)
    assert "it is not a pretrain run on this volume" in record["reason"], (
        "why, though its refusal wrote no log"
    )
    assert not (run.logs / "convert.log").exists(), "a refusal writes nothing"
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED", "bad input: the pod stops at once"
    assert run.done.exists() and not (run.root / FAILED_MARKER).exists(), "the run stays DONE"

    assert cli.main(["status", "mine", "--volume", str(volume)]) == 0
    assert "after DONE  convert failed, exit 2: bad config or input" in capsys.readouterr().out


def test_a_done_runs_pod_whose_conversion_config_is_refused_records_it_for_its_supervisor(
    fake, pod, tmp_path
):
    """A DONE run's pod started again (a spot stop during the conversion) with a conversion config refused at boot:
    without a record its supervisor, waiting for the conversion's end, started the pod again and again."""
    volume, config = done_command_run(tmp_path)
    then = then_config(tmp_path, "name: mine\ntask:\n  - kind: mlxx\n")
    # TRAINPOD_RUN as a deploy sets it: the run is known before any config is read
    env = done_pod_env(fake, pod, volume, config, then, TRAINPOD_RUN="mine")
    assert boot(env) == 2
    run = Volume(volume).run("mine")
    record = atomic.read_json(run.then_record)
    assert (record["outcome"], record["exit"]) == ("failed", 2)
    assert record["reason"].startswith(f"TRAINPOD_THEN_CONFIG={str(then)!r}: ") and "mlxx" in record["reason"]
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert run.done.exists() and not (run.root / FAILED_MARKER).exists()


def test_the_conversion_after_done_converts_the_done_run_whatever_name_its_config_gives(fake, pod, tmp_path):
    """A pod without TRAINPOD_RUN (made by hand from infra/runpod/template.json) whose `then` config names another
    run: that run was converted (or pushed to the Hub), and the DONE run's then.json told of it."""
    volume, config = done_command_run(tmp_path)
    other = Volume(volume).run("other")
    other.create()
    atomic.write_json(other.done, {"step": 1})
    then = then_config(tmp_path, "name: other\ntask:\n  - kind: export\n    step: 99\n")
    env = done_pod_env(fake, pod, volume, config, then)
    assert boot(env) == 2
    reason = atomic.read_json(Volume(volume).run("mine").then_record)["reason"]
    assert "run mine has no" in reason and "other" not in reason.split("; its log")[0], reason


class StopWhen(logging.Handler):
    """A spot stop (SIGTERM to this process) at the moment a log line says `text`: an event of the boot's own, no
    sleep. The workload's stop handler only notes it, as in a pod."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            signal.raise_signal(signal.SIGTERM)


def test_a_spot_stop_as_the_run_becomes_done_leaves_the_conversion_to_the_pod_started_again(
    fake, pod, tmp_path
):
    """SIGTERM between the DONE start's end and the conversion: the conversion started anyway ran into the SIGKILL
    5 s later with the run's lease held, and its pod's replacement waited that lease out."""
    volume, config = done_command_run(tmp_path)
    then = then_config(tmp_path, "name: mine\ntask:\n  - kind: export\n    step: 99\n")
    env = done_pod_env(fake, pod, volume, config, then)
    stop = StopWhen("is already DONE")
    logging.getLogger("trainpod").addHandler(stop)
    try:
        assert boot(env) == 143
    finally:
        logging.getLogger("trainpod").removeHandler(stop)
    run = Volume(volume).run("mine")
    assert not run.then_record.exists(), "nothing ended: its supervisor brings the pod back to convert"
    assert not (run.logs / "convert.log").exists(), "the conversion never began"
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "a spot stop: RunPod stops the pod itself"
    assert run.done.exists() and not (run.root / FAILED_MARKER).exists()


def test_a_conversion_killed_without_a_word_is_counted_so_an_oom_loop_ends_at_the_bound(fake, pod, tmp_path):
    """The OOM killer takes the merge: no exit code, the container starts again, the DONE run's start converts again
    into the same kill. Uncounted, the pod billed in that loop for good, its supervisor waiting for then.json."""
    volume, config = done_command_run(tmp_path)
    run = Volume(volume).run("mine")
    # What this pod's conversion left when the kill came: the mark of its start in flight.
    atomic.write_json(run.root / "START-convert", {"unix": 1.0, "latest": None, "pod": pod["id"]})
    then = then_config(tmp_path, "name: mine\ntask:\n  - kind: export\n    step: 99\n")
    env = done_pod_env(fake, pod, volume, config, then, TRAINPOD_MAX_FAILED_STARTS="1")
    assert boot(env) == 137, "counted as a kill: the bound, and no conversion into the same kill"
    record = atomic.read_json(run.then_record)
    assert (record["outcome"], record["exit"]) == ("failed", 137), record
    assert "ended without a word" in record["reason"]
    assert not (run.logs / "convert.log").exists()
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"
    assert run.done.exists() and not (run.root / FAILED_MARKER).exists(), "the run stays DONE"
    assert not (run.root / "START").exists(), "the run's own start marker is the training's alone"


def test_a_conversion_under_way_is_no_end_and_one_of_another_pod_is_not_counted(fake, pod, tmp_path):
    run = Volume(tmp_path).run("mine")
    run.create()
    atomic.write_json(run.done, {"step": 3})
    env = {**api_env(fake), "RUNPOD_POD_ID": pod["id"], "TRAINPOD_MAX_FAILED_STARTS": "1"}
    assert begin_start(run, env, "convert", owns_run=False, then_step=True) is None
    assert atomic.read_json(run.root / "START-convert")["pod"] == pod["id"]
    assert run.then_outcome() is None, "under way: no end for supervisors or `trainpod status`"
    other = {**env, "RUNPOD_POD_ID": "another-pod"}
    assert begin_start(run, other, "convert", owns_run=False, then_step=True) is None, (
        "another pod's mark: maybe a conversion still running there"
    )
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"


def test_a_done_run_whose_training_config_no_longer_loads_still_converts_with_the_volumes_caches(
    fake, pod, tmp_path
):
    """A DONE run's pod started again after its training config was edited (or its branch deleted): that start is
    refused before it makes the volume's folders and points HF_HOME at the volume, and the conversion after it
    downloaded a hub base to the container disk, which every restart wipes."""
    volume, config = done_command_run(tmp_path)
    config.write_text(
        "name: mine\ncommand: []\n"
    )  # no longer a valid command config: exit 2 for the training
    then = then_config(tmp_path, "name: mine\ntask:\n  - kind: export\n")
    env = done_pod_env(fake, pod, volume, config, then, TRAINPOD_RUN="mine")
    boot(env)
    assert env.get("HF_HOME") == str(Volume(volume).cache() / "hf")
    assert Volume(volume).run("mine").then_outcome() is not None, "the conversion ran and ended"


def test_a_conversion_in_a_crash_loop_after_done_is_recorded_as_failed_at_the_bound(fake, pod, tmp_path):
    run = Volume(tmp_path).run("mine")
    run.create()
    atomic.write_json(run.done, {"step": 3})
    env = {**api_env(fake), "RUNPOD_POD_ID": pod["id"], "TRAINPOD_MAX_FAILED_STARTS": "2"}
    after_workload(75, run, env, "convert", owns_run=False, then_step=True)
    assert not run.then_record.exists(), "one failure: RunPod starts the container again"
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING"
    after_workload(75, run, env, "convert", owns_run=False, then_step=True)
    assert atomic.read_json(run.then_record)["outcome"] == "failed"
    assert fake.pods[pod["id"]]["desiredStatus"] == "EXITED"


def test_a_done_runs_pod_is_left_running_when_a_conversion_follows(fake, pod, tmp_path):
    run = Volume(tmp_path).run("mine")
    run.create()
    atomic.write_json(run.done, {"step": 3})
    env = {**api_env(fake), "RUNPOD_POD_ID": pod["id"]}
    assert after_workload(0, run, env, "pretrain", then_follows=True) == 0
    assert fake.requests == [], "boot converts first, then stops the pod"
    assert after_workload(143, run, env, "pretrain", then_follows=True) == 143
    assert fake.pods[pod["id"]]["desiredStatus"] == "RUNNING", "a spot stop: RunPod stops the pod itself"


# The supervisor: DONE is the end only once the conversion after it ended, since the newest deploy.

GPUS = ["NVIDIA H100 80GB HBM3"]


def then_deploy_config(**then) -> DeployConfig:
    return DeployConfig.model_validate(
        {
            "run": "tiny",
            "workload": "finetune",
            "config": "configs/finetune/tiny.yaml",
            "image": {"name": "ghcr.io/org/trainpod:0.1.0"},
            "pod": {"gpu_types": GPUS},
            "volume": {"name": "vol", "data_center": "EU-RO-1"},
            "then": {"config": "configs/convert/tiny.yaml", **then},
        }
    )


class Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def supervisor(fake, volume: Volume, config: DeployConfig) -> Supervisor:
    state = volume.run("tiny").root / "supervise.json"
    return Supervisor(client_for(fake), config, volume, state, clock=Clock(), sleep=lambda s: None)


def the_pod(fake) -> dict:
    (pod,) = fake.pods_named("tiny-finetune")
    return pod


@pytest.fixture
def done(tmp_path: Path) -> Volume:
    """A volume whose run `tiny` is DONE."""
    vol = Volume(tmp_path / "volume")
    vol.run("tiny").create()
    atomic.write_json(vol.run("tiny").done, {"step": 40})
    return vol


def test_the_supervisor_brings_a_done_runs_pod_back_until_its_conversion_ended(fake, done, caplog):
    config = then_deploy_config()
    deploy(client_for(fake), config)
    sup = supervisor(fake, done, config)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None and the_pod(fake)["desiredStatus"] == "RUNNING", "converting: not stopped"
    fake.interrupt(the_pod(fake)["id"])  # a spot stop during the merge
    assert sup.step() is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING"
    assert "the run DONE but not its convert after DONE: started pod" in caplog.text
    after_workload(0, done.run("tiny"), {}, "convert", owns_run=False, then_step=True)
    assert sup.step() == 0
    assert the_pod(fake)["desiredStatus"] == "EXITED" and "run is DONE; supervising ends" in caplog.text


def test_a_conversion_that_failed_after_done_ends_supervising_with_exit_2(fake, done, caplog):
    config = then_deploy_config()
    deploy(client_for(fake), config)
    after_workload(2, done.run("tiny"), {}, "convert", owns_run=False, then_step=True)
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, done, config).step() == 2
    assert the_pod(fake)["desiredStatus"] == "EXITED"
    assert "its convert after DONE failed (bad config or input (exit 2)" in caplog.text
    assert "fix configs/convert/tiny.yaml and deploy again" in caplog.text


def test_an_end_of_the_conversion_older_than_the_newest_deploy_is_not_the_end(fake, done):
    """A deploy again after a failed conversion (its config fixed): the pod converts again, and a supervisor that
    took the old failure for this deploy's ended at once, leaving a spot stop during the new conversion down."""
    config = then_deploy_config()
    deploy(client_for(fake), config)
    after_workload(2, done.run("tiny"), {}, "convert", owns_run=False, then_step=True)
    ended = atomic.read_json(done.run("tiny").then_record)["unix"]
    record = DeployRecord(spot=True, secrets_as_values=False, unix=ended + 60)
    (done.root / deploy_record_key("tiny")).write_text(record.to_json())
    fake.interrupt(the_pod(fake)["id"])
    assert supervisor(fake, done, config).step() is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING", "brought back to convert again"


def test_a_deploy_whose_record_reached_only_this_machine_makes_an_older_end_no_end_either(fake, done):
    """`trainpod deploy --supervise` again after a failed conversion, its record kept off the volume by an S3 outage
    (this machine's supervisor state has it): the old failure stopped the new pod before it booted, exit 2."""
    config = then_deploy_config()
    after_workload(2, done.run("tiny"), {}, "convert", owns_run=False, then_step=True)
    ended = atomic.read_json(done.run("tiny").then_record)["unix"]
    deploy(client_for(fake), config)
    sup = supervisor(fake, done, config)
    SupervisorState(spot=True, deployed_unix=ended + 60).save(sup.state_file)
    assert sup.step() is None
    assert the_pod(fake)["desiredStatus"] == "RUNNING", "the new deploy's pod converts again"


def test_a_then_added_after_the_deploy_ends_supervising_saying_to_deploy_again(fake, done, caplog):
    """The pod, started again as it was deployed (without TRAINPOD_THEN_CONFIG), stops at DONE at every start: the
    supervisor, waiting for a conversion that pod never makes, started it again up to supervise.max_restarts."""
    before = then_deploy_config()
    before.then = None
    deploy(client_for(fake), before)
    fake.interrupt(the_pod(fake)["id"])
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, done, then_deploy_config()).step() == 2
    assert the_pod(fake)["desiredStatus"] == "EXITED", "not started again"
    assert "its pod was deployed without `then`" in caplog.text and "`trainpod deploy` again" in caplog.text


def test_without_then_a_done_run_ends_supervising_as_before(fake, done):
    config = then_deploy_config()
    config.then = None
    deploy(client_for(fake), config)
    assert supervisor(fake, done, config).step() == 0


# The deploy: the pod's variables and the checks made before anything is rented.


def test_then_reaches_the_pod_as_its_two_variables(tmp_path):
    env = pod_env(then_deploy_config())
    assert (env["TRAINPOD_THEN_WORKLOAD"], env["TRAINPOD_THEN_CONFIG"]) == (
        "convert",
        "configs/convert/tiny.yaml",
    )
    config = then_deploy_config()
    config.then = None
    assert not {"TRAINPOD_THEN_WORKLOAD", "TRAINPOD_THEN_CONFIG"} & set(pod_env(config))


def deploy_yaml(tmp_path: Path, **changes) -> Path:
    tree = then_deploy_config().model_dump(mode="json", exclude_none=True)
    for key, value in changes.items():
        tree[key] = value
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"then": {"workload": "pretrain", "config": "configs/convert/tiny.yaml"}},
            "then.workload='pretrain' is no",
        ),
        ({"workload": "datagen", "config": "configs/datagen/tiny.yaml"}, "then with workload='datagen'"),
        ({"then": {"config": "configs/pretrain/tiny.yaml"}}, "then.config='configs/pretrain/tiny.yaml'"),
    ],
    ids=["not a conversion", "after a workload that is never DONE", "another workload's config"],
)
def test_deploy_refuses_a_then_the_pod_would_refuse(tmp_path, changes, named):
    path = deploy_yaml(tmp_path, **changes)
    config = DeployConfig.model_validate(yaml.safe_load(path.read_text()))
    problems = config_problems(config, str(path), secrets_from_env=False)
    assert any(named in problem for problem in problems), problems


def test_deploy_refuses_a_then_that_pushes_to_the_hub_without_hf_token(tmp_path):
    convert = tmp_path / "push.yaml"
    convert.write_text("name: tiny\ntask:\n  - kind: hub\n    source: merged\n    repo_id: someone/tiny\n")
    config = then_deploy_config(config=str(convert))
    config.secrets = []
    problems = config_problems(config, str(tmp_path / "deploy.yaml"), secrets_from_env=False)
    assert any(f"then.config={str(convert)!r} pushes to the Hugging Face Hub" in p for p in problems), (
        problems
    )
    config.secrets = ["HF_TOKEN"]
    assert not [p for p in config_problems(config, str(tmp_path / "d.yaml"), False) if "Hugging Face" in p]


def test_a_deploy_dry_run_says_what_runs_after_done(fake, tmp_path, monkeypatch, capsys):
    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))  # no user's ~/.runpod, no state written to theirs
    path = deploy_yaml(tmp_path)
    assert cli.main(["deploy", str(path), "--dry-run", "--force"]) == 0
    out = capsys.readouterr().out
    assert "then       convert with configs/convert/tiny.yaml once the run is DONE, in the same pod" in out
    assert '"TRAINPOD_THEN_CONFIG": "configs/convert/tiny.yaml"' in out
    assert fake.requests == [], "a dry run sends nothing"


def test_a_cluster_with_then_is_refused_at_the_config(tmp_path):
    tree = then_deploy_config().model_dump(mode="json", exclude_none=True)
    tree |= {"nodes": 2, "workload": "pretrain", "pod": {"gpu_types": GPUS, "spot": False}}
    with pytest.raises(ValueError, match="nodes=2 with then.config='configs/convert/tiny.yaml'"):
        DeployConfig.model_validate(tree)
