"""trainpod: train and finetune language models on rented GPUs, crash-safe and exactly resumable."""

__version__ = "0.1.0"
