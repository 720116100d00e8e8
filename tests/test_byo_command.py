"""The `command` workload: a user's program under the kit's lifecycle, run as real processes.

Each test writes a tiny Python program, runs `trainpod run command` (or `trainpod boot`) on a temp
volume, and stops it the way a spot pod is stopped: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import REPO, child_env, run_trainpod, start_trainpod

pytestmark = pytest.mark.slow
RUN = "byo-command"

PROGRAM = """
import json, os, signal, subprocess, sys, time
TIMED_CHILD = '''
import signal, sys, time
def noted(*_):
    open("child.term", "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, noted)
open("child.ready", "w").write("1")
time.sleep(600)
'''
mode = sys.argv[1]
print("run dir", os.environ["TRAINPOD_RUN_DIR"], flush=True)
print("secret", os.environ.get("HF_TOKEN", ""), flush=True)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "env":
    keys = ["TRAINPOD_RUN_DIR", "TRAINPOD_CHECKPOINT_DIR", "TRAINPOD_PREEMPTION_WINDOW_S", "TRAINPOD_RUN",
            "TRAINPOD_LEASE_HELD", "MY_SETTING"]
    json.dump({k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd()}, open("env.json", "w"))
    print("to stderr", file=sys.stderr)
    sys.exit(0)
if mode == "fail":
    open("starts.txt", "a").write("x")
    sys.exit(7)
if mode == "with-child":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open("child.pid", "w").write(str(child.pid))
if mode == "with-torchrun-like-children":  # one in its group, one in a session of its own (torchrun's workers)
    pids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=new).pid
            for new in (False, True)]
    open("children.pids", "w").write(" ".join(map(str, pids)))
if mode == "with-timed-child":  # a DataLoader worker's stand-in: notes when its SIGTERM came
    subprocess.Popen([sys.executable, "-c", TIMED_CHILD])
for i in range(100000):
    print(f"working {i}", flush=True)
    time.sleep(0.05)
"""


def write_setup(tmp_path: Path, mode: str, **config) -> tuple[Path, Path]:
    workdir = tmp_path / "repo"
    workdir.mkdir(exist_ok=True)
    (workdir / "prog.py").write_text(PROGRAM)
    cfg = {"name": RUN, "command": ["python", "prog.py", mode], "workdir": str(workdir), **config}
    path = tmp_path / "command.yaml"
    path.write_text(yaml.safe_dump(cfg))
    volume = tmp_path / "volume"
    volume.mkdir(exist_ok=True)
    return path, volume


def running_program(tmp_path: Path, name: str, source: str, **config) -> tuple[Path, Path]:
    """write_setup's config and volume, with `source` as repo/<name>, the program the command runs."""
    path, volume = write_setup(tmp_path, "env", **config)
    (tmp_path / "repo" / name).write_text(source)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "command": ["python", name]}))
    return path, volume


def run_dir(volume: Path) -> Path:
    return volume / "runs" / RUN


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} never happened; output:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def program_log(volume: Path) -> str:
    path = run_dir(volume) / "logs/program.log"
    return path.read_text() if path.exists() else ""


def test_a_program_that_exits_0_is_done_with_its_environment_and_output_captured(tmp_path):
    config, volume = write_setup(tmp_path, "env", env={"MY_SETTING": "42"})
    result = run_trainpod(
        "run", "command", "--config", str(config), volume=volume, env={"HF_TOKEN": "hf_secret123"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    env = json.loads((tmp_path / "repo/env.json").read_text())
    assert env["TRAINPOD_RUN_DIR"] == str(run_dir(volume))
    assert env["TRAINPOD_CHECKPOINT_DIR"] == str(run_dir(volume) / "checkpoints")
    assert env["TRAINPOD_PREEMPTION_WINDOW_S"] == "4.9" and env["TRAINPOD_LEASE_HELD"] == "1"
    assert (env["TRAINPOD_RUN"], env["MY_SETTING"], env["cwd"]) == (RUN, "42", str(tmp_path / "repo"))
    assert json.loads((run_dir(volume) / "DONE").read_text())["exit_code"] == 0
    log = program_log(volume)
    assert "run dir" in log and "to stderr" in log, "stdout and stderr both go to logs/program.log"
    assert "run dir" in result.stdout and "to stderr" in result.stderr, "and are still shown on the console"
    assert "hf_secret123" not in log + result.stdout, "secrets are masked in the captured output"
    status = json.loads((run_dir(volume) / "status.json").read_text())
    # stdout and stderr are read by two threads: either stream's last line may be the newest one seen.
    assert status["state"] == "done" and status["last_log_line"] in ("to stderr", "secret ***")
    shown = run_trainpod("status", RUN, volume=volume).stdout
    # No checkpoint committed, so no step: the DONE line and the status line said "step None".
    assert f"{RUN}: done | last line: {status['last_log_line']}" in shown, shown
    assert (
        f"run {RUN} DONE: " in result.stdout + result.stderr and "None" not in result.stdout + result.stderr
    )
    assert f"runs/{RUN}: done\n" in run_trainpod("ls", volume=volume).stdout
    again = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert again.returncode == 0 and "already DONE" in again.stdout


def test_a_secret_the_deploy_config_lists_under_another_name_is_masked_in_the_programs_output(tmp_path):
    """A deploy config's `secrets:` may list any variable (DB_CREDS, OPENAI_API_KEY_2): the pod gets its value,
    and its name alone did not say it is one, so the program's print of it reached program.log and the console.
    deploy names them to the pod in TRAINPOD_SECRET_NAMES."""
    source = "import os\nprint('creds', os.environ['DB_CREDS'], os.environ['OPENAI_API_KEY_2'], flush=True)\n"
    config, volume = running_program(tmp_path, "creds.py", source)
    secrets = {"DB_CREDS": "s3cr3t-db-pass", "OPENAI_API_KEY_2": "sk-openai-value-42"}
    env = {**secrets, "TRAINPOD_SECRET_NAMES": "DB_CREDS,OPENAI_API_KEY_2"}
    result = run_trainpod("run", "command", "--config", str(config), volume=volume, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = program_log(volume) + result.stdout
    assert "creds *** ***" in shown, shown
    assert not any(value in shown for value in secrets.values()), shown


def test_the_configs_env_path_is_where_the_program_and_its_tools_are_found(tmp_path):
    """env.PATH was replaced by the pod's own PATH: a tool in a folder it named was 'not on PATH' (exit 2)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "mytool").write_text('#!/bin/sh\necho "$PATH" > path.txt\n')
    (tools / "mytool").chmod(0o755)
    config, volume = write_setup(tmp_path, "env", command=["mytool"], env={"PATH": f"{tools}:/usr/bin:/bin"})
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    kits, *rest = (tmp_path / "repo/path.txt").read_text().strip().split(":")
    assert kits == str(Path(sys.executable).parent), "the kit's python and trainpod come first"
    assert rest == [str(tools), "/usr/bin", "/bin"]


def test_sigterm_reaches_the_programs_whole_process_group_and_exits_143(tmp_path):
    config, volume = write_setup(tmp_path, "with-child")
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "working 3" in program_log(volume), proc, "the program's fourth line")
    grandchild = int((tmp_path / "repo/child.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "SIGTERM to its process group" in out
    assert json.loads((run_dir(volume) / "status.json").read_text())["state"] == "preempted"
    assert not (run_dir(volume) / "DONE").exists()
    assert (
        not Path(f"/proc/{grandchild}").exists()
        or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    )


def test_what_the_program_leaves_in_its_group_gets_sigterm_at_once_not_after_its_output_pipes(tmp_path):
    """Its children inherit the program's stdout and stderr. The kit waited 2 s per pipe for them to close
    before it sent the group its SIGTERM: 4 s of the 5 s window gone, the kit's own exit after SIGKILL."""
    config, volume = write_setup(tmp_path, "with-timed-child")
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: (tmp_path / "repo/child.ready").exists(), proc, "the program's child")
    wait_for(lambda: "working 3" in program_log(volume), proc, "the program's fourth line")
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    child_stopped = float((tmp_path / "repo/child.term").read_text())
    assert child_stopped - signalled < 2.0, (
        f"the child got SIGTERM {child_stopped - signalled:.1f} s after the kit"
    )
    assert "working 3" in program_log(volume), "the program's output before the stop is still logged"


def test_a_program_that_ignores_sigterm_is_killed_when_the_window_ends(tmp_path):
    config, volume = write_setup(tmp_path, "ignore-term", checkpoint={"preemption_window_seconds": 1.0})
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "working 2" in program_log(volume), proc, "the program's third line")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "end of the stop window: SIGKILL" in out


def test_sigkill_of_the_kit_takes_the_program_down_with_it(tmp_path):
    config, volume = write_setup(tmp_path, "ignore-term")
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "working 2" in program_log(volume), proc, "the program's third line")
    program_pid = json.loads((run_dir(volume) / "status.json").read_text())["program_pid"]
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(program_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(program_pid), "an orphaned program would write checkpoints with no lease held for it"


def _start_a_program_with_children(tmp_path):
    """The kit running a program that starts a child in its group and one in a session of its own (as
    torchrun starts its workers), once both are working; with the children's pids."""
    config, volume = write_setup(tmp_path, "with-torchrun-like-children")
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    pids_file = tmp_path / "repo/children.pids"
    wait_for(
        lambda: pids_file.exists() and "working 2" in program_log(volume), proc, "the program's children"
    )
    return proc, [int(pid) for pid in pids_file.read_text().split()]


def _kill_the_living(pids):
    """Those of `pids` still alive, killed so that a failing test leaves nothing running."""
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_sigkill_of_the_kit_takes_the_programs_children_down_too(tmp_path):
    """PR_SET_PDEATHSIG reaches the program alone: a shell wrapper's python, torchrun's workers (each in a
    session of its own) went on training, holding the GPU and writing checkpoints with no lease held."""
    proc, children = _start_a_program_with_children(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _kill_the_living(children)
    assert not left, f"the program's children {left} outlived the SIGKILLed kit"


def test_a_stopped_program_leaves_nothing_running_in_sessions_of_its_own(tmp_path):
    """SIGTERM and SIGKILL went to the program's group: torchrun's workers, each in a session of its own,
    went on after the kit had released the lease and exited 143."""
    proc, children = _start_a_program_with_children(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    left = _kill_the_living(children)
    assert proc.returncode == 143, out
    assert not left, f"the program's children {left} outlived the kit's stop"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_failing_program_is_restarted_max_restarts_times_then_the_start_fails_with_75(tmp_path):
    config, volume = write_setup(tmp_path, "fail", max_restarts=2)
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 75, result.stdout
    assert (tmp_path / "repo/starts.txt").read_text() == "xxx", "one start and two restarts"
    assert "exited with 7 (after 2 restart(s)" in result.stdout
    assert not (run_dir(volume) / "DONE").exists()


def test_a_spent_budget_stops_the_program_and_exits_3(tmp_path):
    config, volume = write_setup(tmp_path, "ignore-term", checkpoint={"preemption_window_seconds": 0.5})
    budget = {"TRAINPOD_GPU_HOURLY_USD": "3600", "TRAINPOD_BUDGET_USD": "2"}  # $1 a second: spent after 2 s
    result = run_trainpod("run", "command", "--config", str(config), volume=volume, env=budget)
    assert result.returncode == 3, result.stdout
    assert (
        "stopping the program (budget)" in result.stdout and "TRAINPOD_BUDGET_USD is spent" in result.stdout
    )
    assert json.loads((run_dir(volume) / "status.json").read_text())["cost_usd"] >= 2


@pytest.mark.parametrize(("exit_code", "stop"), [(0, None), (1, "budget")], ids=["finished", "failed"])
def test_a_budget_found_spent_after_the_program_finished_is_no_stop(tmp_path, exit_code, stop):
    """The program's own finish raced the budget: the kit's loop saw it running, it exited 0, then the kit found
    the budget spent and stopped a program that had exited (exit 3, no DONE, the run FAILED with its work done).
    A failure in that race stays the budget's (not a start again, stopped at once). The race is forced: the
    program has exited when the budget is looked at. The run's context and its cost are stand-ins (a budget of
    $1, $2 spent); the program is a real process."""
    from types import SimpleNamespace

    from trainpod.program import Program
    from trainpod.workloads import command

    context = SimpleNamespace(
        watch=SimpleNamespace(requested=False), lease_lost=lambda: False, budget_usd=1.0
    )
    spent = SimpleNamespace(cost_usd=lambda: 2.0)
    exits_on_go = "import os, sys, time\nwhile not os.path.exists('go'): time.sleep(0.01)\nsys.exit(int(open('go').read()))"
    program = Program(
        [sys.executable, "-c", exits_on_go], tmp_path, dict(os.environ), tmp_path / "program.log"
    )
    program.start()
    try:
        assert command._stop_to_make(context, spent, program) == "budget", "running: the budget stops it"
        (tmp_path / "go.tmp").write_text(str(exit_code))
        (tmp_path / "go.tmp").rename(tmp_path / "go")  # whole when it appears
        assert (
            program.proc.wait(timeout=60) == exit_code
        )  # it exited after the loop's look, before the budget's
        assert command._stop_to_make(context, spent, program) == stop
    finally:
        program.sweep()


COMMITS_AN_OLDER_STEP = {
    "checkpointer.py": """
import torch
from trainpod import Checkpointer
model = torch.nn.Linear(2, 2)
with Checkpointer() as ckpt:
    ckpt.commit(5, model=model)
    ckpt.commit(3, model=model)  # refused: older than LATEST
""",
    "commit.sh": """
for step in 5 3; do  # 3 is refused: older than LATEST
  mkdir -p "out-$step" && echo "$step" > "out-$step/state.txt"
  trainpod checkpoint commit "$TRAINPOD_RUN_DIR" --step "$step" "out-$step" >/dev/null || exit 75
done
""",
}


@pytest.mark.parametrize("name", sorted(COMMITS_AN_OLDER_STEP))
def test_a_program_the_kits_checkpoint_api_refused_is_exit_2_and_not_started_again(tmp_path, name):
    """A Checkpointer's or `trainpod checkpoint commit`'s refusal (here a step older than LATEST) ends the program
    with exit 2, which the kit took for any failure: a start counted and retried (max_restarts here, then at every
    pod start) into the same refusal until the crash-loop limit, each paying for the program's setup."""
    config, volume = running_program(tmp_path, name, COMMITS_AN_OLDER_STEP[name], max_restarts=2)
    interpreter = "python" if name.endswith(".py") else "sh"
    config.write_text(config.read_text().replace("- python\n", f"- {interpreter}\n"))
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 2, result.stdout
    assert "after the kit's checkpoint API refused it" in result.stdout and "step=3" in result.stdout
    assert program_log(volume).count("--- started") == 1, "a refused program is not started again"
    latest = (run_dir(volume) / "checkpoints" / "LATEST").read_text().strip()
    assert latest == "step-5", "the committed checkpoint stays LATEST"


GOES_PAST_A_REFUSAL_THEN_CRASHES_ONCE = """
if [ "$(cat "$TRAINPOD_CHECKPOINT_DIR/LATEST" 2>/dev/null)" = step-7 ]; then exit 0; fi  # the restart: done
for step in 5 3 7; do  # 3 is refused, and the script goes on past it
  mkdir -p "out-$step" && echo "$step" > "out-$step/state.txt"
  trainpod checkpoint commit "$TRAINPOD_RUN_DIR" --step "$step" "out-$step" >/dev/null || true
done
exit 1  # a crash of its own, after the commits
"""


def test_a_refusal_the_program_went_past_with_a_commit_does_not_make_its_later_crash_exit_2(tmp_path):
    """`commit ... || true`: the program got past the refusal and committed step 7. Its crash after that was taken
    for the refusal's (exit 2, never started again), where it is a crash like any other: started again."""
    config, volume = running_program(tmp_path, "go.sh", GOES_PAST_A_REFUSAL_THEN_CRASHES_ONCE, max_restarts=2)
    config.write_text(config.read_text().replace("- python\n", "- sh\n"))
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout
    assert program_log(volume).count("--- started") == 2, "the crash was restarted, not taken for the refusal"


COMMITS_ON_STOP = """
import time
import torch
from trainpod import Checkpointer
model = torch.nn.Linear(2, 2)
with Checkpointer() as ckpt:
    step = 0
    while True:
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.05)
        if ckpt.should_stop():  # README's loop: on a stop, commit the step if it fits, then exit 143
            if ckpt.commit_fits():
                ckpt.commit(step, model=model)
            ckpt.exit_preempted()
"""


def test_a_lost_lease_kills_the_program_at_once_so_nothing_of_it_lands_in_the_other_writers_run(tmp_path):
    """The kit stopped the program with SIGTERM, which a Checkpointer loop answers with a commit: a step landed
    in the run another writer had taken over (LATEST moving under it, its own older commit then refused)."""
    # a heartbeat each 1.5 s
    config, volume = running_program(
        tmp_path, "loop.py", COMMITS_ON_STOP, checkpoint={"lease_ttl_seconds": 6}
    )
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "step 3" in program_log(volume), proc, "the program's third step")
    rival = {
        "owner": {"id": "another-writer", "host": "elsewhere", "pid": 1},
        "expires_unix": time.time() + 600,
    }
    (run_dir(volume) / "LEASE").write_text(json.dumps(rival))  # a replacement pod took the run over
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert not (run_dir(volume) / "checkpoints/LATEST").exists(), (
        "the program committed after the lease was lost"
    )
    assert json.loads((run_dir(volume) / "LEASE").read_text())["owner"]["id"] == "another-writer"


SCRIPTS_EXEC_REFUSES = {
    "no-shebang.sh": b"echo hi\n",
    "crlf.sh": b"#!/bin/sh\r\necho hi\r\n",
    "missing-interpreter.sh": b"#!/no/such/sh\necho hi\n",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": ["no-such-program-xyz"]}, "command[0]='no-such-program-xyz' is not on PATH"),
        ({"command": ["./missing.sh"]}, "does not exist"),
        ({"workdir": "/nonexistent/dir"}, "workdir /nonexistent/dir does not exist"),
        # exec refuses these: a traceback and exit 1 before, a crash every start of the pod repeated
        ({"command": ["./no-shebang.sh"]}, "has no first line naming its interpreter"),
        ({"command": ["./crlf.sh"]}, "has Windows line ends"),
        (
            {"command": ["./missing-interpreter.sh"]},
            "names the interpreter /no/such/sh, which does not exist",
        ),
        ({"env": {"TRAINPOD_RUN_DIR": "/x"}}, "env.TRAINPOD_RUN_DIR: TRAINPOD_ variables are set by the kit"),
        # python's own exit 2 for a missing script was a failed start, repeated until the run was FAILED
        ({"command": ["python", "-u", "trian.py"]}, "command[2]='trian.py': "),
        ({"command": ["bash", "missing.sh", "--epochs", "3"]}, "command[1]='missing.sh': "),
        ({"command": ["bash", "-euo", "pipefail", "missing.sh"]}, "command[3]='missing.sh': "),
        ({"command": ["python", "-uW", "ignore", "trian.py"]}, "command[3]='trian.py': "),
        # an interpreter with no script read its program from stdin (/dev/null), exited 0 and the run was DONE
        ({"command": ["python"]}, "command = ['python']: Value error, it gives python no script to run"),
        ({"command": ["python", "-u", "-"]}, "it gives python no script to run"),
        ({"command": ["bash", "-l"]}, "it gives bash no script to run"),
        ({"command": ["sh", "-s", "--epochs", "3"]}, "it gives sh no script to run"),
        ({"command": ["node"]}, "it gives node no script to run"),
    ],
)
def test_bad_input_exits_2_naming_the_field_and_writes_nothing(tmp_path, change, message):
    config, volume = write_setup(tmp_path, "env", **change)
    for script, text in SCRIPTS_EXEC_REFUSES.items():
        (tmp_path / "repo" / script).write_bytes(text)
        (tmp_path / "repo" / script).chmod(0o755)
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (volume / "runs").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["python", "-m", "json.tool", "--help"],
        ["python", "-c", "print(1)"],
        ["sh", "-c", "exit 0"],
        ["python", "-O", "prog.py", "env"],  # python's -O takes no value: prog.py is the script
        ["python", "-W", "ignore", "prog.py", "env"],
        # options clustered in one word: -lc, -ec and -uc end in -c (inline code), -um in -m (a module), and
        # -euo's o and -uW's W take the next word; each was refused with exit 2 as a script that does not exist
        ["bash", "-lc", "exit 0"],
        ["sh", "-ec", "exit 0"],
        ["bash", "-euo", "pipefail", "-c", "exit 0"],
        ["python", "-uc", "print(1)"],
        ["python", "-um", "json.tool", "--help"],
        ["python", "-uW", "ignore", "prog.py", "env"],
    ],
)
def test_an_interpreter_given_a_module_or_inline_code_needs_no_script_file(tmp_path, command):
    config, volume = write_setup(tmp_path, "env", command=command)
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr


def test_boot_runs_the_program_from_the_synced_git_repo_by_default(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "prog.py").write_text(PROGRAM)
    (work / "command.yaml").write_text(yaml.safe_dump({"name": RUN, "command": ["python", "prog.py", "env"]}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=work, check=True)
    subprocess.run([*git, "add", "."], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=work, check=True)
    volume = tmp_path / "volume"
    volume.mkdir()
    env = child_env(
        {
            "TRAINPOD_WORKLOAD": "command",
            "TRAINPOD_CONFIG": "command.yaml",
            "TRAINPOD_VOLUME": str(volume),
            "TRAINPOD_GIT_REPO": f"file://{work}",
            "TRAINPOD_GIT_REF": "main",
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads((volume / "repos/work@main/env.json").read_text())
    assert written["cwd"] == str(volume / "repos/work@main"), "the default workdir: the ref's checkout"
    assert (run_dir(volume) / "DONE").exists()


def test_the_nanogpt_deploy_config_runs_the_example_from_the_synced_repo_as_a_command_pod():
    from trainpod.config import load_config
    from trainpod.config.command import CommandConfig
    from trainpod.config.deploy import DeployConfig
    from trainpod.runpod.deploy import pod_body, pod_env

    deploy = load_config(DeployConfig, REPO / "configs/deploy/nanogpt-command.yaml")
    env = pod_env(deploy)
    assert (env["TRAINPOD_WORKLOAD"], env["TRAINPOD_GIT_REF"]) == ("command", "main")
    assert env["TRAINPOD_GIT_REPO"].endswith(".git"), "the program comes from the synced git repo"
    assert pod_body(deploy, "tpl", "vol")["dockerStartCmd"] == ["/opt/trainpod/entrypoints/command"]
    assert (REPO / "entrypoints/command").is_file()
    command = load_config(CommandConfig, REPO / deploy.config)
    assert command.workdir is None, "the default workdir is the synced checkout"
    assert (REPO / command.command[1]).is_file(), f"{command.command[1]} must exist in the repository"


DATALOADER_PROGRAM = """
import time, torch
from torch.utils.data import DataLoader, Dataset
from trainpod import Checkpointer

class Numbers(Dataset):
    def __len__(self): return 100_000
    def __getitem__(self, i): return torch.tensor([float(i)])

model = torch.nn.Linear(1, 1)
batches = iter(DataLoader(Numbers(), batch_size=4, num_workers=2))
with Checkpointer() as ckpt:
    step = 0
    while True:
        model(next(batches)).sum().backward()
        time.sleep(0.05)
        step += 1
        print(f"step {step}", flush=True)
        if step == 5 or (ckpt.stop_requested and ckpt.commit_fits()):
            ckpt.commit(step, model=model)
        if ckpt.stop_requested:
            ckpt.exit_preempted()
"""


def test_sigterm_leaves_the_programs_dataloader_workers_alone_so_it_commits_its_last_step(tmp_path):
    # torch's DataLoader workers die at a SIGTERM that does not come from their parent, and the
    # program's next batch then raises: the stop must reach the program first, not its whole group.
    workdir = tmp_path / "repo"
    workdir.mkdir()
    (workdir / "prog.py").write_text(DATALOADER_PROGRAM)
    config = tmp_path / "command.yaml"
    config.write_text(
        yaml.safe_dump({"name": RUN, "command": ["python", "prog.py"], "workdir": str(workdir)})
    )
    volume = tmp_path / "volume"
    volume.mkdir()
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "step 12\n" in program_log(volume), proc, "step 12")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    log = program_log(volume)
    assert "DataLoader worker" not in log, log
    latest = (run_dir(volume) / "checkpoints/LATEST").read_text().strip()
    assert latest != "step-5" and "stopped by SIGTERM" in log, f"{latest}: the final commit was lost\n{log}"


CHATTY_PROGRAM = """
import os, time
print("ready", flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
for i in range(3000):  # 300 kB: several times what a pipe holds unread
    print(f"line {i:06d} " + "x" * 88, flush=True)
print("all printed", flush=True)
"""


def test_a_failed_write_of_program_log_never_stops_the_programs_output_being_read(tmp_path):
    """A write to logs/program.log that failed (a network volume's I/O error, a full volume) ended the thread that
    reads the program's output, so the program blocked for good at its next 64 kB of prints: a GPU billed with
    nothing running and nothing ending the start."""
    config, volume = running_program(tmp_path, "chatty.py", CHATTY_PROGRAM)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "ready" in program_log(volume), proc, "the program's first line")
    log = run_dir(volume) / "logs/program.log"
    log.unlink()
    log.mkdir()  # every later write of the log fails (IsADirectoryError), as on a volume gone bad
    (tmp_path / "repo/go").write_text("1")
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            "the program blocked writing its output once program.log could not be written"
        ) from None
    assert proc.returncode == 0, out
    assert "all printed" in out, "its output still reaches the console"
    assert out.count("could not write") == 1, f"the failed log is said once:\n{out[-2000:]}"
    assert (run_dir(volume) / "DONE").exists()


WAITING_PROGRAM = """
import os, time
print("ready", flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
print("finished its work", flush=True)
"""


def test_a_failed_write_of_status_json_never_ends_the_program(tmp_path):
    """status.json is advisory (`trainpod status`, a supervisor's view): a write of it that failed (a network
    volume's I/O error) crashed the kit, and the program died with it (PR_SET_PDEATHSIG) without its stop window,
    losing the steps since its last commit; a finished program's run was never DONE."""
    config, volume = running_program(tmp_path, "waiting.py", WAITING_PROGRAM, status_every_seconds=0.1)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    wait_for(lambda: "ready" in program_log(volume), proc, "the program's first line")
    status = run_dir(volume) / "status.json"
    wait_for(status.exists, proc, "the first status.json")
    status.unlink()
    status.mkdir()  # every later write of status.json fails (IsADirectoryError), as on a volume gone bad
    time.sleep(1.0)  # several status writes
    assert proc.poll() is None, f"the kit ended at a failed status.json write:\n{proc.communicate()[0]}"
    (tmp_path / "repo/go").write_text("1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "finished its work" in out and (run_dir(volume) / "DONE").exists()
    assert out.count("could not write") == 1, f"the failed write is said once:\n{out[-2000:]}"


SIGNALLED_ITSELF_PROGRAM = """
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(1))  # torchrun's way: a SIGTERM of its own is exit 1
open("program.pid", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def test_a_program_ending_at_the_stop_before_the_kit_forwarded_it_is_stopped_not_failed(tmp_path):
    """A stop that reached the program too (a SIGTERM to every process of the pod; torchrun then exits 1) ended
    it in the 50 ms before the kit's poll forwarded the kit's own: that exit counted as a failed start (75, and
    FAILED after three such spot stops) or, with max_restarts, started the program again during the stop."""
    config, volume = running_program(tmp_path, "signalled.py", SIGNALLED_ITSELF_PROGRAM)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    pid_file = tmp_path / "repo/program.pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), proc, "the program's start")
    program = int(pid_file.read_text())
    # The kit held still (as a loaded host does) while the program ends and its own SIGTERM arrives, so that its
    # next look finds the program gone and the stop requested, with nothing forwarded yet.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        os.kill(program, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{program}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the program did not end at its SIGTERM"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "starting it again" not in out and not (run_dir(volume) / "DONE").exists()


def test_a_program_log_that_cannot_be_written_from_the_start_leaves_the_program_supervised(tmp_path):
    """The header of logs/program.log was written unguarded once the program had started: a failed write (a
    network volume's I/O error) ended the kit's start with the program started, its output unread. It is now
    said once, as every later line's failure is, and the program runs under the kit to its end."""
    config, volume = write_setup(tmp_path, "env")
    (tmp_path / "repo/chatty.py").write_text(CHATTY_PROGRAM)
    (tmp_path / "repo/go").write_text("1")
    config.write_text(
        yaml.safe_dump({**yaml.safe_load(config.read_text()), "command": ["python", "chatty.py"]})
    )
    (run_dir(volume) / "logs/program.log").mkdir(
        parents=True
    )  # every write of the log fails (IsADirectoryError)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the program's output was left unread") from None
    assert proc.returncode == 0, out[-3000:]
    assert "all printed" in out, "its output reaches the console"
    assert out.count("could not write") == 1, f"the failed log is said once:\n{out[-2000:]}"
    assert (run_dir(volume) / "DONE").exists()


FILLS_THE_VOLUME = """
import os, subprocess, sys
run = os.environ["TRAINPOD_RUN_DIR"]
if not os.path.exists(os.path.join(run, "checkpoints", "LATEST")):
    os.makedirs("out", exist_ok=True)
    with open("out/weights.bin", "wb") as f:
        f.write(os.urandom(900 * 1024))
    subprocess.run([sys.executable, "-m", "trainpod", "checkpoint", "commit", run, "--step", "1", "out"], check=True)
    with open(os.path.join(run, "eval-cache.bin"), "wb") as f:  # what else it keeps on the volume
        f.write(os.urandom(1400 * 1024))
print("no room for step 2's checkpoint", flush=True)
sys.exit(5)  # its Checkpointer's exit on a full volume, or any failure there
"""


def test_a_program_that_fails_with_no_room_for_its_next_checkpoint_is_exit_5_not_a_counted_retry(tmp_path):
    """A program that failed on a full volume (its Checkpointer's exit 5, a write of its own) was a counted 75,
    started again max_restarts times and at every pod start, failing the same way each time until FAILED. When
    the volume has less free than the run's newest checkpoint takes, the next commit cannot land: exit 5 now."""
    from support import small_filesystem

    config, volume = running_program(tmp_path, "fills.py", FILLS_THE_VOLUME, max_restarts=2)
    with small_filesystem(volume / "runs", "3m"):
        done = run_trainpod("run", "command", "--config", str(config), volume=volume)
        assert done.returncode == 5, done.stdout + done.stderr
        out = done.stdout + done.stderr
        assert "no space left on the volume" in out and "exited with 5" in out, out[-2000:]
        assert "starting it again" not in out, "a retry on a full volume fails the same way"
        assert (run_dir(volume) / "checkpoints" / "LATEST").read_text().strip() == "step-1", "kept"


FIRST_COMMIT_FILLS_THE_VOLUME = """
import torch
from trainpod import Checkpointer
with Checkpointer() as ckpt:
    ckpt.commit(1, weights={"w": torch.zeros(1024 * 1024)})  # 4 MiB, on a volume with 3
print("committed")
"""


def test_a_program_whose_first_commit_fills_the_volume_is_exit_5_not_a_counted_retry(tmp_path):
    """With no checkpoint before it to size the next one by, a first commit on a full volume was a failure to
    retry (max_restarts times, then at every pod start) until FAILED. Its Checkpointer's line says the volume is
    full: exit 5 at once, as for any later commit."""
    from support import small_filesystem

    config, volume = running_program(tmp_path, "first.py", FIRST_COMMIT_FILLS_THE_VOLUME, max_restarts=2)
    with small_filesystem(volume / "runs", "3m"):
        done = run_trainpod("run", "command", "--config", str(config), volume=volume)
        out = done.stdout + done.stderr
        assert done.returncode == 5, out[-3000:]
        assert "the first checkpoint of" in out and "exited with 5" in out, out[-2000:]
        assert "starting it again" not in out, "a retry on a full volume fails the same way"
        assert not (run_dir(volume) / "checkpoints" / "LATEST").exists()
        assert not [p for p in (run_dir(volume) / "checkpoints").iterdir() if ".tmp-" in p.name], (
            "left half-written"
        )


SAYS_A_DISK_IS_FULL = """
import os, sys
where = {where}
print(f"OSError: [Errno 28] No space left on device{{where}}", file=sys.stderr)
sys.exit(1)
"""


@pytest.mark.parametrize(
    ("where", "code"),
    [
        (
            "': ' + repr(os.environ['TRAINPOD_RUN_DIR'] + '/x.bin')",
            5,
        ),  # the volume: it fails so at every start
        ("''", 5),  # a failed write() names no file: the volume, as before
        ("': ' + repr('/tmp/trainpod-test-no-such-dir/x.bin')", 75),  # the container disk: wiped at a restart
    ],
    ids=["the-volume", "no-path", "the-container-disk"],
)
def test_a_disk_full_line_before_the_first_commit_is_exit_5_only_when_it_names_no_file_off_the_volume(
    tmp_path, where, code
):
    """An ENOSPC on the container's own disk (/tmp, a cache outside the volume), named in the program's last
    lines, was taken for a full volume: exit 5, FAILED, the pod stopped and told to free the volume, which had
    room. It is a counted failure now (that disk is wiped at every restart), with a line naming the disk."""
    config, volume = running_program(
        tmp_path, "full.py", SAYS_A_DISK_IS_FULL.format(where=where), max_restarts=0
    )
    done = run_trainpod("run", "command", "--config", str(config), volume=volume)
    out = done.stdout + done.stderr
    assert done.returncode == code, out[-3000:]
    assert ("no space left on the volume" in out) is (code == 5), out[-2000:]
    assert ("a disk outside the volume is full" in out) is (code != 5), out[-2000:]


def test_a_command_run_with_a_checkpoint_shows_its_step_with_no_total_in_status_ls_and_its_done_line(
    tmp_path,
):
    """Its program decides its steps: the status has no max_steps, which `trainpod ls` showed as "step 5/None"."""
    program = (
        "from trainpod import Checkpointer\nwith Checkpointer() as ckpt:\n    ckpt.commit(5, extra={})\n"
    )
    config, volume = running_program(tmp_path, "commit.py", program)
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"run {RUN} DONE: step 5, " in result.stdout + result.stderr
    assert f"runs/{RUN}: done | step 5 | checkpoint step-5\n" in run_trainpod("ls", volume=volume).stdout
    assert f"{RUN}: done | step 5 | " in run_trainpod("status", RUN, volume=volume).stdout
