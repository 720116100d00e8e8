"""`make demo`: the whole pipeline on CPU, with a simulated spot interruption and automatic resume.

    python -m trainpod.demo [--volume demo-volume]

1. datagen: trains a byte-level BPE tokenizer on the embedded corpus and writes token shards;
2. pretrain: a tiny Llama, interrupted by SIGTERM (a spot pod's warning) after a checkpoint;
3. pretrain again with the same settings: it resumes from the newest checkpoint and finishes;
4. transformers loads the exported model and generates a few words;
5. finetune: QLoRA (bitsandbytes NF4 on CPU) of that model on embedded instructions, interrupted
   by SIGTERM after a checkpoint;
6. `trainpod boot`, as a pod runs it: resumes the finetune and, once it is DONE, converts it in the same
   process (a deploy's `then`): the adapter to mlx-lm's format and merged into the base as a plain HF model;
7. DPO: LoRA on the merged model, taught to prefer the right answers to wrong ones (`objective: dpo`);
8. `trainpod generate` answers with base + adapter in the template it trained with, transformers
   loads the merged model; a summary is printed.
Before pretraining, `trainpod estimate` says what the run will take.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
INTERRUPT_AFTER_STEP = 30  # SIGTERM once this step's checkpoint is committed (tiny: every 10 of 60)
FINETUNE_INTERRUPT_AFTER_STEP = 10  # finetune tiny: a checkpoint every 10 of 30 steps
# The answer's length for `trainpod generate`/`chat` on the tiny model: it reads 128 positions (its seq_len),
# and the alpaca prompt of "Add the two numbers. 12 + 30" is 107 tokens, so the CLI's default 200 refuses
# every message (exit 2, "shorten the message or lower --max-new-tokens"). The README's commands pass it too.
MAX_NEW_TOKENS = 16


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def trainpod(args: list[str], volume: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainpod", *args, "--volume", str(volume)])


def run_to_end(args: list[str], volume: Path) -> int:
    return trainpod(args, volume).wait()


def boot_as_a_pod(workload: str, config: Path, volume: Path, then: Path) -> int:
    """`trainpod boot` with the environment `trainpod deploy` gives a pod (README, "The pod's environment"), but
    RunPod's own variables: there is no pod here to stop after DONE, and boot says so."""
    pod = {"TRAINPOD_WORKLOAD": workload, "TRAINPOD_CONFIG": str(config), "TRAINPOD_VOLUME": str(volume)}
    pod["TRAINPOD_THEN_CONFIG"] = str(then)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "RUNPOD_"))}
    return subprocess.Popen([sys.executable, "-m", "trainpod", "boot"], env=environ | pod).wait()


def latest_step(run_dir: Path) -> int:
    try:
        return int((run_dir / "checkpoints" / "LATEST").read_text().strip().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def interrupt_after_checkpoint(
    args: list[str], volume: Path, run_dir: Path, after_step: int = INTERRUPT_AFTER_STEP
) -> tuple[int, int]:
    """Start training, SIGTERM it once step `after_step` is committed; (exit code, newest checkpoint)."""
    proc = trainpod(args, volume)
    while proc.poll() is None and latest_step(run_dir) < after_step:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60), latest_step(run_dir)


def generate_sample(
    export_dir: Path,
    prompt: str = "Once upon a time",
    adapter_dir: Path | None = None,
    max_new_tokens: int = 30,
) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=0.7,
            top_k=20,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volume", default="demo-volume", help="folder standing in for the network volume")
    volume = Path(parser.parse_args(argv).volume).resolve()
    shutil.rmtree(volume, ignore_errors=True)  # the demo's own folder: every demo starts fresh
    volume.mkdir(parents=True)
    started = time.monotonic()

    banner("1/8 datagen: tokenizer + token shards from the embedded corpus")
    if run_to_end(["run", "datagen", "--config", str(CONFIGS / "datagen/tiny.yaml")], volume) != 0:
        return 1
    pretrain = ["run", "pretrain", "--config", str(CONFIGS / "pretrain/tiny.yaml")]
    run_dir = volume / "runs" / "tiny-pretrain"
    banner("trainpod estimate: what the pretrain run will take (here on an H100; the demo runs on CPU)")
    run_to_end(["estimate", str(CONFIGS / "pretrain/tiny.yaml")], volume)

    banner(
        f"2/8 pretrain, interrupted by SIGTERM after the step-{INTERRUPT_AFTER_STEP} checkpoint (a spot warning)"
    )
    code, step = interrupt_after_checkpoint(pretrain, volume, run_dir)
    stopped_at = json.loads((run_dir / "status.json").read_text())["step"]
    print(
        f"--> exit code {code} (143 = preempted after committing); stopped after step {stopped_at}, "
        f"newest checkpoint step-{step}: {stopped_at - step} step(s) to redo"
    )
    if code not in (0, 143):
        return 1

    banner("3/8 pretrain again with the same settings: resumes from the newest checkpoint")
    if run_to_end(pretrain, volume) != 0:
        return 1

    banner("4/8 transformers loads the export and generates")
    export_dir = run_dir / "export" / "hf"
    print(f"--> {generate_sample(export_dir)!r}")

    finetune = ["run", "finetune", "--config", str(CONFIGS / "finetune/tiny.yaml")]
    finetune_dir = volume / "runs" / "tiny-finetune"
    banner(
        f"5/8 finetune: QLoRA on embedded instructions, interrupted after the step-{FINETUNE_INTERRUPT_AFTER_STEP} "
        "checkpoint"
    )
    code, step = interrupt_after_checkpoint(finetune, volume, finetune_dir, FINETUNE_INTERRUPT_AFTER_STEP)
    print(f"--> exit code {code}; newest checkpoint step-{step}")
    if code not in (0, 143):
        return 1

    banner(
        "6/8 trainpod boot, as the pod started again runs it: resumes the finetune, then converts it once DONE "
        "(a deploy's `then`): the adapter to MLX (mlx-lm) and merged into the base model"
    )
    if (
        boot_as_a_pod("finetune", CONFIGS / "finetune/tiny.yaml", volume, then=CONFIGS / "convert/tiny.yaml")
        != 0
    ):
        return 1

    banner(
        "7/8 DPO on the merged model: LoRA taught to prefer each right answer to a wrong one (objective: dpo)"
    )
    if run_to_end(["run", "finetune", "--config", str(CONFIGS / "finetune/tiny-dpo.yaml")], volume) != 0:
        return 1

    banner("8/8 trainpod generate (base + adapter, the alpaca template it trained with); the merged model")
    question = "Add the two numbers.\n12 + 30"
    generate = [
        "generate",
        "tiny-finetune",
        "--export",
        "adapter",
        "--prompt",
        question,
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
    ]
    print(f"$ {shlex.join(['trainpod', *generate])}", flush=True)  # the command as run, to copy
    if run_to_end(generate, volume) != 0:
        return 1
    # The alpaca template the tiny SFT data was tokenized with (sft/templates.py), instruction + input.
    prompt = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        f"request.\n\n### Instruction:\n{question}\n\n### Response:\n"
    )
    merged_dir = finetune_dir / "export" / "merged"
    print(f"--> merged model:   {generate_sample(merged_dir, prompt, max_new_tokens=8)[len(prompt) :]!r}")
    print_summary(run_dir, export_dir, finetune_dir, time.monotonic() - started)
    return 0


def print_summary(run_dir: Path, export_dir: Path, finetune_dir: Path, seconds: float) -> None:
    done = json.loads((run_dir / "DONE").read_text())
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    banner("summary")
    print(
        f"steps            {done['step']} ({done['tokens_seen']:,} tokens, {done['parameters']:,} parameters)"
    )
    print(f"final loss       train {done['loss']:.3f}, eval {done['eval_loss']:.3f}")
    print(f"throughput       {done['tokens_per_s']:,.0f} tokens/s on CPU")
    print(
        f"checkpoints      {', '.join(checkpoints)} (LATEST: {(run_dir / 'checkpoints/LATEST').read_text().strip()})"
    )
    print(f"exported model   {export_dir} ({', '.join(sorted(p.name for p in export_dir.iterdir()))})")
    print(f"loss curve       {run_dir / 'loss.png'}")
    tuned = json.loads((finetune_dir / "DONE").read_text())
    print(
        f"finetune         {tuned['method']} {tuned['step']} steps, {tuned['trainable_parameters']:,} trainable "
        f"parameters, eval loss {tuned['eval_loss']:.3f}, packing efficiency {tuned['packing_efficiency']:.0%}"
    )
    outputs = ", ".join(sorted(p.name for p in (finetune_dir / "export").iterdir()))
    print(f"finetune outputs {finetune_dir / 'export'} ({outputs})")
    dpo = json.loads((finetune_dir.parent / "tiny-dpo" / "DONE").read_text())
    evals = (
        json.loads((finetune_dir.parent / "tiny-dpo" / "status.json").read_text()).get("eval_metrics") or {}
    )
    accuracy = evals.get("eval_rewards_accuracy")
    print(
        f"dpo              {dpo['step']} steps, eval DPO loss {dpo['eval_loss']:.3f} (log 2 = 0.693 before a step)"
        + (
            f", chosen answer preferred in {accuracy:.0%} of the validation pairs"
            if accuracy is not None
            else ""
        )
    )
    print(f"status           trainpod status --volume {run_dir.parents[1]}")
    print(
        f"chat             trainpod chat tiny-finetune --volume {run_dir.parents[1]} --max-new-tokens {MAX_NEW_TOKENS}"
    )
    print(f"demo took        {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
