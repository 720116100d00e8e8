"""`trainpod logs RUN`: a run's pod logs from a laptop, through RunPod's REST v2 log stream.

    trainpod logs tiny-pretrain --tail 200      # the last 200 lines, then exit
    trainpod logs tiny-pretrain -f              # and every new line until Ctrl-C

`GET /v2/pods/{id}/logs` answers with Server-Sent Events (`id: <ts>`, `data: {"source","line","ts"}`).
A dropped connection is resumed with `Last-Event-ID`, the id of the last event printed, so no line
is lost; events the server sends again (its cursor may be inclusive, and lines can share a
timestamp) are recognised and skipped, so none is printed twice. Every line is masked for the
secrets this shell knows (trainpod.log) before it is printed. HTTP lives in client.py.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from trainpod.errors import InputError
from trainpod.log import redact
from trainpod.runpod.client import Pod, RunPodClient, RunPodNotFound
from trainpod.runpod.deploy import run_pods, run_unit_names

log = logging.getLogger("trainpod.logs")

MAX_TAIL = 5000  # RunPod's limit on the backfill (LogTail in the v2 OpenAPI)
IDLE_S = 5.0  # without -f: this long with no event means the backfill is over
FOLLOW_READ_S = 90.0  # with -f: a silent stream is reopened after this long (a half-open TCP never ends)
MAX_RECONNECT_WAIT_S = 30.0


@dataclass(frozen=True)
class LogEvent:
    id: str
    source: str
    line: str
    ts: str


def parse_sse(lines: Iterable[bytes]) -> Iterator[LogEvent]:
    """Events of a Server-Sent Events stream (WHATWG HTML, "event stream interpretation").

    An event is dispatched at a blank line; one cut off by the end of the stream is dropped, as the
    standard says, so a connection dropped mid-event never prints half of it. Events without a JSON
    `line` (keep-alives, other event types) are skipped.
    """
    event_id, data = "", []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                event = _log_event(event_id, "\n".join(data))
                if event is not None:
                    yield event
            data = []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            event_id = value  # the last id persists across events, as in EventSource


def _log_event(event_id: str, data: str) -> LogEvent | None:
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("line"), str):
        return None
    ts = str(payload.get("ts") or "")
    return LogEvent(event_id or ts, str(payload.get("source") or ""), payload["line"], ts)


def pod_for_logs(client: RunPodClient, run: str, workloads: Collection[str]) -> Pod:
    """The run's workload pod (`<run>-<workload>`), or node 0 of its Instant Cluster (global rank 0 logs
    there), a running one first; its supervisor pod only when it is the run's only pod. InputError
    (exit 2) when the run has none."""
    pods = run_pods(client, run, workloads)
    names = run_unit_names(run, workloads)
    for cluster in (c for c in client.list_clusters() if c.name in names):
        try:
            nodes = client.cluster_pods(cluster.id)
        except RunPodNotFound:
            continue  # deleted since it was listed (node 0 deletes its cluster at DONE): no pod left
        pods += [node for node in nodes if node.node_rank == 0]
    if not pods:
        raise InputError(
            f"run {run!r} has no pod or cluster on RunPod (they are named {run}-<workload>); start one with "
            f"`trainpod deploy CONFIG`, or list what exists with `trainpod status`"
        )
    return min(pods, key=lambda p: (p.name.endswith("-supervise"), p.desired_status != "RUNNING", p.name))


def _successor(gone: Pod, find_pod: Callable[[], Pod]) -> Pod:
    """The run's pod that took over from `gone`; `gone` itself when the run has none left (its pods terminated
    at DONE or by `trainpod stop --terminate`)."""
    try:
        pod = find_pod()
    except InputError:  # no pod or cluster of the run any more
        log.info("pod %s is gone and the run has no other pod: the follow ends", gone.id)
        return gone
    return pod if pod.id != gone.id else gone


class _Cursor:
    """What has been printed: the last event id, and the events printed under it (to skip repeats)."""

    def __init__(self) -> None:
        self.last_id: str | None = None
        self._at_last_id: set[tuple[str, str, str]] = set()
        self.printed = 0

    def is_new(self, event: LogEvent) -> bool:
        key = (event.ts, event.source, event.line)
        if event.id == self.last_id:
            if key in self._at_last_id:
                return False
        else:
            self.last_id, self._at_last_id = event.id, set()
        self._at_last_id.add(key)
        self.printed += 1
        return True


def stream_logs(
    client: RunPodClient,
    pod: Pod,
    tail: int,
    follow: bool,
    emit: Callable[[str], None] = print,
    idle_s: float = IDLE_S,
    find_pod: Callable[[], Pod] | None = None,
) -> int:
    """Print the pod's last `tail` lines (masked), and with `follow` every new one, reconnecting
    after a dropped connection from the last event printed. Returns the number of lines printed.
    `find_pod` (following a run): the run's pod now; when the followed one is gone (replaced by the
    supervisor, or terminated at DONE) its successor is followed from its first line, or, with none, it ends."""
    if tail == 0 and not follow:
        return 0
    cursor, wait = _Cursor(), 1.0
    while True:
        try:
            fresh, dropped = _one_connection(client, pod, tail, follow, cursor, emit, idle_s)
        except RunPodNotFound:
            successor = _successor(pod, find_pod) if follow and find_pod is not None else None
            if successor is None:
                raise
            if successor.id == pod.id:  # the run has no pod left: the follow is over
                return cursor.printed
            log.info("pod %s is gone; following the run's pod %s (%s) from its first line", pod.id,
                     successor.name, successor.id)  # fmt: skip
            printed, cursor, pod, tail = cursor.printed, _Cursor(), successor, MAX_TAIL
            cursor.printed = printed
            continue
        if not follow and (cursor.printed >= tail or not fresh or not dropped):
            return cursor.printed
        if fresh:
            wait = 1.0
        else:  # a stream that ends at once, again and again: back off instead of hammering RunPod
            client.sleep(wait)
            wait = min(wait * 2, MAX_RECONNECT_WAIT_S)
        log.info("log stream of pod %s ended; reconnecting from event %s", pod.id, cursor.last_id)


def _one_connection(
    client: RunPodClient,
    pod: Pod,
    tail: int,
    follow: bool,
    cursor: _Cursor,
    emit: Callable[[str], None],
    idle_s: float,
) -> tuple[int, bool]:
    """Read one connection; returns (events printed, whether it was cut off rather than gone idle)."""
    fresh = 0
    response = client.open_pod_logs(pod.id, tail, cursor.last_id, FOLLOW_READ_S if follow else idle_s)
    try:
        for event in parse_sse(response):
            if cursor.is_new(event):
                emit(redact(event.line))
                fresh += 1
                if not follow and cursor.printed >= tail:
                    return fresh, False
    except TimeoutError:
        return fresh, follow  # idle: without -f the backfill is over; with -f, reopen the stream
    except (OSError, http.client.HTTPException) as exc:
        log.info("log stream of pod %s was cut off (%s)", pod.id, type(exc).__name__)
    finally:
        response.close()
    return fresh, True
