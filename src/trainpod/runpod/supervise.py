"""`trainpod supervise RUN`: bring an interrupted spot pod (or a broken cluster) back until the run is DONE.

    trainpod supervise tiny --config configs/deploy/pretrain-spot.yaml            # a loop
    trainpod supervise tiny --config configs/deploy/pretrain-spot.yaml --once     # one look (cron, CI)
    trainpod supervise pretrain-125m --once   # the config: the one under configs/deploy/ with that run

RunPod stops an interrupted spot pod and never starts it again. Each look: read the run's state on
the volume when it is mounted here (DONE, FAILED, status.json), list the pods `<run>-<workload>`,
then exactly one decision, logged in one line with its reason:
  DONE -> stop a pod still running, exit 0 (with the deploy's `then`: once runs/<run>/then.json, newer
  than the newest deploy, says the conversion after DONE ended: done -> as DONE, failed -> stop, exit 2;
  until then the DONE run's pod is brought back as below, for its boot to convert);  FAILED marker (the
  pod's exit 2, 3 or 5, or a crash loop; runpod/finish.py) -> exit 2, never a restart;  budget spent -> stop, exit 3;
  a pod RUNNING -> wait;  EXITED or gone -> start it again, or create a new pod on the same volume
  with the same env and spot setting as deployed (GPU types in order; a gone pod's secrets as the run's pods had them: references, or
  deploy --secrets-from-env's values from this supervisor's environment, never from a file; a pod gone before
  any look: as `trainpod deploy` recorded it beside the run, runs/.<run>.DEPLOYED, record_deployment); failed
  attempts back off exponentially and are bounded;
  EXITED with a MACHINE_UNFIT marker naming it (exit 4: its machine cannot run the image) -> never
  started again but replaced by a new pod, same volume, env and GPU-type priority (RunPod places it;
  its API cannot exclude a machine), at most supervise.max_replacements times in a row, then the last one
  terminated (a stopped pod keeps its machine: a deploy would start it there again) and exit 4.
With `nodes: N` > 1 the unit is the run's Instant Cluster (runpod/units.py): DONE, FAILED and a spent
budget delete it (v2 has no stop for clusters); any node EXITED, ERROR, TERMINATED, lost, or named by
MACHINE_UNFIT deletes it and creates it again on the same volume with its nodes' env, within the same
bounds (max_restarts, failed starts with backoff, max_replacements for exit 4).
Away from the volume (a laptop, a CI runner) the same markers are read through the volume's S3 API when
RunPod's S3 key is exported (`trainpod supervise`); a read that fails is tried again, and a look whose reads
still fail starts nothing, for up to 3 looks in a row, then goes by the pods alone. With neither, DONE, FAILED and MACHINE_UNFIT are
invisible: the pod stops itself after DONE and a restarted one exits at once, so restarts are bounded by
supervise.max_restarts. The recommended mode is the
`supervise` workload in a cheap on-demand CPU pod with the same network volume. A look that raises
something unforeseen is logged with its traceback and tried again at the next poll; five in a row end
the loop with exit 1.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainpod import atomic
from trainpod.config.deploy import DeployConfig
from trainpod.errors import ConfigError, ExitCode, InputError, TemporaryError, TrainpodError
from trainpod.remote.listing import LocalFiles, VolumeFiles
from trainpod.runpod.client import (
    RunPodAuthError,
    RunPodClient,
    RunPodError,
    RunPodNoCapacity,
    RunPodUnavailable,
)
from trainpod.runpod.deploy import pod_env, pod_problems
from trainpod.runpod.finish import FAILED_MARKER, UNFIT_MARKER
from trainpod.runpod.units import Look, build_unit
from trainpod.volume import Volume, is_then_record, stop_marker_keys

if TYPE_CHECKING:
    from trainpod.remote.s3 import VolumeS3

log = logging.getLogger("trainpod.supervise")

# Looks in a row that raise something unforeseen before the supervisor gives up with exit 1.
UNFORESEEN_LOOKS_IN_A_ROW = 5
# Looks in a row whose S3 reads failed (after retries) that start nothing: a DONE run's pod looks interrupted
# to a supervisor that cannot read DONE. After them the S3 API counts as down and the pods alone decide.
UNREADABLE_LOOKS_BEFORE_BLIND = 3


@dataclass
class SupervisorState:
    """What the supervisor remembers between looks (a file, so `--once` runs share it)."""

    restarts: int = 0
    failed_starts: int = 0
    # Starts in a row refused for want of a free machine (RunPodNoCapacity): backed off as failed starts, never
    # an end of supervising (_restart).
    capacity_waits: int = 0
    replacements: int = 0  # pods replaced in a row because their machine could not run the image
    next_attempt_unix: float = 0.0
    observed_cost_usd: float = 0.0
    last_look_unix: float | None = None
    last_hourly_usd: float = 0.0  # what was billing at that look: the price of the time until the next
    whole_cluster: str | None = None  # the cluster seen with every node RUNNING: a node missing later is lost
    stopped_unix: float | None = None  # `trainpod stop` ran here: never bring the run back (deploy clears it)
    # The run's pods had the secrets' values (deploy --secrets-from-env), not RunPod references: a pod made
    # with none left to copy the env from takes them from this supervisor's environment. Never a value here.
    secrets_as_values: bool = False
    # The run's pods are spot (deploy --spot/--on-demand may differ from the YAML): so is a pod made anew.
    spot: bool | None = None
    # The newest deploy record (DeployRecord.unix) spot and secrets_as_values were taken from or are newer than:
    # an older record never overrides what a pod seen since (or this machine's own deploy) told.
    deployed_unix: float | None = None
    step_at_restart: int | None = None  # the run's step at the last restart: one past it means progress
    unreadable_looks: int = 0  # looks in a row whose S3 reads of the run's markers failed

    @classmethod
    def load(cls, path: Path) -> SupervisorState:
        """From `path`, else (a volume supervised by an older kit) from inside the run folder, where it was."""
        for where in (path, *_inside_the_run_folder(path)):
            try:
                return cls(**atomic.read_json(where))
            except FileNotFoundError:
                continue
            except (ValueError, TypeError):
                break
        return cls()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, asdict(self))


@dataclass(frozen=True)
class RunView:
    """The run as the volume shows it; all unknown (None/False) when the volume is not mounted here."""

    visible: bool
    done: bool = False
    failed: str | None = None
    cost_usd: float | None = None
    unfit_pod: str | None = None  # the pod whose machine could not run the image (MACHINE_UNFIT)
    stopped: bool = False  # a STOPPED marker: `trainpod stop` asked for the run to stay down
    step: int | None = None  # the step status.json last recorded: the run's progress
    unreadable: str | None = None  # why the volume's S3 API could not be read at this look (not: absent)
    deployed: DeployRecord | None = None  # what the newest `trainpod deploy` rented (runs/.<run>.DEPLOYED)
    then: dict | None = None  # how the deploy's `then` conversion last ended (runs/<run>/then.json)

    @classmethod
    def read(cls, volume: Volume | None, run: str) -> RunView:
        return cls(visible=False) if volume is None else cls.read_files(LocalFiles(volume.root), run)

    @classmethod
    def read_files(cls, files: VolumeFiles, run: str) -> RunView:
        """From the volume mounted here (LocalFiles) or through its S3 API (VolumeS3: a laptop, a CI runner,
        where a supervisor without it cannot see DONE or FAILED and starts a finished pod again and again)."""
        run_dir = Volume(Path()).run(run)  # the paths relative to the volume's root: the files' keys

        def read(path: Path) -> bytes | None:
            return files.read(path.as_posix())

        def fields(path: Path) -> dict | None:
            raw = read(path)
            if raw is None:
                return None
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            return value if isinstance(value, dict) else {UNREADABLE: True}

        failed, status = fields(run_dir.root / FAILED_MARKER), fields(run_dir.status) or {}
        reason = None
        if failed is not None:
            reason = (
                "the marker is unreadable"
                if UNREADABLE in failed
                else failed.get("reason", "no reason recorded")
            )
        return cls(
            visible=True,
            done=read(run_dir.done) is not None,
            failed=reason,
            cost_usd=status.get("cost_usd"),
            unfit_pod=(fields(run_dir.root / UNFIT_MARKER) or {}).get("pod_id"),
            stopped=any(read(Path(key)) is not None for key in stop_marker_keys(run)),
            step=status.get("step") if isinstance(status.get("step"), int) else None,
            deployed=DeployRecord.parse(read(Path(deploy_record_key(run)))),
            then=then if is_then_record(then := fields(run_dir.then_record)) else None,
        )

    def then_ended(self, deployed_unix: float | None = None) -> dict | None:
        """The `then` conversion's end when it came after the newest deploy: a deploy made since (a fixed or a
        changed conversion config) has the pod run it again, and its supervisor waits for that end.
        `deployed_unix`: the newest deploy the supervisor knows of besides the volume's record (its machine's own
        deploy, whose record an S3 outage kept off the volume until the pod boots and writes it)."""
        newest = max(self.deployed.unix if self.deployed is not None else 0.0, deployed_unix or 0.0)
        if self.then is None or self.then["unix"] < newest:
            return None
        return self.then


UNREADABLE = "_unreadable"  # a marker whose bytes are not a JSON object (cut short, say)


def mark_stopped(
    run: str, volume: Volume | None, stopped: bool = True, volume_s3: VolumeS3 | None = None
) -> None:
    """Record (or, `stopped=False`, clear) a user's `trainpod stop` where supervisors look: this
    machine's supervisor state and a STOPPED marker beside the run, on the volume when it is mounted
    here, else through its S3 API when given (what a supervisor away from the volume reads). A record is made
    here first and a clear made here last: one that fails on the volume leaves this machine's supervisor stopped
    (`trainpod stop` stops the pods all the same, a deploy is refused and the run stays stopped)."""
    if stopped:
        _mark_stopped_here(run, volume, stopped)
    _mark_stopped_on_the_volume(run, volume, stopped, volume_s3)
    if not stopped:
        _mark_stopped_here(run, volume, stopped)


def _mark_stopped_here(run: str, volume: Volume | None, stopped: bool) -> None:
    for where in {state_path(None, run), *([state_path(volume, run)] if volume is not None else [])}:
        state = SupervisorState.load(where)
        if stopped or state.stopped_unix is not None:
            state.stopped_unix = time.time() if stopped else None
            state.save(where)


def _mark_stopped_on_the_volume(
    run: str, volume: Volume | None, stopped: bool, volume_s3: VolumeS3 | None
) -> None:
    marker, *older = stop_marker_keys(run)
    if volume is not None:
        if stopped:
            (volume.root / marker).parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(volume.root / marker, {"unix": time.time()})
        else:
            for key in (marker, *older):
                atomic.remove(volume.root / key)
    elif volume_s3 is not None:
        if stopped:
            volume_s3.put_bytes(marker, json.dumps({"unix": time.time()}).encode())
        else:
            for key in (marker, *older):
                volume_s3.remove(key)


def stop_not_cleared(
    run: str, volume: Volume | None, volume_s3: VolumeS3 | None, mount_path: str, exc: Exception
) -> TrainpodError:
    """`trainpod deploy` could not remove the run's STOPPED (mark_stopped): the deploy is refused, since a supervisor
    still reading it (supervise.yml, a supervise pod, another machine) would leave the new pod down after an
    interruption. Exit 75 where S3 or the volume is having trouble, else 2 (the S3 key refused, ...)."""
    marker = stop_marker_keys(run)[0]
    where = f"on the volume at {volume.root}" if volume is not None else f"through {volume_s3!r}'s S3 API"
    message = (
        f"deploy refused, nothing was made or started: run {run} was stopped with `trainpod stop`, and its record "
        f"of that, {marker} {where}, could not be removed: {exc}. A supervisor that still reads it (supervise.yml, "
        "a supervise pod, another machine) would leave the new pod down after an interruption. Fix that and deploy "
        f"again, or remove the record where the volume can be reached (in a pod on it: rm {mount_path}/{marker}) "
        "and deploy again"
    )
    # An I/O error of the volume (OSError) or S3 down is worth the same deploy again; the S3 key refused is not.
    transient = isinstance(exc, TemporaryError) or not isinstance(exc, TrainpodError)
    return TemporaryError(message) if transient else InputError(message)


@dataclass(frozen=True)
class DeployRecord:
    """What `trainpod deploy` rented, beside the run on the volume: a supervisor whose first look finds the pod
    already gone has no pod to copy it from and would go by the YAML (spot where on-demand was rented,
    references that may name no RunPod secret where values were sent). Whether the secrets went as values,
    never a value."""

    spot: bool
    secrets_as_values: bool
    unix: float  # when: a newer deploy's record replaces an older one

    @classmethod
    def parse(cls, raw: bytes | None) -> DeployRecord | None:
        """None when absent, or unreadable (cut short, hand-edited): the supervisor then goes by what it has."""
        try:
            fields = json.loads(raw) if raw is not None else None
            spot, as_values, unix = fields["spot"], fields["secrets_as_values"], float(fields["unix"])
        except (ValueError, TypeError, KeyError):
            return None
        return cls(spot, as_values, unix) if isinstance(spot, bool) and isinstance(as_values, bool) else None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


DEPLOYED_MARKER = "DEPLOYED"


def deploy_record_key(run: str) -> str:
    """runs/.<run>.DEPLOYED, relative to the volume's root. Beside the run folder, never in it: a folder made by
    a deploy would look like a started run (boot's new_run and _remove_unstarted leave a refused first start's
    folder behind, `trainpod ls`/`status` list it), and the lifecycle owns what is in it (LEASED_FILES). The
    leading dot makes it a name no run can have (RUN_NAME_PATTERN), and a file, which no run listing counts;
    as datasets/.<name>.LEASE lies beside its dataset."""
    return f"runs/.{run}.{DEPLOYED_MARKER}"


def record_deployment(
    run: str,
    volume: Volume | None,
    spot: bool,
    secrets_as_values: bool,
    volume_s3: VolumeS3 | None = None,
) -> bool:
    """Record what `trainpod deploy` rented where supervisors look: this machine's supervisor state, and a
    DeployRecord beside the run on the volume when it is mounted here, else through its S3 API when given
    (what a supervisor elsewhere reads: supervise.yml, a supervise pod, another laptop). A pod seen later
    overrides it (Supervisor._decide). False when it reached no volume."""
    record = DeployRecord(spot, secrets_as_values, time.time())
    where = state_path(None, run)
    state = SupervisorState.load(where)
    state.spot, state.secrets_as_values, state.deployed_unix = spot, secrets_as_values, record.unix
    state.save(where)
    data = record.to_json().encode()
    if volume is not None:
        target = volume.root / deploy_record_key(run)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(target, data)
    elif volume_s3 is not None:
        volume_s3.put_bytes(deploy_record_key(run), data)
    return volume is not None or volume_s3 is not None


STATE_SUFFIX = ".supervise.json"


def keep_pods_deploy_record(volume: Volume, run: str, raw: str) -> bool:
    """At a pod's boot: write the record its deploy gave it (deploy.DEPLOYED_ENV) beside the run when it is newer
    than the one there. A deploy that reached neither the volume nor its S3 API recorded nothing, and an older
    deploy's record (--on-demand, secrets as values) stayed in force for supervisors elsewhere. A pod started again
    keeps the env of the deploy that made it: its older record never replaces a newer one. True when written."""
    record = DeployRecord.parse(raw.encode())
    target = volume.root / deploy_record_key(run)
    try:
        existing = DeployRecord.parse(target.read_bytes())
    except FileNotFoundError:
        existing = None
    if record is None or (existing is not None and existing.unix >= record.unix):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(target, record.to_json().encode())
    return True


def state_path(volume: Volume | None, run: str, environ: dict[str, str] | None = None) -> Path:
    """On the volume beside the run folder when it is here (runs/.<run>.supervise.json: a supervise pod's
    first look, before the run's first start, makes no run folder; see deploy_record_key); else in the
    user's cache folder."""
    if volume is not None:
        return volume.root / "runs" / f".{run}{STATE_SUFFIX}"
    environ = os.environ if environ is None else environ
    cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "trainpod" / "supervise" / f"{run}.json"


def _inside_the_run_folder(path: Path) -> list[Path]:
    """runs/<run>/supervise.json for runs/.<run>.supervise.json: where older kits kept a supervisor's state on
    the volume (read until the state is first saved beside the run folder, never written)."""
    name = path.name
    if path.parent.name != "runs" or not (name.startswith(".") and name.endswith(STATE_SUFFIX)):
        return []
    return [path.parent / name[1 : -len(STATE_SUFFIX)] / "supervise.json"]


class Supervisor:
    def __init__(
        self,
        client: RunPodClient,
        config: DeployConfig,
        volume: Volume | None,
        state_file: Path,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        volume_s3: VolumeS3 | None = None,
    ):
        self.client, self.config, self.volume = client, config, volume
        self.volume_s3 = volume_s3  # the volume through its S3 API, when it is not mounted here
        self.state_file, self.clock, self.sleep = state_file, clock, sleep
        self.policy = config.supervise
        self.unit = build_unit(client, config)

    def run(self, once: bool = False, stop_requested: Callable[[], bool] = lambda: False) -> int:
        """Look, decide, act, until a final verdict (its exit code) or, with `once`, after one look.
        `stop_requested` (the pod's SIGTERM flag): end between looks with 143, as a stopped pod must."""
        unforeseen = 0
        while True:
            try:
                verdict = self.step()
                unforeseen = 0
            except TrainpodError:
                raise  # a decision with its own exit code (a bad config): not a look to try again
            except Exception:
                # A one-off surprise (a response of an unexpected shape, a network volume's stale file handle)
                # must not end supervision: once it ends, nothing brings the spot pod back. A bug that
                # recurs at every look still ends it (exit 1) after a few.
                unforeseen += 1
                if once or unforeseen >= UNFORESEEN_LOOKS_IN_A_ROW:
                    raise
                log.exception("look failed (%d/%d in a row); looking again in %g s", unforeseen,
                              UNFORESEEN_LOOKS_IN_A_ROW, self.policy.poll_s)  # fmt: skip
                verdict = None
            if verdict is not None:
                return verdict
            if once:
                return ExitCode.DONE
            waited = 0.0
            while waited < self.policy.poll_s:
                if stop_requested():
                    self._say("SIGTERM: supervising ends; this pod is being stopped")
                    return int(ExitCode.PREEMPTED)
                step = min(1.0, self.policy.poll_s - waited)
                self.sleep(step)
                waited += step

    def step(self) -> int | None:
        """One look and one decision; returns an exit code when supervising should end."""
        state = SupervisorState.load(self.state_file)
        try:
            return self._decide(state)
        except RunPodAuthError as exc:
            return self._end(ExitCode.BAD_INPUT, f"stopping: {exc}")
        except RunPodUnavailable as exc:
            return self._say(f"{exc}; looking again in {self.policy.poll_s:g} s")
        finally:
            # `trainpod stop` and `deploy` write stopped_unix from other processes, maybe during this look; the
            # supervisor never changes it, so the file's value stands, not the one read when the look began.
            state.stopped_unix = SupervisorState.load(self.state_file).stopped_unix
            state.save(self.state_file)

    def _decide(self, state: SupervisorState) -> int | None:
        now = self.clock()
        view = self._view()
        seen = self.unit.look(state, view.unfit_pod)
        deployed = view.deployed
        if deployed is not None and deployed.unix > (state.deployed_unix or 0.0):  # as a deploy since rented
            state.spot, state.secrets_as_values = deployed.spot, deployed.secrets_as_values
            state.deployed_unix = deployed.unix
        if seen.secrets_as_values is not None:
            state.secrets_as_values = seen.secrets_as_values
        if seen.spot is not None:
            state.spot = seen.spot
        self._account(state, seen.hourly_usd, now)
        self._count_restarts_since_progress(state, view)
        state.unreadable_looks = state.unreadable_looks + 1 if view.unreadable else 0
        spent = max(state.observed_cost_usd, view.cost_usd or 0.0)
        budget = self.config.budget.budget_usd
        noun = self.unit.noun
        if view.failed:
            self._stop("the run is FAILED")
            return self._end(ExitCode.BAD_INPUT, f"run FAILED ({view.failed}); not restarting: fix it, "
                             f"delete runs/{self.config.run}/{FAILED_MARKER} and deploy again")  # fmt: skip
        if view.done:
            verdict = self._at_done(view, state, seen)
            if verdict is not None:
                return verdict
        if view.stopped or state.stopped_unix is not None:
            return self._end(ExitCode.DONE, "the run was stopped with `trainpod stop`; not bringing it back "
                             "(`trainpod deploy` starts it again)")  # fmt: skip
        if budget is not None and spent >= budget:
            self._stop("the budget is spent")
            return self._end(ExitCode.BUDGET_EXHAUSTED, f"spent ${spent:.2f} of the ${budget:.2f} budget")
        if seen.up:
            state.failed_starts = 0
            return self._say(f"{seen.up} (spent ${spent:.2f}); nothing to do")
        if state.restarts >= self.policy.max_restarts:
            return self._end(ExitCode.BAD_INPUT, f"{state.restarts} restarts reached supervise.max_restarts; "
                             "look at the run's logs, then raise the bound or deploy again")  # fmt: skip
        if now < state.next_attempt_unix:
            return self._say(
                f"no {noun} running; next start attempt in {state.next_attempt_unix - now:.0f} s"
            )
        if view.unreadable and state.unreadable_looks <= UNREADABLE_LOOKS_BEFORE_BLIND:
            # The pod may have stopped itself at DONE: a restart on a guess pays for a boot that stops again.
            return self._say(f"no {noun} running, but the run's markers could not be read through S3; not "
                             f"starting it on a guess (look {state.unreadable_looks}/"
                             f"{UNREADABLE_LOOKS_BEFORE_BLIND}, then by the API alone)")  # fmt: skip
        return self._restart(state, seen, now, view)

    def _at_done(self, view: RunView, state: SupervisorState, seen: Look) -> int | None:
        """The verdict on a DONE run: the end, but with the deploy's `then` only once its conversion ended after the
        newest deploy (None: the pod is brought back below, for its boot to convert)."""
        then = self.config.then
        ended = view.then_ended(state.deployed_unix) if then is not None else None
        if then is not None and ended is not None and ended["outcome"] == "failed":
            self._stop(f"the run's {then.workload} after DONE failed")
            return self._end(ExitCode.BAD_INPUT, f"run is DONE, but its {then.workload} after DONE failed "
                             f"({ended.get('reason')}); not restarting: fix {then.config} and deploy again "
                             "(the run stays DONE: the pod converts, nothing more)")  # fmt: skip
        if then is not None and ended is None:
            if seen.converts_after_done is not False:
                return None
            # `then` added to the YAML after the deploy: the pod, started as deployed, stops at DONE every time.
            return self._end(ExitCode.BAD_INPUT, f"run is DONE, and its pod was deployed without `then` (no "
                             f"TRAINPOD_THEN_CONFIG): it would stop at DONE at every start; `trainpod deploy` again "
                             f"to convert with {then.config} in it, or remove `then`")  # fmt: skip
        if self.config.env.on_finish != "idle":
            self._stop("the run is DONE")
        return self._end(ExitCode.DONE, "run is DONE; supervising ends")

    def _count_restarts_since_progress(self, state: SupervisorState, view: RunView) -> None:
        """supervise.max_restarts bounds restarts that get the run nowhere (a DONE run this supervisor cannot
        see, a pod that dies before its first commit), not a long spot run's interruptions: a run whose
        status.json step moved past the step of the last restart starts the count anew. Blind to the volume,
        the count is never reset: the bound is then what ends a DONE run's restarts."""
        if view.step is None or state.step_at_restart is None or view.step <= state.step_at_restart:
            return
        if state.restarts:
            log.info(
                "the run went on from step %d to %d since the last restart: the restart count starts anew",
                state.step_at_restart,
                view.step,
            )
        state.restarts = 0
        state.step_at_restart = view.step

    def _restart(self, state: SupervisorState, seen: Look, now: float, view: RunView) -> int | None:
        noun = self.unit.noun
        if seen.unfit and state.replacements >= self.policy.max_replacements:
            # Never started again, as a replacement would not start it: left stopped, the next `trainpod deploy`
            # started it again, on the machine that cannot run the image (a stopped pod keeps its machine).
            for line in self.unit.delete("its machine cannot run the image and no replacement is left"):
                self._say(line)
            return self._end(ExitCode.MACHINE_UNFIT, f"{state.replacements} new {noun}s in a row landed on "
                             "machines that cannot run the image (exit 4); pick other GPU types, or the cu128 "
                             "image (image.cuda_version 12.8) for older drivers, and deploy again (the volume "
                             "keeps the run)")  # fmt: skip
        unseen = "" if view.visible else " (the volume is not mounted here: DONE is unknown)"
        if state.spot is not None:  # as the run was deployed, not as its YAML says (a pod made anew)
            self.config.pod.spot = state.spot
        try:
            action = self.unit.bring_back(seen.unfit, lambda: self._fresh_env(state))
        except RunPodAuthError:
            raise
        except RunPodNoCapacity as exc:
            # No machine free for any GPU type the config allows: spot's common shortage, which passes, and while
            # it lasts nothing runs or bills. Ending after max_failed_starts (minutes of backoff) left the run down
            # until the user came back; the supervisor waits it out instead, at the longest backoff once there.
            state.capacity_waits += 1
            wait = self._backoff(state.failed_starts + state.capacity_waits)
            state.next_attempt_unix = now + wait
            return self._say(
                f"{noun} {seen.down} and no machine free for it ({exc}); waiting for one, as long as it takes "
                f"(`trainpod stop {self.config.run}` ends it): next attempt in {wait:.0f} s"
            )
        except RunPodError as exc:
            state.failed_starts += 1
            wait = self._backoff(state.failed_starts + state.capacity_waits)
            state.next_attempt_unix = now + wait
            if state.failed_starts >= self.policy.max_failed_starts:
                # Exit 75 restarts the supervise pod's container at once (finish.py): the next round of
                # attempts starts from the first backoff, after the longest wait, never straight away.
                state.failed_starts = 0
                state.next_attempt_unix = now + self.policy.max_backoff_s
                return self._end(ExitCode.TEMPORARY, f"{self.policy.max_failed_starts} failed starts in a row, "
                                 f"the last: {exc}; try again later or add GPU types")  # fmt: skip
            return self._say(
                f"{noun} {seen.down} and no start possible ({exc}); next attempt in {wait:.0f} s"
            )
        state.restarts += 1
        # No status.json yet: any step recorded later is progress. Blind: unknown, the count never resets.
        state.step_at_restart = (-1 if view.step is None else view.step) if view.visible else None
        state.failed_starts = state.capacity_waits = 0
        state.next_attempt_unix = 0.0
        state.replacements = state.replacements + 1 if seen.unfit else 0
        if seen.unfit:
            self._clear_unfit_marker()
        left = f"the run not DONE{unseen}"
        if view.done and self.config.then is not None:
            left = f"the run DONE but not its {self.config.then.workload} after DONE"
        return self._say(
            f"{noun} {seen.down} and {left}: {action} (restart {state.restarts}/{self.policy.max_restarts})"
        )

    def _backoff(self, failures: int) -> float:
        """The wait after the `failures`-th failed start in a row: backoff_s doubling, at most max_backoff_s."""
        return min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** min(failures - 1, 32))

    def _fresh_env(self, state: SupervisorState) -> dict[str, str]:
        """The env of a pod (or cluster) made with none left to copy it from: the config's, with the secrets
        as the run's pods had them. Values come from this supervisor's environment, never from a file."""
        if not state.secrets_as_values:
            return pod_env(self.config)
        missing = [name for name in self.config.secrets if not os.environ.get(name)]
        if missing:
            raise ConfigError(
                [f"the run's pod is gone and a new one needs the secrets' values it was deployed with "
                 f"(deploy --secrets-from-env), but {', '.join(missing)} not set where this supervisor runs: "
                 "export them here and supervise again, or create RunPod secrets of those names and "
                 "`trainpod deploy` without --secrets-from-env"]
            )  # fmt: skip
        return pod_env(self.config, {name: os.environ[name] for name in self.config.secrets})

    def _view(self) -> RunView:
        if self.volume is not None or self.volume_s3 is None:
            return RunView.read(self.volume, self.config.run)
        try:
            return RunView.read_files(self.volume_s3, self.config.run)
        except TemporaryError as exc:  # RunPod's S3 API having trouble after retries: DONE is unknown
            log.warning("supervise %s: %s; this look goes by the API alone", self.config.run, exc)
            return RunView(visible=False, unreadable=str(exc))

    def _clear_unfit_marker(self) -> None:
        """The marker named the replaced pod; the new pod writes its own if its machine is unfit too."""
        if self.volume is None:
            if self.volume_s3 is not None:
                self.volume_s3.remove(f"runs/{self.config.run}/{UNFIT_MARKER}")
            return
        marker = self.volume.run(self.config.run).root / UNFIT_MARKER
        marker.unlink(missing_ok=True)
        atomic.fsync_dir(marker.parent)

    def _account(self, state: SupervisorState, hourly_usd: float, now: float) -> None:
        """Cost since the last look of what was billing at it (its pods' hourly prices). Not at today's
        price: after days without a look (a stopped run deployed again) a pod started a minute ago
        would be charged for all of them, and the supervisor would stop it as over budget."""
        if state.last_look_unix is not None:
            state.observed_cost_usd += state.last_hourly_usd * max(0.0, now - state.last_look_unix) / 3600
        state.last_look_unix, state.last_hourly_usd = now, hourly_usd

    def _stop(self, why: str) -> None:
        for line in self.unit.stop(why):
            self._say(line)

    def _say(self, decision: str) -> None:
        log.info("supervise %s: %s", self.config.run, decision)

    def _end(self, code: int, decision: str) -> int:
        self._say(decision)
        return int(code)


DEPLOY_CONFIGS = Path("configs/deploy")  # where deploy configs live in a checkout of the repository


def find_deploy_config(run: str, folder: Path = DEPLOY_CONFIGS) -> Path:
    """The one deploy config under `folder` whose `run:` is `run` (a scheduled job has no other way
    to know it); ConfigError when none or several name the run, so a guess never picks the wrong pod."""
    import yaml

    matches = []
    for path in sorted(folder.glob("*.y*ml")):
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue  # not a deploy config this search can read; naming it with --config reports why
        if isinstance(tree, dict) and tree.get("run") == run:
            matches.append(path)
    if len(matches) == 1:
        log.info("supervise %s: using %s, the deploy config whose run is %s", run, matches[0], run)
        return matches[0]
    found = f"{len(matches)} YAMLs under {folder}/ have run: {run} ({', '.join(map(str, matches))})"
    if not matches:
        found = f"no YAML under {folder.resolve()}/ has run: {run}"
    raise ConfigError(
        [f"supervise needs the run's deploy config and {found}; pass --config configs/deploy/X.yaml "
         "(or set TRAINPOD_CONFIG; in GitHub Actions the repository variable SUPERVISE_CONFIG)"]
    )  # fmt: skip


def supervise(
    config: DeployConfig,
    volume: Volume | None,
    once: bool = False,
    client: RunPodClient | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    stop_requested: Callable[[], bool] = lambda: False,
    volume_s3: VolumeS3 | None = None,
) -> int:
    """Build the supervisor for `config` (the volume when it is mounted here, else through `volume_s3`
    when given) and run it. A config `trainpod deploy` would refuse to make pods from is refused here too (exit 2):
    the first look that finds no pod makes one (the README's supervise line with the shipped YAML rented a GPU
    that pulled the placeholder image until stopped)."""
    problems = pod_problems(config)
    if problems:
        raise ConfigError(problems)
    client = client or RunPodClient.from_env()
    mounted = volume if volume is not None and volume.root.is_dir() else None
    volume_s3 = None if mounted else volume_s3
    supervisor = Supervisor(client, config, mounted, state_path(mounted, config.run), clock, sleep, volume_s3)
    where = (
        mounted.root if mounted else f"{volume_s3!r} (S3 API)" if volume_s3 else "not mounted here (API only)"
    )
    log.info("supervise %s: watching pods named %s; volume %s", config.run, config.pod_name, where)
    if mounted is None and volume_s3 is None:
        _warn_blind(config, volume)
    return supervisor.run(once, stop_requested)


def _warn_blind(config: DeployConfig, volume: Volume | None) -> None:
    """Said once at start: RunPod's API has no exit code for a pod (v1 and v2 alike; lastStatusChange is
    free text), so without the volume a pod that stopped itself at DONE or FAILED looks interrupted."""
    keys = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    unset = not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))
    log.warning(
        "supervise %s: the run's volume is not mounted here (%s) and its S3 API is not used (%s), so DONE, "
        "FAILED, STOPPED and the run's recorded cost are invisible: a finished or failed run's pod is started "
        "again at each look, up to supervise.max_restarts (%d). Export RunPod's S3 API key as %s (console, "
        "Settings, S3 API Keys; in GitHub the secrets RUNPOD_S3_ACCESS_KEY_ID and RUNPOD_S3_SECRET_ACCESS_KEY), "
        "or run the supervise workload in a CPU pod on the same volume",
        config.run,
        volume.root if volume is not None else "no volume given",
        f"{keys} are not both set"
        if unset
        else f"the volume's data center {config.volume.data_center} or "
        "the deploy config gave no S3 endpoint; see the warning above",
        config.supervise.max_restarts,
        keys,
    )
