"""trainpod's checkpoint protocol inside other trainers: `trainpod.integrations.hf` (HF Trainer, TRL)."""
