"""`trainpod logs RUN` against the fake RunPod API (the mock of RunPod: its v2 log stream is Server-Sent
Events validated against RunPod's v2 OpenAPI file): the last N lines, following with a dropped
connection resumed by Last-Event-ID, secrets masked, a run without a pod refused."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import pytest

from trainpod.runpod.client import RunPodNotFound
from trainpod.runpod.logs import parse_sse, stream_logs

from fake_runpod import FakeRunPodServer, api_env, client_for
from support import child_env

RUN = "tiny-pretrain"


@pytest.fixture
def fake():
    with FakeRunPodServer() as fake:
        yield fake
    assert not fake.violations, f"requests RunPod's v2 API would refuse: {fake.violations}"


def a_pod(fake, name: str = f"{RUN}-pretrain", status: str = "RUNNING") -> str:
    pod_id = fake._new_id("pod")
    fake.pods[pod_id] = {"id": pod_id, "name": name, "desiredStatus": status, "env": {}}
    return pod_id


def logs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainpod", "logs", *args]


def ctrl_c_enabled() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python then ignores Ctrl-C too: the
    child gets the default, as in a terminal, whatever ran pytest."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(lines: queue.Queue[str], last: str) -> list[str]:
    seen = [lines.get(timeout=60)]
    while seen[-1] != last:
        seen.append(lines.get(timeout=60))
    return seen


def test_tail_prints_the_last_n_lines_and_exits(fake):
    pod = a_pod(fake)
    fake.add_logs(pod, *[f"line {i}" for i in range(1, 21)])
    result = subprocess.run(
        logs_cmd(RUN, "--tail", "5"), env=child_env(api_env(fake)), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"line {i}" for i in range(16, 21)]
    assert fake.calls("GET", f"/v2/pods/{pod}/logs"), "the lines come from RunPod's v2 log stream"


def test_follow_resumes_a_dropped_connection_from_the_last_event_with_no_line_lost_or_repeated(fake):
    pod = a_pod(fake)
    fake.add_logs(pod, *[f"line {i}" for i in range(1, 11)])
    fake.drop_after = [4]  # the first connection is cut in the middle of line 5
    child = subprocess.Popen(
        logs_cmd(RUN, "-f", "--tail", "10"),
        env=child_env(api_env(fake)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_enabled,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line.rstrip("\n")) for line in child.stdout], daemon=True
    ).start()
    seen = read_until(lines, "line 10")
    fake.add_logs(pod, "line 11", "line 12")  # printed by the pod while we follow
    seen += read_until(lines, "line 12")
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=60) == 0, "Ctrl-C ends -f quietly"
    assert seen == [f"line {i}" for i in range(1, 13)], (
        "every line once, in order; trainpod's notes on stderr"
    )
    assert "reconnecting from event" in child.stderr.read()
    resumed = [h.get("Last-Event-ID") for h in fake.log_headers]
    assert resumed[0] is None and resumed[1] == fake.logs[pod][3]["ts"], "resumed after line 4, by its id"


def test_lines_the_server_sends_again_after_a_reconnect_are_printed_once(fake):
    """A server whose cursor is inclusive re-sends the last event; lines sharing a timestamp stay."""
    pod = a_pod(fake)
    fake.add_logs(pod, "a", "b", "c")
    same_ts = dict(fake.logs[pod][2], line="c, same microsecond")
    fake.logs[pod].append(same_ts)
    printed: list[str] = []
    client = client_for(fake)
    pod_obj = client.get_pod(pod)
    fake.drop_after = [3]
    fake.inclusive_cursor = True
    count = stream_logs(client, pod_obj, tail=4, follow=False, emit=printed.append, idle_s=2)
    assert printed == ["a", "b", "c", "c, same microsecond"] and count == 4


def test_secrets_in_pod_log_lines_are_masked(fake):
    pod = a_pod(fake)
    token = "hf_secretvalue123456"
    fake.add_logs(pod, f"downloading with token {token}", "cloning https://bob:ghp_abcdef123@github.com/x/y")
    env = child_env(api_env(fake) | {"HF_TOKEN": token})
    result = subprocess.run(logs_cmd(RUN, "--tail", "2"), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert token not in result.stdout and "ghp_abcdef123" not in result.stdout
    assert result.stdout.splitlines() == ["downloading with token ***", "cloning https://***@github.com/x/y"]


def test_tail_0_without_follow_prints_nothing(fake):
    pod = a_pod(fake)
    fake.add_logs(pod, "old line")
    result = subprocess.run(
        logs_cmd(RUN, "--tail", "0"), env=child_env(api_env(fake)), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == ""


def test_a_run_without_a_pod_exits_2_with_a_clear_message(fake):
    a_pod(fake, name="other-run-pretrain")
    result = subprocess.run(
        logs_cmd(RUN), env=child_env(api_env(fake)), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert (
        f"run {RUN!r} has no pod or cluster on RunPod" in result.stderr and "trainpod deploy" in result.stderr
    )
    assert "Traceback" not in result.stdout + result.stderr


def test_the_workload_pod_is_chosen_over_the_supervisor_pod(fake):
    a_pod(fake, name=f"{RUN}-supervise")
    pod = a_pod(fake, name=f"{RUN}-pretrain", status="EXITED")
    fake.add_logs(pod, "from the workload")
    result = subprocess.run(
        logs_cmd(RUN, "--tail", "1"), env=child_env(api_env(fake)), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.splitlines() == ["from the workload"]


def test_the_fake_refuses_a_tail_and_a_cursor_runpods_v2_schema_refuses(fake):
    pod = a_pod(fake)
    client = client_for(fake, max_attempts=1)
    for query, headers in (({"tail": 6000}, None), (None, {"Last-Event-ID": "yesterday"})):
        with pytest.raises(Exception):  # noqa: B017 - a 400 from the fake, whatever its class
            client.request("GET", f"/pods/{pod}/logs", query=query, headers=headers, api="v2", stream=True)
    assert len(fake.violations) == 2 and "tail" in fake.violations[0]
    fake.violations.clear()


def test_parse_sse_drops_an_event_cut_off_by_the_end_of_the_stream():
    stream = [
        b"id: 1\n",
        b'data: {"line": "whole", "ts": "1"}\n',
        b"\n",
        b": keep-alive\n",
        b"id: 2\n",
        b"data: {",
    ]
    assert [e.line for e in parse_sse(stream)] == ["whole"]


def test_opening_the_log_stream_retries_429_and_5xx_like_every_runpod_call(fake):
    pod = a_pod(fake)
    fake.add_logs(pod, "after the retries")
    fake.fail_next(503)
    fake.fail_next(429, retry_after="3")
    sleeps: list[float] = []
    client = client_for(fake, sleeps)
    printed: list[str] = []
    stream_logs(client, client.get_pod(pod), tail=1, follow=False, emit=printed.append)
    assert printed == ["after the retries"] and sleeps == [1.0, 3.0]


def test_a_pod_gone_before_its_logs_are_read_exits_2_naming_the_endpoint(fake):
    pod = a_pod(fake)
    client = client_for(fake)
    gone = client.get_pod(pod)
    del fake.pods[pod]
    with pytest.raises(RunPodNotFound) as caught:
        stream_logs(client, gone, tail=1, follow=False, emit=print)
    assert caught.value.exit_code == 2 and f"GET /v2/pods/{pod}/logs: not found (404)" in str(caught.value)


class _SeenEnough(Exception):
    pass


def follow_in_process(fake, monkeypatch, on_line) -> int:
    """`trainpod logs RUN -f` here, each line it prints handed to `on_line` (which ends it by raising)."""
    from trainpod import cli

    for name, value in api_env(fake).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "print", lambda line, **_: on_line(line), raising=False)
    return cli.main(["logs", RUN, "-f", "--tail", "10"])


def test_follow_goes_on_with_the_pod_that_replaced_the_one_it_followed(fake, monkeypatch):
    """The supervisor replaced the interrupted pod (its start refused: a new pod, the old terminated): `logs -f`
    ended on the old pod's 404, exit 2, and the new pod's lines were never shown."""
    old = a_pod(fake)
    fake.add_logs(old, "old 1", "old 2")
    printed: list[str] = []

    def on_line(line: str) -> None:
        printed.append(line)
        if line == "old 2":  # as bring_back does it: the new pod first, then the old one terminated
            new = a_pod(fake)
            fake.add_logs(new, "new 1", "new 2")
            del fake.pods[old]
        if line == "new 2":
            raise _SeenEnough

    with pytest.raises(_SeenEnough):
        follow_in_process(fake, monkeypatch, on_line)
    assert printed == ["old 1", "old 2", "new 1", "new 2"]


def test_follow_ends_quietly_when_the_runs_last_pod_is_gone(fake, monkeypatch):
    """on_finish: terminate at DONE: following a run to its end is no error."""
    pod = a_pod(fake)
    fake.add_logs(pod, "DONE")
    printed: list[str] = []

    def on_line(line: str) -> None:
        printed.append(line)
        del fake.pods[pod]

    assert follow_in_process(fake, monkeypatch, on_line) == 0
    assert printed == ["DONE"]
