"""`make gpu-check` (bench/gpu_check.py) keeps working between GPU runs: its --dry mode runs every part on
CPU with tiny sizes (no GPU here: the GPU figures themselves come from a lent GPU machine), and the report
shows each target row, never a number for a part that failed. The dry run sees only the packages a bare GPU
machine has plus the wheels `make gpu-wheels` carries there (tests/gpu_machine.py): any other installed
package is missing to it, as it would be on that machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
from gpu_check import PARTS, TARGETS, gpu_test_files, unit_name, units  # noqa: E402
from gpu_machine import GPU_MACHINE_PACKAGES, block_imports_beyond  # noqa: E402
from gpu_report import section, write_report  # noqa: E402
from gpu_wheels import PACKAGES as GPU_WHEELS  # noqa: E402
from gpu_wheels import pins  # noqa: E402

from trainpod.train.reporting import peak_flops_of  # noqa: E402

TARGET_ROWS = (
    "125m MFU",
    "1b MFU",
    "QLoRA tokens/s vs Trainer + peft",
    "32B-shaped QLoRA r64 peak, extrapolated",
    "preflight memory estimate vs measured peak",
    "throughput with commits every 5 min vs none",
)


@pytest.fixture(scope="module")
def dry_results(tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("gpu-check")
    benchmarks = results / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\n## Datagen\n\nkept\n\n## GPU\n\nold placeholder\n")
    blocker = tmp_path_factory.mktemp("gpu-machine")
    blocked = block_imports_beyond(GPU_MACHINE_PACKAGES, set(GPU_WHEELS) | {"trainpod"}, blocker)
    assert "jsonschema" in blocked and "bitsandbytes" not in blocked  # the rehearsal hides what it should
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(blocker), str(REPO / "src")])}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu_check.py"),
            "--dry",
            "--results",
            str(results),
            "--benchmarks",
            str(benchmarks),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return results


def test_dry_mode_runs_every_part_records_its_result_and_reports_it(dry_results):
    """One test of the one dry run (minutes of CPU): under xdist, a second test of the same module fixture
    made a worker of its own run it all again."""
    for part, preset in units(list(PARTS), dry=True):
        name = unit_name(part, preset)
        outcome = json.loads((dry_results / f"{name}.json").read_text())
        assert outcome["ok"] and outcome["dry"], f"{name}: {outcome.get('error')} (see {name}.log)"
        assert (dry_results / f"{name}.log").exists()
    env = json.loads((dry_results / "env.json").read_text())
    # The machine's versions of what the units import, each one the GPU run may be the first to see.
    assert all(env["packages"][name] for name in ("peft", "huggingface-hub", "typing-extensions", "pyarrow"))
    pretrain = json.loads((dry_results / "pretrain-125m.json").read_text())
    assert pretrain["tokens_per_s"] > 0 and len(pretrain["steady_step_s"]) == 3 and pretrain["mfu"] is None
    assert pretrain["estimate_bytes"] > 0 and pretrain["peak_allocated_bytes"] is None  # no GPU: no peak
    profile = pretrain["profile"]  # where a missed MFU target's time goes, measured in the same unit
    assert "error" not in profile, profile
    assert sum(profile["share_by_category"].values()) == pytest.approx(1.0)
    assert profile["share_by_category"]["matmul"] > 0 and profile["top"][0]["s_per_step"] > 0
    packing = json.loads((dry_results / "packing.json").read_text())
    assert {key.split(", ")[1] for key in packing["moved"]} == {"sdpa", "eager"}
    assert all(moved < packing["limit"] / 10 for moved in packing["moved"].values()), packing["moved"]
    checkpoint = json.loads((dry_results / "checkpoint-125m.json").read_text())
    assert checkpoint["runs"]["every_k"]["commits"] == checkpoint["runs"]["none"]["commits"] + 2
    assert checkpoint["mode"] == "sync"  # what checkpoint.mode=auto is on CPU; the report said "auto"
    big = json.loads((dry_results / "qlora-32b.json").read_text())
    # Step times on a shared CPU are noise (the 2-layer step can be the faster one), so this checks the
    # extrapolation's arithmetic, never the sign of a timed figure.
    assert set(big["measured"]) == {"1", "2"}
    one, two = (big["measured"][layers]["step_s"] for layers in ("1", "2"))
    assert one > 0 and two > 0
    assert big["extrapolated_step_s"] == pytest.approx(one + (two - one) * (big["target_layers"] - 1))
    speed = json.loads((dry_results / "qlora-speed.json").read_text())
    assert speed["packed"]["ours"] > 0 and speed["padded"]["baseline"] > 0
    vlm = json.loads((dry_results / "vlm-generation.json").read_text())
    assert vlm["measured"]["step_s"] > 0 and vlm["measured"]["forced_tokens"] == 8
    assert vlm["scaled"]["generation_evals"] >= 1 and vlm["scaled"]["forced_share"] > 0

    # The report replaces only the GPU section of BENCHMARKS.md and shows every target's row.
    text = (dry_results / "BENCHMARKS.md").read_text()
    assert "## Datagen\n\nkept" in text and "old placeholder" not in text
    gpu = text[text.index("## GPU") :]
    assert "dry run on CPU" in gpu
    for row in TARGET_ROWS:
        assert row in gpu, f"the GPU section lacks the {row!r} row"
    assert "VLM generation eval at configs/finetune/qwen3-vl-2b-qlora-ocr.yaml's settings" in gpu
    assert "  - profile of 2 steps (CPU operators (self time)): busy" in gpu
    assert "- packed rows per attention, torch.float32 (" in gpu and "dry, sdpa, 32+32 0.000" in gpu


def test_the_gpu_tests_part_names_every_file_with_gpu_tests():
    """The part hands pytest the files that hold `gpu` tests (the others need packages the GPU machine lacks);
    a GPU test in a file it missed would never run on a GPU."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert collected.returncode == 0, collected.stdout[-3000:]
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert files and files == set(gpu_test_files())


def names(tests: dict[str, list[str]]) -> dict[str, list[str]]:
    """The test names of a gpu-tests result's node ids, by outcome."""
    return {outcome: [node.split("::")[-1] for node in nodes] for outcome, nodes in tests.items()}


def test_gpu_tests_cut_off_by_the_units_limit_keep_the_results_of_the_tests_that_ran(tmp_path, monkeypatch):
    """On an H100 the GPU tests take 7 to 8 minutes, near a unit's 540 s and over a short call's deadline:
    killed by run_units, the unit recorded a timeout and not one test's outcome (the paid run proved
    nothing). pytest now ends inside the unit's limit, the result names what passed, and --resume runs
    the rest."""
    tests, marker = tmp_path / "test_slow_gpu.py", "gpu"  # spelled apart: gpu_test_files greps this file
    tests.write_text(
        f"import os\nimport time\nimport pytest\n\n\n@pytest.mark.{marker}\ndef test_quick():\n    pass\n\n\n"
        f"@pytest.mark.{marker}\ndef test_slow():\n    time.sleep(float(os.environ['SLEEP_S']))\n"
    )
    monkeypatch.setattr(gpu_check, "gpu_test_files", lambda: [tests.name])
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)  # pytest's folder: node ids as the GPU tests' own
    monkeypatch.setenv(gpu_check.UNIT_LIMIT_ENV, str(gpu_check.PYTEST_END_MARGIN_S + 20))
    monkeypatch.setenv("SLEEP_S", "600")
    volume = tmp_path / "results" / "work" / "gpu-tests"
    volume.mkdir(parents=True)  # as run_unit makes it
    started = time.monotonic()
    outcome = gpu_check._gpu_tests_part(volume, None, dry=False)
    assert time.monotonic() - started < 40  # ended inside the unit's limit, not by run_units' kill
    assert not outcome["ok"] and outcome["exit_code"] == "cut off"
    assert names(outcome["tests"]) == {"passed": ["test_quick"]}
    assert "1 passed; the rest not run" in outcome["summary"]
    assert gpu_check.done_units(volume.parents[1], dry=False) == set()  # what it keeps there reads back

    monkeypatch.setenv("SLEEP_S", "0")
    monkeypatch.setenv(gpu_check.RESUME_ENV, "1")
    resumed = gpu_check._gpu_tests_part(volume, None, dry=False)
    assert "error" not in resumed and resumed["exit_code"] == 0, resumed
    assert names(resumed["tests"]) == {"passed": ["test_slow"]}  # test_quick is not run again
    assert resumed["summary"].endswith("; 1 passed in an earlier call")


def test_profiled_kernels_are_put_in_the_category_their_names_give():
    from gpu_pretrain import kernel_category

    assert kernel_category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>") == "attention"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kernel_category("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_TNT") == "matmul"
    assert kernel_category("triton_tem_fused_mm_3") == "matmul"
    fused_adam = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"
    assert kernel_category(fused_adam) == "optimizer"
    assert kernel_category("triton_red_fused__log_softmax_nll_loss_forward_7") == "loss"
    assert kernel_category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_2") == "other"


def test_a_profile_that_recorded_no_device_kernel_is_an_error_not_an_idle_gpu(monkeypatch):
    """Where the profiler records no CUDA kernel (CUPTI missing or refused in a container), every step
    added up to 0 s of device time: the report said the GPU was busy 0% of the step, a host-bound run,
    the wrong reading of the MFU the profile is there to explain."""
    import gpu_pretrain
    import torch

    class Step:
        loss = torch.zeros(())

    class Trainer:
        def train_step(self, model, step):
            torch.ones(64, 64) @ torch.ones(64, 64)  # CPU work only: no device kernel to record
            return Step()

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as real_profile

    # A GPU machine whose profiler records the CPU side alone (this CPU torch has no CUDA to record).
    monkeypatch.setattr(
        torch.profiler, "profile", lambda activities: real_profile(activities=[ProfilerActivity.CPU])
    )
    monkeypatch.setattr(gpu_pretrain.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_pretrain, "_sync", lambda: None)
    profile = gpu_pretrain.profile_steps(Trainer(), torch.nn.Identity(), 1, 2)
    assert "no device kernel" in profile.get("error", ""), profile


def test_the_report_leaves_every_other_section_of_benchmarks_md_as_it_was(tmp_path):
    benchmarks = tmp_path / "BENCHMARKS.md"
    before, after = "# Benchmarks\n\nintro\n\n## Datagen\n\nkept\n\n", "\n## VLM\n\nafter\n"
    benchmarks.write_text(before + "## GPU\n\nold placeholder\n" + after)
    (tmp_path / "env.json").write_text(json.dumps({"ok": True, "gpu": "NVIDIA H100 80GB HBM3", "dry": False}))
    write_report(tmp_path, benchmarks, TARGETS, units(list(PARTS), dry=False))
    text = benchmarks.read_text()
    assert text.startswith(before + "## GPU\n") and text.endswith(after) and "old placeholder" not in text


def test_the_notes_beside_the_results_go_under_the_figures(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"ok": True, "gpu": "NVIDIA H100 80GB HBM3", "dry": False}))
    (tmp_path / "notes.md").write_text("Two calls; the device time ran out before the VLM part.\n")
    text = section(tmp_path, TARGETS, units(list(PARTS), dry=False))
    assert text.index("| measure |") < text.index("Two calls; the device time ran out before the VLM part.")


def test_a_failed_or_missing_unit_is_reported_as_such_never_as_a_number(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"ok": True, "gpu": "NVIDIA H100 80GB HBM3", "dry": False}))
    (tmp_path / "pretrain-125m.json").write_text(json.dumps({"ok": False, "error": "CUDA out of memory"}))
    text = write_report(tmp_path, None, TARGETS, units(list(PARTS), dry=False))
    assert "| 125m MFU, compile on, steady state | failed (CUDA out of memory) |" in text
    assert "| 1b MFU, compile on, steady state | not run |" in text
    assert "pass" not in section(tmp_path, TARGETS, units(list(PARTS), dry=False))


def test_gpu_tests_that_failed_or_did_not_run_are_in_the_report_with_the_failed_tests_named(tmp_path):
    """The `pytest -m gpu` line was written for a unit that succeeded alone: one with a failed test (or cut
    off by its limit, or not run) left no line at all, so the report said nothing of the GPU tests."""
    (tmp_path / "env.json").write_text(json.dumps({"ok": True, "gpu": "NVIDIA H200", "dry": False}))
    text = section(tmp_path, TARGETS, units(list(PARTS), dry=False))
    assert "- `pytest -m gpu`: not run" in text
    failed = "tests/test_gpu_checkpoint.py::test_async_commit_resumes_exactly"
    result = {
        "ok": False,
        "error": "pytest exit 1: 1 failed, 14 passed in 431.20s (0:07:11)",
        "tests": {"passed": ["tests/test_gpu.py::test_a"], "failed": [failed]},
        "exit_code": 1,
        "summary": "1 failed, 14 passed in 431.20s (0:07:11)",
    }
    (tmp_path / "gpu-tests.json").write_text(json.dumps(result))
    text = section(tmp_path, TARGETS, units(list(PARTS), dry=False))
    assert (
        "- `pytest -m gpu`: failed (pytest exit 1: 1 failed, 14 passed in 431.20s (0:07:11)); failed: "
        + failed
        in text
    )


def test_the_pretrain_units_memory_fills_its_presets_memory_row_where_no_memory_unit_ran(tmp_path):
    """The pretrain part measures the 125m and 1b presets' peak in its own steps (a memory unit of their own
    cost a second compile each, two minutes of a lent GPU's fifteen); a memory unit that ran still decides."""
    gb = 10**9
    (tmp_path / "env.json").write_text(json.dumps({"ok": True, "gpu": "NVIDIA H100 80GB HBM3", "dry": False}))
    for name, estimate, peak in (("pretrain-125m", 31, 30), ("memory-125m", 40, 30), ("pretrain-1b", 46, 40)):
        figures = {"estimate_bytes": estimate * gb, "peak_allocated_bytes": peak * gb}
        (tmp_path / f"{name}.json").write_text(json.dumps({"ok": True, **figures}))
    text = section(tmp_path, TARGETS, units(list(PARTS), dry=False))
    assert (
        "| 125m: preflight memory estimate vs measured peak | estimate 40.0 GB vs peak 30.0 GB (33% off) |"
        in text
    )
    assert (
        "| 1b: preflight memory estimate vs measured peak | estimate 46.0 GB vs peak 40.0 GB (15% off) |"
        in text
    )
    assert "| 2b: preflight memory estimate vs measured peak | not run |" in text
    assert "| 4b: preflight memory estimate vs measured peak | not run |" in text


def test_a_named_preset_replaces_the_list_of_each_part_with_presets():
    assert units(["memory", "env"], dry=False) == [("memory", "2b"), ("memory", "4b"), ("env", None)]
    assert units(["memory", "env"], dry=False, presets=["125m"]) == [("memory", "125m"), ("env", None)]


def test_the_gpu_wheels_carry_the_peft_the_tests_ran_since_the_machines_own_is_of_unknown_version():
    # Every LoRA/QLoRA finetune imports peft.utils.error, new in peft 0.21: under the machine's own peft,
    # if older, each finetune part of the check would fail at its first step (ModuleNotFoundError).
    from importlib.metadata import version

    assert f"peft=={version('peft')}" in pins()


def test_the_gpu_wheels_carry_the_typing_extensions_the_carried_pydantic_needs():
    # pydantic (carried) imports typing_extensions.Sentinel, new in 4.14, and declares >=4.16; the machine's
    # typing-extensions is of a version nobody has read (torch there needs only 4.10), and under an older
    # one every trainpod import failed: `from typing_extensions import Sentinel` (ImportError).
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    carried = {name.lower() for name in GPU_WHEELS}
    needs = {Requirement(line).name.lower() for line in requires("pydantic") + requires("pydantic-core")}
    assert "typing-extensions" in needs and "typing-extensions" in carried


def test_mfu_uses_the_peak_of_the_exact_h100_variant():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("Some Unknown GPU") is None


def test_an_h200_nvl_is_not_taken_for_the_sxm_h200():
    # "NVIDIA H200 NVL" (a RunPod GPU type) contains "H200": its MFU was computed against the SXM part's
    # 989 TFLOP/s, 18% above its own, so a run on one read 16% low against the 45%/50% targets.
    assert peak_flops_of("NVIDIA H200 NVL") == 835e12
    assert peak_flops_of("NVIDIA H200") == 989e12


def test_an_rtx_a4000_is_not_taken_for_an_a40():
    # "NVIDIA RTX A4000" contains "A40": its MFU and `trainpod estimate`'s hours used the A40's peak, twice
    # its own (configs/deploy/nanogpt-command.yaml asks for one first).
    assert peak_flops_of("NVIDIA RTX A4000") == 76.7e12
    assert peak_flops_of("NVIDIA A40") == 150e12


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(REPO / "bench/gpu_check.py"), "--dry", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_resume_skips_the_units_done_and_a_deadline_ends_the_rest(tmp_path):
    """A lent GPU machine takes commands of 10 minutes at most: the check is run again with --resume and a
    deadline until every unit is done, each call's results kept. No unit starts after the deadline and one
    still running then is ended with its whole process group, its result a failure that --resume redoes."""
    results, report = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    common = ("--results", str(results), "--benchmarks", str(report))
    first = _gpu_check("--part", "env", *common)
    assert first.returncode == 0 and "gpu-check: env ok" in first.stdout, first.stdout + first.stderr
    again = _gpu_check("--resume", "--part", "env", *common)
    assert again.returncode == 0 and "gpu-check: env" not in again.stdout

    late = _gpu_check("--resume", "--deadline-s", "1", "--part", "env", "--part", "pretrain", *common)
    assert late.returncode == 1, late.stdout + late.stderr
    outcome = json.loads((results / "pretrain-125m.json").read_text())
    assert not outcome["ok"] and re.fullmatch(r"timeout after [01] s \(the deadline\)", outcome["error"])
    assert not (results / "work" / "pretrain-125m").exists()  # its scratch volume went with it
    assert json.loads((results / "env.json").read_text())["ok"]  # what was done stays done

    past = _gpu_check("--deadline-s", "0.000001", "--part", "env", *common)
    assert past.returncode == 1 and "gpu-check: env not started: the deadline has passed" in past.stdout


def test_a_unit_that_cannot_finish_before_the_deadline_is_not_started_and_the_next_that_can_runs(tmp_path):
    """Near a call's deadline a unit that needs more time than is left was started and cut off, and with it the
    rest of a lent machine's minutes: the units after it that fit run instead. A unit cut off by one call's
    deadline needs more than it had there, so a later call starts it only with more time."""
    results = tmp_path / "results"
    results.mkdir()
    todo = [("pretrain", "125m"), ("env", None)]
    deadline = time.monotonic() + 300
    failures = gpu_check.run_units(
        todo, results, dry=True, deadline=deadline, shortest={"pretrain-125m": 400}
    )
    assert failures == 1
    assert not (results / "pretrain-125m.json").exists()  # not started: no result, not even a failed one
    assert json.loads((results / "env.json").read_text())["ok"]

    (results / "env.json").write_text(
        json.dumps({"unit": "env", "ok": False, "error": "timeout", "cut_at_s": 250})
    )
    assert (
        gpu_check.run_units([("env", None)], results, dry=True, deadline=time.monotonic() + 200, shortest={})
        == 1
    )
    assert "cut_at_s" in json.loads((results / "env.json").read_text()), "started with less than it had"
    assert (
        gpu_check.run_units([("env", None)], results, dry=True, deadline=time.monotonic() + 300, shortest={})
        == 0
    )
