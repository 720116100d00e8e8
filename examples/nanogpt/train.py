"""A nanoGPT-style training loop (a tiny GPT in plain torch) made spot-safe by trainpod's Python API.

    trainpod run command --config examples/nanogpt/command.yaml      # under the kit's lifecycle
    TRAINPOD_RUN_DIR=/tmp/nanogpt python examples/nanogpt/train.py   # alone: it takes the lease itself

Killed at any instant and started again, it continues from its newest committed checkpoint and
ends with the same weights, byte for byte on CPU, as a run never interrupted. What makes that so:
every random choice comes from state the checkpoint holds (weights, AdamW moments, RNG states),
and the data position is the step itself (each batch is drawn from a generator seeded by the step).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

from trainpod import Checkpointer

TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. A spot pod can be "
    "stopped at any moment, with five seconds of warning, and a training run must not care. "
)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, context: int = 32, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout=0.1) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token.weight  # weight tying, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.token(idx) + self.position(torch.arange(length))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def batch(
    data: torch.Tensor, step: int, seed: int, size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`: a function of the step alone, so resuming needs no data state but the step."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - context - 1, (size,), generator=generator)
    x = torch.stack([data[s : s + context] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + context] for s in starts])
    return x, y


def learning_rate(step: int, max_steps: int, peak: float = 3e-3, warmup: int = 5) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, max_steps - warmup)))


def export(model: nn.Module, run_dir: Path) -> Path:
    """The final weights, written to a temp name and renamed: a kill leaves the old file or the new one."""
    target = run_dir / "export" / "model.safetensors"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    safetensors.torch.save_model(model, str(tmp))
    os.replace(tmp, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--commit-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--sleep-per-step", type=float, default=0.0, help="slow down, to watch an interruption"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the same float sums in every run, so resume is bit-exact
    torch.manual_seed(args.seed)
    data = torch.tensor(list(TEXT.encode()) * 20, dtype=torch.long)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    with Checkpointer() as ckpt:
        step = 0
        restored = ckpt.restore()
        if restored is not None:
            restored.load("model", model)
            restored.load("optimizer", optimizer)
            restored.restore_rng()
            step = restored.step
            print(f"resumed from step {step}", flush=True)
        model.train()
        while step < args.max_steps:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.max_steps)
            x, y = batch(data, step, args.seed, args.batch_size, 32)
            loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            time.sleep(args.sleep_per_step)
            due = step % args.commit_every == 0 or step == args.max_steps
            stop = ckpt.should_stop()  # under torchrun, every rank agrees on the same step
            if due or (stop and ckpt.commit_fits()):
                ckpt.commit(step, model=model, optimizer=optimizer, extra={"loss": loss.item()})
            if stop:
                ckpt.exit_preempted()  # exit 143: the supervisor starts the pod again
        print(f"finished: weights at {export(model, ckpt.run_dir)}", flush=True)


if __name__ == "__main__":
    main()
