"""The GPU section of BENCHMARKS.md, written from the results `bench/gpu_check.py` leaves in its folder.

Each target row says what was measured, on which GPU, and pass or FAIL; a unit that did not run or
failed shows as such, never as a number. The same section goes to <results>/report.md beside the raw
results, and into the GPU section of BENCHMARKS.md when a target file is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GB = 1e9
# Written by hand beside a run's results (the calls made, what did not run and why, what the code changed
# since); the report carries it under the figures, so a rewrite of the section keeps it.
NOTES_FILE = "notes.md"


def _load(results: Path, name: str) -> dict[str, Any] | None:
    try:
        data = json.loads((results / f"{name}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if data.get("ok") else {"error": data.get("error", "failed")}


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


def _missing(unit: dict[str, Any] | None) -> str | None:
    if unit is None:
        return "not run"
    if "error" in unit:
        return f"failed ({unit['error'][:80]})"
    return None


def target_rows(results: Path, targets: dict[str, float], memory_presets: list[str], dry: bool) -> list[str]:
    """One row per target; a dry run's figures come from a tiny model on a CPU, so it judges none."""
    rows = ["| measure | measured | target | result |", "| --- | --- | --- | --- |"]

    def row(measure: str, unit: dict[str, Any] | None, value: Any, target: str, ok: bool | None) -> None:
        shown = _missing(unit) or value
        rows.append(f"| {measure} | {shown} | {target} | {_verdict(None if _missing(unit) or dry else ok)} |")

    for preset, key in (("125m", "mfu_125m"), ("1b", "mfu_1b")):
        unit = _load(results, f"pretrain-{preset}")
        mfu = (unit or {}).get("mfu")
        shown = (
            f"{mfu:.1%} ({unit['tokens_per_s']:,.0f} tokens/s)"
            if mfu
            else "no peak FLOPs known for this device"
        )
        row(
            f"{preset} MFU, compile on, steady state",
            unit,
            shown,
            f">= {targets[key]:.0%}",
            mfu and mfu >= targets[key],
        )
    speed = _load(results, "qlora-speed")
    if speed and "packed" in speed:
        ratio = speed["packed"]["ratio"]
        shown = f"{ratio:.2f}x packed (padded {speed['padded']['ratio']:.2f}x; median pair {speed['median_pair_ratio']:.2f}x)"
    else:
        ratio, shown = None, ""
    row(
        "QLoRA tokens/s vs Trainer + peft (0.5B-shaped)",
        speed,
        shown,
        f">= {targets['qlora_vs_trainer']}x",
        ratio and ratio >= targets["qlora_vs_trainer"],
    )
    big = _load(results, "qlora-32b")
    peak = (big or {}).get("extrapolated_peak_allocated_bytes")
    shown = f"{peak / GB:.1f} GB at 64 layers" if peak else "no GPU memory measured"
    row(
        "32B-shaped QLoRA r64 peak, extrapolated",
        big,
        shown,
        f"<= {targets['qlora_32b_peak_gb']:.0f} GB",
        peak and peak / GB <= targets["qlora_32b_peak_gb"],
    )
    for preset in memory_presets:
        unit = _memory_unit(results, preset)
        measured, estimate = (unit or {}).get("peak_allocated_bytes"), (unit or {}).get("estimate_bytes")
        if measured and estimate:
            error = abs(estimate - measured) / measured
            shown, ok = (
                f"estimate {estimate / GB:.1f} GB vs peak {measured / GB:.1f} GB ({error:.0%} off)",
                error <= targets["estimate_error"],
            )
        else:
            shown, ok = (
                f"peak {measured / GB:.1f} GB, estimate {'none' if not estimate else f'{estimate / GB:.1f} GB'}"
                if measured
                else "no GPU memory measured",
                None,
            )
        row(
            f"{preset}: preflight memory estimate vs measured peak",
            unit,
            shown,
            f"within {targets['estimate_error']:.0%}",
            ok,
        )
    ckpt = _load(results, "checkpoint-125m")
    ratio = (ckpt or {}).get("throughput_ratio_5min")
    shown = (
        f"{ratio:.4f}x ({ckpt['stall_per_commit_s']:.2f} s stall per commit, mode {ckpt['mode']})"
        if ratio
        else ""
    )
    row(
        "throughput with commits every 5 min vs none (125m)",
        ckpt,
        shown,
        f">= {targets['async_5min']}x",
        ratio and ratio >= targets["async_5min"],
    )
    return rows


def _memory_unit(results: Path, preset: str) -> dict[str, Any] | None:
    """memory-<preset> where that unit ran, else pretrain-<preset>, which measures the same steps' peak."""
    if (results / f"memory-{preset}.json").exists():
        return _load(results, f"memory-{preset}")
    return _load(results, f"pretrain-{preset}")


def _profile_line(unit: dict[str, Any]) -> str | None:
    profile = unit.get("profile")
    if not profile:
        return None
    if "error" in profile:
        return f"  - profile: failed ({profile['error'][:120]})"
    shares = ", ".join(f"{name} {share:.0%}" for name, share in profile["share_by_category"].items())
    top = "; ".join(f"{k['name'][:70]} {k['share']:.0%}" for k in profile["top"][:4])
    busy = profile["busy_share_of_wall"]
    return (
        f"  - profile of {profile['steps']} steps ({profile['timer']}): busy {busy:.0%} of the step's wall time; "
        f"{shares}. Top: {top}"
    )


def _packing_lines(unit: dict[str, Any] | None) -> list[str]:
    if not unit or "moved" not in unit:
        return [f"- packed rows per attention (the packing probe's measure): {_missing(unit) or 'failed'}"]
    moved = "; ".join(
        f"{key} {value:.3f}" if isinstance(value, float) else f"{key} failed ({value[:60]})"
        for key, value in unit["moved"].items()
    )
    return [
        f"- packed rows per attention, {unit['dtype']} (how far a packed sample moves from itself alone over "
        f"its spread; the probe refuses above {unit['limit']}): {moved}"
    ]


def _eval_part(unit: dict[str, Any]) -> str:
    """An eval's seconds where one was timed: the units read no validation windows (eval_every 0), so the
    first H100 run's evals (0.00 s) timed nothing and are left out."""
    return f" one eval {unit['eval_s']:.2f} s;" if unit.get("eval_s") else ""


def detail_lines(results: Path, units: list[tuple[str, str | None]]) -> list[str]:
    lines = []
    for part, preset in units:
        if part != "pretrain":
            continue
        unit = _load(results, f"pretrain-{preset}")
        if unit and "steady_step_s" in unit:
            steady = unit["steady_step_s"]
            lines.append(
                f"- pretrain {preset}: {unit['parameters'] / 1e6:,.1f}M parameters, attention {unit['attention']}, "
                f"{len(steady)} steady steps (median {sorted(steady)[len(steady) // 2]:.3f} s, min {min(steady):.3f} s); "
                f"first step (compile) {unit['first_step_s']:.1f} s;{_eval_part(unit)} one commit "
                f"{unit['commit_s']:.2f} s; peak {unit['peak_flops'] or 0:.3g} FLOP/s used for MFU"
            )
            lines += [line for line in [_profile_line(unit)] if line]
    lines += _packing_lines(_load(results, "packing"))
    lines += _vlm_generation_lines(_load(results, "vlm-generation"))
    lines += _gpu_tests_lines(results)
    return lines


def _gpu_tests_lines(results: Path) -> list[str]:
    """The GPU tests' outcome, a failed (or cut off) or missing unit too, with the tests that failed named:
    written for a success alone, the line left the report silent on the tests exactly when they failed."""
    tests = _load(results, "gpu-tests")
    if tests and "summary" in tests:
        return [f"- `pytest -m gpu`: {tests['summary']} (exit {tests['exit_code']})"]
    if tests is None:
        return ["- `pytest -m gpu`: not run"]
    try:  # _load keeps only a failed unit's error; its test outcomes are in the raw result
        outcomes = json.loads((results / "gpu-tests.json").read_text()).get("tests") or {}
    except (FileNotFoundError, ValueError):
        outcomes = {}
    failed = [*outcomes.get("failed", []), *outcomes.get("error", [])]
    return [
        f"- `pytest -m gpu`: failed ({tests['error']})" + (f"; failed: {', '.join(failed)}" if failed else "")
    ]


def _vlm_generation_lines(unit: dict[str, Any] | None) -> list[str]:
    """The generation eval's share at the shipped OCR config's settings (no target: a figure to read)."""
    if not unit or "measured" not in unit:
        return [
            f"- VLM generation eval share (2B-shaped, shipped OCR settings): {_missing(unit) or 'failed'}"
        ]
    m, scaled = unit["measured"], unit["scaled"]
    return [
        f"- VLM generation eval at configs/finetune/qwen3-vl-2b-qlora-ocr.yaml's settings, 2B-shaped Qwen2-VL, "
        f"{unit['image_pixels']} px pages: a training step {m['step_s']:.2f} s (median of {m['timed_steps']}); "
        f"an answer of {m['forced_tokens']} tokens {m['forced_answer_s']:.2f} s ({m['forced_token_ms']:.1f} ms "
        f"per token), of {m['needed_tokens']} tokens {m['needed_answer_s']:.2f} s; scaled to the run "
        f"(generation evals x samples x answer / max_steps x step): {scaled['forced_share']:.0%} of training "
        f"time at {m['forced_tokens']} tokens, {scaled['needed_share']:.0%} at {m['needed_tokens']}"
    ]


def section(results: Path, targets: dict[str, float], units: list[tuple[str, str | None]]) -> str:
    env = _load(results, "env") or {}
    device = env.get("gpu") or "no GPU (dry run)"
    dry = " (dry run on CPU: the harness's check, no GPU figures)" if env.get("dry") else ""
    # dict.fromkeys: each preset once, in the order the units run (the pretrain part's measure two).
    memory_presets = list(dict.fromkeys(p for part, p in units if part in ("pretrain", "memory") and p))
    packages = "".join(f", {name} {found}" for name, found in (env.get("packages") or {}).items() if found)
    lines = [
        "## GPU",
        "",
        f"Written by `make gpu-check`{dry} from `{results.name}/` on {device}; driver and versions: "
        f"{env.get('nvidia_smi') or '-'}, torch {env.get('torch')}, CUDA {env.get('cuda')}, bitsandbytes "
        f"{env.get('bitsandbytes')} (CUDA kernels: {env.get('bitsandbytes_cuda')}){packages}. Raw results "
        f"and logs: bench/results/{results.name}/.",
        "",
        *target_rows(results, targets, memory_presets, bool(env.get("dry"))),
        "",
        *detail_lines(results, units),
        "",
    ]
    notes = results / NOTES_FILE
    if notes.exists():  # what the figures alone cannot say: the calls, what ran out, what changed since
        lines += [notes.read_text().strip(), ""]
    return "\n".join(lines)


def write_report(
    results: Path, benchmarks: Path | None, targets: dict[str, float], units: list[tuple[str, str | None]]
) -> str:
    text = section(results, targets, units)
    (results / "report.md").write_text(text)
    if benchmarks is not None:
        from run_all import merge_sections, split_sections

        head, sections = (
            split_sections(benchmarks.read_text()) if benchmarks.exists() else ("# Benchmarks\n\n", [])
        )
        # One blank line between sections, as `make bench` writes them (bench/run_all.py): joined with
        # nothing, every heading of BENCHMARKS.md lost the blank line above it.
        benchmarks.write_text(head + "\n".join(merge_sections(sections, [text])))
    print(text)
    return text
