"""What `trainpod deploy` checks before it rents anything: config, image, secrets, cost, stock.

    trainpod deploy configs/deploy/finetune-spot.yaml --dry-run    # the checks, then "would create ..."

- the workload config the deploy config names is loaded and validated when this repo holds it, and a
  convert config's hub task finds HF_TOKEN among the secrets;
- a cluster (nodes > 1) runs a workload that trains across nodes (one rank per GPU);
- the image is not the shipped placeholder (ghcr.io/YOUR_ORG/...), which no registry serves (this and
  the secrets' check below are runpod.deploy.pod_problems, which a supervisor checks too);
- a cluster's budget comes with one node's price, which node 0 counts the cost with (a single pod reads
  its own price from RunPod at boot);
- secrets reach the pod as {{ RUNPOD_SECRET_<name> }} references, and env.extra holds no value that
  looks like a secret (by its name, or a URL with credentials);
- the estimate (trainpod.estimate) is printed and, over the budget, refused unless --force;
- live stock of the chosen GPU types on the allowed CUDA versions (RunPod's v2 catalog) is shown,
  with a warning when none has a free machine.
It sits above runpod/, estimate and workloads/ (it reads all three; runpod/ must not import workloads/).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainpod.config.deploy import DeployConfig
from trainpod.config.loader import DEPLOY_ENV_SET, OverrideRoute
from trainpod.errors import ConfigError, InputError, TrainpodError
from trainpod.runpod.deploy import pod_problems


class OverBudget(InputError):
    """The estimate exceeds the budget: nothing is rented (exit 2); --force deploys anyway."""


def config_problems(config: DeployConfig, deploy_path: str, secrets_from_env: bool) -> list[str]:
    """Everything wrong with the deploy config that RunPod would not catch before billing."""
    problems = pod_problems(config)
    no_price = config.budget.budget_usd is not None and config.budget.hourly_usd is None
    if no_price and config.nodes > 1 and _counts_cost(config):  # a single pod reads its price from RunPod
        problems.append(
            f"budget.budget_usd={config.budget.budget_usd} without budget.hourly_usd on a cluster of "
            f"{config.nodes} nodes: node 0 counts the cluster's cost as hours x budget.hourly_usd x nodes and "
            "would never stop at the budget; set budget.hourly_usd to one node's price per hour, e.g. the "
            "price RunPod's console shows for the GPU"
        )
    problems += cluster_workload_problems(config)
    problems += workload_config_problems(config, deploy_path)
    problems += then_problems(config, deploy_path)
    return problems


def _counts_cost(config: DeployConfig) -> bool:
    """Whether the pod's workload counts its cost against TRAINPOD_BUDGET_USD (training, your own program)."""
    from trainpod import workloads

    workload = workloads.REGISTRY.get(config.workload)
    return workload is None or workload.kind.owns_run_folder


def cluster_workload_problems(config: DeployConfig) -> list[str]:
    """A cluster's nodes run one torchrun: only workloads with a rank per GPU can share it."""
    from trainpod import workloads

    workload = workloads.REGISTRY.get(config.workload)
    if config.nodes == 1 or workload is None or workload.kind.rank_per_gpu:
        return []
    training = ", ".join(name for name, w in workloads.REGISTRY.items() if w.kind.rank_per_gpu)
    return [
        f"nodes={config.nodes} with workload={config.workload!r}: every node would run it on its own; "
        f"only {training} train across nodes: set nodes: 1, or one of those workloads"
    ]


def workload_config_problems(config: DeployConfig, deploy_path: str) -> list[str]:
    """The workload config's own problems, when this repo holds the file the pod will read."""
    from trainpod.config import parse_overrides

    overrides = parse_overrides(config.env.set)
    return _config_file_problems(
        config, "config", config.config, config.workload, deploy_path, overrides, DEPLOY_ENV_SET
    )


def then_problems(config: DeployConfig, deploy_path: str) -> list[str]:
    """`then`: a conversion workload after one that ends DONE, and its config's problems (when this repo holds
    it), checked as the pod's boot checks TRAINPOD_THEN_CONFIG before any training (exit 2 there, after the rent)."""
    from trainpod import workloads

    if config.then is None:
        return []
    conversions = workloads.conversions()
    first = workloads.REGISTRY.get(config.workload)
    problems = []
    if first is not None and not first.kind.owns_run_folder:
        problems.append(f"then with workload={config.workload!r}: a conversion follows a run that ends DONE (a "
                        "training or command workload); remove `then`, or deploy the conversion as the workload")  # fmt: skip
    if config.then.workload not in conversions:
        return [*problems, f"then.workload={config.then.workload!r} is no conversion workload; set it to one of: "
                f"{', '.join(conversions)}"]  # fmt: skip
    # No env.set: its overrides are the first workload's config's (the pod leaves TRAINPOD_SET out of `then`).
    return problems + _config_file_problems(
        config, "then.config", config.then.config, config.then.workload, deploy_path, [], None
    )


def _config_file_problems(
    config: DeployConfig,
    field: str,
    config_path: str,
    workload: str,
    deploy_path: str,
    overrides: list[str],
    route: OverrideRoute | None,
) -> list[str]:
    """The problems of the config file `config_path` (the deploy config's `field`: config, then.config), as
    `workload` reads it with `overrides`; a fix that overrides a field names `route`."""
    from trainpod import workloads
    from trainpod.estimate import find_workload_config
    from trainpod.workloads.lifecycle import load_workload_config

    path = find_workload_config(config_path, Path(deploy_path))
    if path is None:
        return []  # it may come from env.git_repo or the volume: the pod's boot checks it (exit 2)
    try:
        workload_config = load_workload_config(workloads.get(workload), path, overrides, route)
    except ConfigError as exc:
        return [f"{field}={config_path!r} ({path}): {problem}" for problem in exc.problems]
    except TrainpodError as exc:
        return [f"{field}={config_path!r} ({path}): {exc}"]
    return hub_token_problems(config, workload_config, f"{field}={config_path!r}")


def hub_token_problems(config: DeployConfig, workload_config: Any, named: str | None = None) -> list[str]:
    """A convert config's hub task pushes with HF_TOKEN: a deploy that does not give the pod one rented a pod
    whose preflight could only refuse it (exit 2) after the boot and the image pull."""
    from trainpod.config.convert import HubTask

    pushes = [task for task in getattr(workload_config, "task", []) if isinstance(task, HubTask)]
    # env.extra may name it too, as a reference to a RunPod secret of another name (runpod.deploy.pod_problems)
    if not pushes or "HF_TOKEN" in config.secrets or "HF_TOKEN" in config.env.extra:
        return []
    return [
        f"{named or f'config={config.config!r}'} pushes to the Hugging Face Hub ({pushes[0].repo_id}) with HF_TOKEN, "
        "which this "
        "deploy does not give the pod: add HF_TOKEN to `secrets` (a RunPod secret of that name holding a token "
        "with write access)"
    ]


def secrets_line(config: DeployConfig, secrets_from_env: bool) -> str:
    if not config.secrets:
        return "secrets    none"
    how = "values from this shell (--secrets-from-env)" if secrets_from_env else "RunPod secret references"
    return f"secrets    {', '.join(config.secrets)} as {how}"


def estimate_lines(config: DeployConfig, deploy_path: str, catalog: list, force: bool) -> list[str]:
    """The run's estimate as lines; OverBudget when it exceeds the budget and not `force`."""
    from trainpod import estimate as estimating

    try:
        workload_config, _ = estimating.load_target(deploy_path, route=DEPLOY_ENV_SET)
        est = estimating.estimate(workload_config, config, catalog=catalog, route=DEPLOY_ENV_SET)
    except TrainpodError as exc:
        return [f"estimate   not made: {exc}"]
    lines = estimating.report(est)
    if est.over_budget and not force:
        raise OverBudget(
            f"the estimate (${est.dollars:,.2f}) exceeds the budget (${est.budget_usd:,.2f}, "
            "TRAINPOD_BUDGET_USD "
            "or budget.budget_usd): raise the budget, shorten the run, or deploy with --force\n"
            + "\n".join(lines)
        )
    return lines


def unknown_gpu_types(config: DeployConfig, catalog: list[Any]) -> list[str]:
    """GPU type ids RunPod's catalog does not list (a typo: RunPod refuses the pod with a 400, after the
    template and the volume were made). The catalog lists every type whatever its stock; [] when unread."""
    if not catalog or config.image.flavour != "cuda":
        return []
    known = [offer.id for offer in catalog]
    problems = []
    for gpu in config.pod.gpu_types:
        if gpu not in known:
            near = difflib.get_close_matches(gpu, known, n=3, cutoff=0.5)
            problems.append(
                f"pod.gpu_types has {gpu!r}, which RunPod's GPU catalog does not list; "
                + (f"did you mean {', '.join(repr(n) for n in near)}? " if near else "")
                + "spell it as RunPod's GPU catalog does (GET /v2/catalog/gpus, the console's Deploy page)"
            )
    return problems


def stock_lines(config: DeployConfig, catalog: list[Any], cuda_versions: list[str]) -> tuple[list[str], bool]:
    """Per chosen GPU type: stock overall and in the volume's data center, the free CUDA versions;
    and whether any type has a free machine."""
    if config.image.flavour != "cuda":
        return [], True
    by_id = {offer.id: offer for offer in catalog}
    lines, free = [], False
    data_center = config.volume.data_center
    for gpu in config.pod.gpu_types:
        offer = by_id.get(gpu)
        if offer is None:
            lines.append(f"stock      {gpu}: not in RunPod's catalog (check the GPU type id)")
            continue
        cuda = [v for v in cuda_versions if offer.cuda_versions.get(v)]
        here = offer.data_centers.get(data_center, "NONE")
        free = free or (bool(cuda) and here != "NONE")
        lines.append(
            f"stock      {gpu}: {offer.availability or '?'} overall, {here} in {data_center}; CUDA "
            + (", ".join(cuda) + " free" if cuda else f"{', '.join(cuda_versions)}: none free")
        )
    return lines, free


def no_stock_warning(config: DeployConfig, cuda_versions: list[str]) -> str:
    return (
        f"no machine is free now for {', '.join(config.pod.gpu_types)} with CUDA "
        f"{', '.join(cuda_versions)} in {config.volume.data_center}: the pod may not start; add GPU types, "
        "lower image.cuda_version (a cu128 "
        "image reaches more hosts) or wait"
    )


def run_checks(
    config: DeployConfig,
    deploy_path: str,
    secrets_from_env: bool,
    catalog: list,
    force: bool,
    echo: Callable[[str], None] = print,
) -> None:
    """Print the checks' results; raise ConfigError (all problems at once) or OverBudget."""
    problems = config_problems(config, deploy_path, secrets_from_env) + unknown_gpu_types(config, catalog)
    if problems:
        raise ConfigError(problems)
    echo(secrets_line(config, secrets_from_env))
    if config.then is not None:
        echo(f"then       {config.then.workload} with {config.then.config} once the run is DONE, in the same pod, "
             "before it stops (runs/<run>/then.json records its end)")  # fmt: skip
    for line in estimate_lines(config, deploy_path, catalog, force):
        echo(line)
