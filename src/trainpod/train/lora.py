"""peft's LoRA settings from the config's `lora:` section: the finetune workload and its benchmark's
Trainer baseline build their adapters from this one function, so both train the same thing."""

from __future__ import annotations

from trainpod.config.finetune import LoraSettings


def peft_lora_config(lora: LoraSettings):
    """peft's LoraConfig for the config's lora section."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        use_rslora=lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
