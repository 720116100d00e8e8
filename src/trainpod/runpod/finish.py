"""What a pod does after its workload exits, so that nothing bills idle and no crash loop runs for hours.

RunPod starts a pod's container again whenever it exits, so the exit code alone is not enough:

| exit | meaning (docs/design.md, "Exit codes") | here |
| --- | --- | --- |
| 0 | DONE | failed-start count reset; TRAINPOD_ON_FINISH: stop (default), terminate or idle |
| any but 143, the run DONE, TRAINPOD_THEN_CONFIG set | the conversion after DONE follows in this pod (boot._run_then) | the training start settled as its code says, the pod left running; the conversion's exit then decides as a convert pod's, and its end (0: done; 2, 3, 5 or a crash loop: failed) goes to runs/<run>/then.json, its start marked as a convert pod's is (START-<workload>, below) |
| 143 | SIGTERM (spot interruption) | count reset: the start itself worked; RunPod stops the pod |
| 2, 3, 5 | bad input, budget spent, volume full | FAILED marker (when the run folder exists) and the pod stopped at once |
| 4 | this machine cannot run the image (trainpod.host) | MACHINE_UNFIT marker naming this pod, not counted as a failed start; the pod stopped: the supervisor replaces it with a new pod on another machine |
| 75 while another pod holds the run's LEASE (a datagen's: its dataset's) and renews it | this pod is a duplicate (two deploys, a replacement racing the original) | not counted, no marker: this pod stopped, the one training goes on; found live before the workload, this pod writes no START (nor counts its own earlier one): the run's START stays the training pod's; it writes its own once its workload takes the lease over (expired unrenewed), and none where a stop signal came during that wait |
| other (75, 1, ...) | temporary failure or crash | counted in runs/<run>/starts.json; at TRAINPOD_MAX_FAILED_STARTS in a row (default 3): FAILED marker (which takes the count over: once it is deleted, a start counts anew), pod stopped; a start that committed a newer checkpoint than LATEST named when it began begins the count again (it is failure 1); before the run is known (no TRAINPOD_RUN, the config not loaded yet) counted per pod in cache/starts/<pod id>.json, and the pod stopped at the same bound, with no marker |
| any other, the run DONE already | a finished run's pod started again failed before "already DONE" (its branch deleted) | not counted, no marker: TRAINPOD_ON_FINISH as after DONE |
| none: boot itself was killed | a segfault, the OOM killer, SIGKILL | found at the next start (`begin_start`): counted as exit 137 when no checkpoint was committed during it; one that committed a newer checkpoint is not counted and begins the count again |

In a pod, a workload on one GPU runs in boot's own process, so a death that takes the process with it never
reaches `after_workload`. Boot therefore writes runs/<run>/START before the workload and
`after_workload` removes it (this pod's alone); a START found by the next boot is a start that ended without a word.
A pod that finds another pod's live lease on the run before its workload (a duplicate) writes none:
the run's START is the pod's that trains, and what counts its death. Where its workload then takes the
lease over (that pod died, its lease expired unrenewed), the duplicate is the run's writer: it writes its
START there (checkpoint/lease.call_when_taken), else a death of it went uncounted. A conversion of the run (a
convert pod under its name, a deploy's `then`) marks its start the same way as START-<workload> (start_marker),
counted in starts-<workload>.json: a DONE run has no START, and the OOM killer taking a merge was uncounted, its
container converting again into the same kill at every start, billed for good.
The first SIGTERM removes it at once (trainpod.preemption's first-signal hooks): a spot stop is no
crash even when its SIGKILL comes during a long preflight. It counts only when the same pod wrote it
(another pod's may be a start still running there) and LATEST did not move meanwhile: a crash loop
makes no progress, while a spot pod SIGKILLed in its final commit (or a crash after hours of committed
steps) has moved on and is not held against the run. For the same reason a start that ends with a crash
after committing a newer step than it began at ends the row: the failures before it are forgotten, so a
spot pod that crashes once per start but commits steps every time is never stopped as a crash loop,
while starts that crash without a new checkpoint still reach TRAINPOD_MAX_FAILED_STARTS.

Exit 2 writes no marker into a run folder that does not exist yet: bad input leaves the volume
untouched. A workload that does not own the run folder (datagen, convert: workloads.Kind) counts its
failed starts in starts-<workload>.json beside the run's and writes no FAILED marker: a convert of a
DONE run that fails, or a datagen pod started under the run's name, must not mark the training run
FAILED (a supervisor would then stop its pod), nor clear the run's FAILED when it succeeds. The pod acts through the API with its own key (RUNPOD_API_KEY, RUNPOD_POD_ID, both set
by RunPod in every pod); when either is missing it says so and exits normally.

On an Instant Cluster (NUM_NODES > 1) node 0 (NODE_RANK 0) acts for the whole run, and `stop` and
`terminate` both delete the cluster (REST v2 `DELETE /v2/clusters/{id}`: v2 has no stop for clusters
and member pods are out of reach of the pod endpoints), so no node is left billing. RunPod puts no
cluster id into a pod's environment (docs/runpod/runpod-platform.md): node 0 reads it from its
own pod (`GET /v2/pods/{RUNPOD_POD_ID}`, `cluster.id`), else finds the cluster `<run>-<workload>` by
name. Other nodes leave markers, counters and the cluster alone, except exit 4, whose MACHINE_UNFIT
marker names the node so that the supervisor recreates the cluster.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from trainpod import atomic
from trainpod.checkpoint.lease import call_when_taken, live_holder, read_lease, renewed_by_its_holder
from trainpod.checkpoint.store import LATEST
from trainpod.errors import ConfigError, ExitCode, is_whole_number
from trainpod.log import redact
from trainpod.preemption import call_at_first_signal, end_by_default_at_sigterm_meanwhile, signals_seen
from trainpod.runpod.client import RunPodClient, RunPodError
from trainpod.volume import RunDir, Volume

log = logging.getLogger("trainpod.finish")

FAILED_MARKER = "FAILED"
# {"unix", "latest", "pod"}: a start in flight (boot writes it, after_workload removes it)
START_MARKER = "START"
KILLED = 137  # what a start that ended without a word is counted as: 128 + SIGKILL, its code unknown
UNFIT_MARKER = "MACHINE_UNFIT"  # {"pod_id", "unix"}: the supervisor replaces that pod, never restarts it
STARTS_FILE = "starts.json"
ON_FINISH = ("stop", "terminate", "idle")
DEFAULT_MAX_FAILED_STARTS = 3
STOP_AT_ONCE = {
    ExitCode.BAD_INPUT: "bad config or input",
    ExitCode.BUDGET_EXHAUSTED: "budget exhausted",
    ExitCode.VOLUME_FULL: "volume full",  # a restart fills the same volume again: free space first
}
START_WORKED = (ExitCode.DONE, ExitCode.PREEMPTED)


def on_finish(environ: dict[str, str]) -> str:
    value = environ.get("TRAINPOD_ON_FINISH") or "stop"
    if value not in ON_FINISH:
        raise ConfigError([f"TRAINPOD_ON_FINISH={value!r}; set it to one of: {', '.join(ON_FINISH)}"])
    return value


def max_failed_starts(environ: dict[str, str]) -> int:
    raw = environ.get("TRAINPOD_MAX_FAILED_STARTS") or str(DEFAULT_MAX_FAILED_STARTS)
    if not is_whole_number(raw) or int(raw) < 1:
        raise ConfigError(
            [f"TRAINPOD_MAX_FAILED_STARTS={raw!r} is not a whole number >= 1; set it like "
             f"TRAINPOD_MAX_FAILED_STARTS={DEFAULT_MAX_FAILED_STARTS}"]
        )  # fmt: skip
    return int(raw)


def check_environment(environ: dict[str, str]) -> None:
    """Fail at boot (exit 2), before any work, when a finish setting is malformed."""
    on_finish(environ)
    max_failed_starts(environ)


def after_workload(
    code: int,
    run: RunDir | None,
    environ: dict[str, str],
    workload: str,
    client_factory: Callable[[dict[str, str]], RunPodClient] = RunPodClient.from_env,
    owns_run: bool = True,
    lease: Path | None = None,
    progressed: bool = False,
    then_follows: bool = False,
    then_step: bool = False,
    error: str | None = None,
) -> int:
    """Count, mark and stop the pod as the table above says; returns `code` unchanged. `owns_run`: the
    workload's outcome is the run's (workloads.Kind.owns_run_folder), not a datagen's or a convert's.
    `lease`: the one a duplicate of this pod runs into, when not the run's (a datagen's dataset lease).
    `progressed`: this start committed a newer checkpoint than the run had when it began (committed_since).
    `then_follows`: a deploy's `then` conversion runs in this pod once the run is DONE (TRAINPOD_THEN_CONFIG):
    a DONE run's pod is left as it is, for boot to run it and finish after it. `then_step`: `code` is that
    conversion's; its end (done, or failed for good: bad input, a crash loop) is recorded in the run's
    then.json (volume.THEN_RECORD), which supervisors read beside DONE, with `error` (its last error line) as why.

    On an Instant Cluster only node 0 (NODE_RANK 0, which holds global rank 0) acts for the run;
    the other nodes return their code and leave markers, counters and pods alone (but for exit 4).
    """
    if int(environ.get("NODE_RANK") or 0) != 0:
        if code == ExitCode.MACHINE_UNFIT:
            _mark_unfit(run, environ)
            log.warning(
                "this node's machine cannot run the image (exit 4); the supervisor recreates the cluster"
            )
        return code
    try:
        _end_start(run, environ, start_marker(workload, owns_run))
        action = _decide(code, run, environ, workload, owns_run, lease, progressed, then_step, error)
    except (ConfigError, OSError) as exc:  # a bad setting or an unwritable volume must not hide `code`
        log.warning("after exit %d: %s; the pod is left as it is", code, exc)
        return code
    if then_follows and then_runs(code, run):
        return code
    _act(action, run, environ, workload, client_factory)
    return code


def then_runs(code: int, run: RunDir | None) -> bool:
    """Whether a deploy's `then` conversion runs after this exit: the run is DONE (now, or before this start:
    a pod started again after a stop during the conversion, whose training start exits at once), and the start
    was not a stop (a spot stop's SIGKILL comes 5 s after its SIGTERM)."""
    return code != ExitCode.PREEMPTED and run is not None and run.done.exists()


def _then_failure(reason: str, error: str | None, run: RunDir | None, workload: str) -> str:
    """then.json's reason: the exit's meaning, the conversion's last error line, and where its log is."""
    logged = f"runs/{run.name}/logs/{workload}.log" if run is not None else "the pod's (`trainpod logs`)"
    return f"{reason}: {error}; its log: {logged}" if error else f"{reason}; its log: {logged}"


def record_then(run: RunDir | None, workload: str, code: int, reason: str | None = None) -> None:
    """How the `then` conversion ended, beside DONE: supervisors end at a "done" or "failed" newer than the
    newest deploy, and bring the pod back while there is none (boot removes it when it starts the conversion)."""
    if run is None:
        return
    outcome = "done" if code == ExitCode.DONE else "failed"
    reason = redact(reason) if reason is not None else None
    record = {"workload": workload, "outcome": outcome, "exit": code, "reason": reason, "unix": time.time()}
    atomic.write_json(run.then_record, record)
    if outcome == "failed":
        log.error("the %s after DONE failed for good: %s; the run stays DONE", workload, reason)


def starts_file(workload: str, owns_run: bool = True) -> str:
    """Where the run folder counts a workload's failed starts: starts.json for the run's own, starts-<workload>.json
    for a datagen's or a conversion's under the run's name (it never marks the run)."""
    return STARTS_FILE if owns_run else f"starts-{workload}.json"


def start_marker(workload: str, owns_run: bool = True) -> str:
    """The marker of a start in flight in the run folder: START for the run's own workload, START-<workload> for
    a conversion of the run (a convert pod, a deploy's `then`), which a DONE run may see any number of."""
    return START_MARKER if owns_run else f"{START_MARKER}-{workload}"


def begin_start(
    run: RunDir | None,
    environ: dict[str, str],
    workload: str,
    client_factory: Callable[[dict[str, str]], RunPodClient] = RunPodClient.from_env,
    owns_run: bool = True,
    then_step: bool = False,
) -> int | None:
    """Before the workload: count the previous start if it ended without a word and committed nothing
    (the table's last row), then mark this one. Returns the exit code to end with when that count makes
    the run FAILED (the pod is stopped, the workload not started), else None.

    `owns_run` False: a conversion of the run (its own marker and count, starts-<workload>.json; a DONE run's
    too): the OOM killer taking a merge was uncounted, and the pod's container converted again into the same kill
    at every start, billed for good. `then_step`: it is a deploy's `then`, whose end at the bound is then.json's."""
    pod = environ.get("RUNPOD_POD_ID")  # outside a pod nothing starts the container again: no loop to end
    if (
        not pod
        or run is None
        or workload == "supervise"
        or int(environ.get("NODE_RANK") or 0)
        or (owns_run and run.done.exists())
    ):
        return None
    holder = _leased_by_another_pod(run, pod)
    if holder is not None:
        # A duplicate (two deploys, a replacement racing the original): the run's START and its count are the
        # training pod's. Written over (and removed at this pod's exit 75), that pod's death went uncounted.
        # Its workload may still take the lease over (that pod died, its lease expired unrenewed): from there
        # this start is the run's writer, and a death of it without a word must be counted like any other's.
        log.info(
            "%s holds this run's lease: this start marks the run only if it takes the lease over", holder
        )
        stops_before = signals_seen()
        marker_name = start_marker(workload, owns_run)
        call_when_taken(run.lease, lambda: _mark_start(run, pod, _latest(run), stops_before, marker_name))
        return None
    marker, latest = run.root / start_marker(workload, owns_run), _latest(run)
    try:
        previous = atomic.read_json(marker)
    except (FileNotFoundError, ValueError):
        previous = None
    # Only this pod's own earlier start: another pod's marker may belong to a start still running there.
    if previous is not None and previous.get("pod") == pod and _step(latest) > _step(previous.get("latest")):
        # It committed steps before it died: not a crash loop, whatever the starts before it did.
        atomic.remove(run.root / starts_file(workload, owns_run))
    elif previous is not None and previous.get("pod") == pod and previous.get("latest") == latest:
        log.warning(
            "the previous start ended without a word (killed by a signal: a segfault, the OOM killer) and "
            "committed no checkpoint; counted as exit %d",
            KILLED,
        )
        error = "the previous start ended without a word (killed: the OOM killer, a segfault)"
        action = _decide(KILLED, run, environ, workload, owns_run=owns_run, then_step=then_step, error=error)
        if action == "stop":
            atomic.remove(marker)
            _act(action, run, environ, workload, client_factory)
            return KILLED
    _mark_start(run, pod, latest, marker=marker.name)
    end_by_default_at_sigterm_meanwhile()  # until the workload installs its own handler
    return None


def _mark_start(
    run: RunDir, pod: str, latest: str | None, stops_before: int | None = None, marker: str = START_MARKER
) -> None:
    """This pod's START in the run, naming the LATEST it begins from (`latest`): at boot, or where a duplicate's
    workload takes the run's lease over. There the START found is the dead pod's, not this pod's to count (its
    own earlier START, had it died silently, was counted when this pod booted without a live lease elsewhere).

    `stops_before` (a takeover's): preemption.signals_seen() at boot. A stop signal that came since, while the
    workload waited for the dead pod's lease to expire, ran the first-signal hooks before this one was
    registered: the START goes at once, as that signal would have removed it."""
    path = run.root / marker  # START, or a conversion's START-<workload> (start_marker)
    run.root.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, {"unix": time.time(), "latest": latest, "pod": pod})
    # A SIGTERM from here on is a preemption, not a death without a word, even when RunPod's SIGKILL comes
    # before the workload can exit (a spot stop during a long preflight, such as a base model's download).
    call_at_first_signal(lambda: atomic.remove(path))
    if stops_before is not None and signals_seen() != stops_before:  # read after the hook: no gap between
        atomic.remove(path)


def _leased_by_another_pod(run: RunDir, pod: str) -> str | None:
    """Who holds the run's lease ("pod X", "a process on host Y") where a live writer other than this pod does."""
    owner = live_holder(run.lease)
    if not isinstance(owner, dict) or owner.get("pod_id") == pod:
        return None
    return f"pod {owner['pod_id']}" if owner.get("pod_id") else f"a process on host {owner.get('host')}"


def _end_start(run: RunDir | None, environ: dict[str, str], name: str = START_MARKER) -> None:
    """Remove this pod's START (`name`: start_marker's); another pod's (a duplicate here, which wrote none) is that
    pod's start."""
    if run is None:
        return
    marker = run.root / name
    try:
        mine = atomic.read_json(marker).get("pod") == environ.get("RUNPOD_POD_ID")
    except (FileNotFoundError, ValueError, AttributeError):
        mine = True  # none, or unreadable: nobody's to keep
    if mine:
        atomic.remove(marker)


def _latest(run: RunDir) -> str | None:
    """The run's LATEST checkpoint name (None before its first commit, and for workloads without any)."""
    try:
        return (run.checkpoints / LATEST).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _step(latest: str | None) -> int:
    """The step a LATEST name (step-<N>) commits, -1 for none (or a name that is no step's)."""
    number = (latest or "").removeprefix("step-")
    return int(number) if number.isdigit() else -1


def latest_checkpoint(run: RunDir | None) -> str | None:
    """What a start reads when it begins, for committed_since once it ends."""
    return _latest(run) if run is not None else None


def committed_since(run: RunDir | None, latest_at_start: str | None) -> bool:
    """Whether the run's LATEST names a newer step than `latest_at_start`: the start made progress. A LATEST
    that went back (its checkpoint failed verification and an older one was taken) is none."""
    return run is not None and _step(_latest(run)) > _step(latest_at_start)


def _act(
    action: str,
    run: RunDir | None,
    environ: dict[str, str],
    workload: str,
    client_factory: Callable[[dict[str, str]], RunPodClient],
) -> None:
    if action in ("stop", "terminate") and int(environ.get("NUM_NODES") or 1) > 1:
        name = f"{run.name}-{workload}" if run is not None else None
        _delete_cluster(environ, name, client_factory)
    elif action != "idle":
        _act_on_pod(action, environ, client_factory)


def _decide(
    code: int,
    run: RunDir | None,
    environ: dict[str, str],
    workload: str,
    owns_run: bool = True,
    lease: Path | None = None,
    progressed: bool = False,
    then_step: bool = False,
    error: str | None = None,
) -> str:
    """What to do with this pod: stop, terminate, idle (leave it) or restart (let RunPod start it again)."""
    if workload == "supervise":
        # A supervisor that ended has nothing left to watch; 75 (RunPod unreachable) is worth another start.
        return "restart" if code == ExitCode.TEMPORARY else on_finish(environ)
    counts = starts_file(workload, owns_run)
    if run is not None or code in START_WORKED:
        _forget_failures_before_the_run(environ)  # this start got past them: a new count begins
    if code in START_WORKED:
        _reset_failures(run, counts, owns_run)
        if then_step and code == ExitCode.DONE:
            record_then(run, workload, code)
        return on_finish(environ) if code == ExitCode.DONE else "idle"
    if owns_run and run is not None and run.done.exists():
        # A finished run's pod started again (by hand, to reach the volume) and failed before the lifecycle's
        # "already DONE": its branch deleted from the git remote, its config edited since. Nothing of the run
        # changed; a FAILED marker or a count in it had a supervisor report the finished run as FAILED.
        log.warning(
            "run %s is DONE; this start's exit %d leaves it so, and the pod does as after DONE",
            run.name,
            code,
        )
        return on_finish(environ)
    if code == ExitCode.MACHINE_UNFIT:
        return _machine_unfit(run, environ)
    if code in STOP_AT_ONCE:
        reason = f"{STOP_AT_ONCE[ExitCode(code)]} (exit {code}); restarting cannot help"
        if run is not None and run.root.is_dir() and owns_run:
            _mark_failed(run, reason, code, failures=1)
        if then_step:
            record_then(run, workload, code, _then_failure(reason, error, run, workload))
        # A warning: the error itself is already logged, as the one ERROR line a user looks for.
        log.warning("stopping this pod: %s", reason)
        return "stop"
    if run is None:
        return _failure_before_the_run(code, environ)
    holder = _live_holder_elsewhere(lease or run.lease, environ) if code == ExitCode.TEMPORARY else None
    if holder is not None:
        # Counting it would FAIL the run after three starts, and a supervisor then stops the pod that trains;
        # a datagen duplicate's count would be the building pod's too (one starts-datagen.json per name).
        log.warning(
            "pod %s holds %s: this pod is a duplicate; stopping it (not counted as a failed start)",
            holder,
            "this run's lease and is training it" if lease is None else f"{lease} and is writing it",
        )
        return "stop"
    if progressed:  # this start moved the run on: the failures before it were no loop of the same crash
        log.warning("this start committed %s before it failed: the failed starts before it are forgotten",
                    _latest(run))  # fmt: skip
        atomic.remove(run.root / counts)
    failures = _count_failure(run.root / counts, code)
    limit = max_failed_starts(environ)
    if failures < limit:
        log.warning("failed start %d/%d (exit %d); RunPod starts the container again", failures, limit, code)
        return "restart"
    reason = f"{failures} failed starts in a row, the last with exit {code}; look at runs/{run.name}/logs/"
    if owns_run:
        _mark_failed(run, reason, code, failures)
    if then_step:
        record_then(run, workload, code, _then_failure(reason, error, run, workload))
    log.error("crash loop: %s; stopping this pod (TRAINPOD_MAX_FAILED_STARTS=%d)", reason, limit)
    return "stop"


def _live_holder_elsewhere(lease: Path, environ: dict[str, str]) -> str | None:
    """The pod id in `lease` (the run's LEASE, a dataset's) when another pod holds it and renews it, else None.

    This start has ended and released any lease of its own, so a lease left is another writer's; one
    that expires unrenewed was a pod killed before it could release it (waited for: at most one TTL).
    """
    held = read_lease(lease)
    owner = held.get("owner") if held else None
    holder = owner.get("pod_id") if isinstance(owner, dict) else None
    if not holder or holder == environ.get("RUNPOD_POD_ID"):
        return None
    return holder if renewed_by_its_holder(lease, held) else None


def _machine_unfit(run: RunDir | None, environ: dict[str, str]) -> str:
    """Stop this pod (restarting it lands on the same machine) and tell the supervisor which one to replace."""
    _mark_unfit(run, environ)
    log.warning("stopping this pod: its machine cannot run the image (exit 4); the supervisor replaces it")
    return "stop"


def _mark_unfit(run: RunDir | None, environ: dict[str, str]) -> None:
    pod_id = environ.get("RUNPOD_POD_ID")
    if run is not None and pod_id:
        run.root.mkdir(parents=True, exist_ok=True)
        atomic.write_json(run.root / UNFIT_MARKER, {"pod_id": pod_id, "unix": time.time()})


def _reset_failures(run: RunDir | None, counts: str, owns_run: bool) -> None:
    if run is None:
        return
    # Only what exists is removed: a DONE run's folder stays unchanged.
    atomic.remove(run.root / counts)
    if owns_run:
        atomic.remove(run.root / FAILED_MARKER)


def _failure_before_the_run(code: int, environ: dict[str, str]) -> str:
    """A start that failed before it knew its run (no TRAINPOD_RUN, and the config never loaded: a git
    sync that kept failing, a crash) is counted per pod, else a hand-made pod would restart forever."""
    path = _starts_before_the_run(environ)
    if path is None:
        log.warning("exit %d before the run was known: not counted (no pod id or no volume here)", code)
        return "restart"
    failures, limit = _count_failure(path, code), max_failed_starts(environ)
    if failures < limit:
        log.warning("failed start %d/%d before the run was known (exit %d); RunPod starts the container again",
                    failures, limit, code)  # fmt: skip
        return "restart"
    atomic.remove(path)  # the pod is stopped: starting it again by hand (the cause fixed) counts anew
    log.error("crash loop: %d failed starts in a row before the run was known, the last with exit %d; stopping "
              "this pod (TRAINPOD_MAX_FAILED_STARTS=%d); its log says why", failures, code, limit)  # fmt: skip
    return "stop"


def _starts_before_the_run(environ: dict[str, str]) -> Path | None:
    """cache/starts/<pod id>.json on the volume: RunPod restarts the same pod's container, and the container
    disk does not outlive a restart. None outside a pod or without the volume."""
    pod, root = environ.get("RUNPOD_POD_ID") or "", Volume.from_env(environ).root
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", pod) or not root.is_dir():
        return None
    return root / "cache" / "starts" / f"{pod}.json"


def _forget_failures_before_the_run(environ: dict[str, str]) -> None:
    path = _starts_before_the_run(environ)
    if path is not None:
        atomic.remove(path)


def _count_failure(path: Path, code: int) -> int:
    try:
        failures = int(atomic.read_json(path).get("consecutive_failures", 0))
    except (FileNotFoundError, ValueError, AttributeError):
        failures = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(
        path, {"consecutive_failures": failures + 1, "last_exit_code": code, "unix": time.time()}
    )
    return failures + 1


def _mark_failed(run: RunDir, reason: str, code: int, failures: int) -> None:
    atomic.write_json(
        run.root / FAILED_MARKER,
        {"reason": reason, "exit_code": code, "failures": failures, "unix": time.time()},
    )
    # FAILED ends the row (the marker keeps its count): once the cause is fixed and FAILED deleted, as the
    # supervisor says to, the next start's failure is the first of a new row, not the crash loop's next.
    atomic.remove(run.root / STARTS_FILE)


def _act_on_pod(
    action: str, environ: dict[str, str], client_factory: Callable[[dict[str, str]], RunPodClient]
) -> None:
    if action == "restart":
        return
    pod_id = environ.get("RUNPOD_POD_ID")
    if not pod_id:
        log.info("not in a RunPod pod (RUNPOD_POD_ID unset): no pod to %s", action)
        return
    if not environ.get("RUNPOD_API_KEY"):
        log.warning(
            "cannot %s pod %s: RUNPOD_API_KEY is not set (RunPod sets it in every pod)", action, pod_id
        )
        return
    try:
        client = client_factory(environ)
        if action == "terminate":
            client.terminate_pod(pod_id)
        else:
            client.stop_pod(pod_id)
    except RunPodError as exc:
        log.warning(
            "could not %s this pod (%s): stop it in RunPod's console or it keeps billing", action, exc
        )
        return
    log.info("asked RunPod to %s this pod (%s)", action, pod_id)


def _delete_cluster(
    environ: dict[str, str],
    name: str | None,
    client_factory: Callable[[dict[str, str]], RunPodClient],
) -> None:
    """Node 0's stop: delete this pod's Instant Cluster, every node with it (the volume keeps the run)."""
    pod_id = environ.get("RUNPOD_POD_ID")
    if not pod_id or not environ.get("RUNPOD_API_KEY"):
        log.warning(
            "cannot delete this cluster: RUNPOD_POD_ID or RUNPOD_API_KEY is not set (RunPod sets both)"
        )
        return
    try:
        client = client_factory(environ)
        cluster_id = _cluster_id(client, pod_id, name)
        if cluster_id is None:
            log.warning("pod %s is in no cluster RunPod knows of: nothing deleted; `trainpod stop RUN` does it",
                        pod_id)  # fmt: skip
            return
        client.delete_cluster(cluster_id)
    except RunPodError as exc:
        log.warning("could not delete this pod's cluster (%s): the supervisor deletes it at DONE, or run "
                    "`trainpod stop RUN`; until then every node keeps billing", exc)  # fmt: skip
        return
    log.info(
        "asked RunPod to delete this pod's cluster %s (every node; clusters cannot be stopped)", cluster_id
    )


def _cluster_id(client: RunPodClient, pod_id: str, name: str | None) -> str | None:
    """The cluster of this pod from its v2 membership, else the run's cluster by name."""
    pod = client.get_pod_v2(pod_id)
    if pod is not None and pod.cluster_id:
        return pod.cluster_id
    found = client.list_clusters(name=name) if name else []
    return found[0].id if found else None
