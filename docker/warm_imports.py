"""Build step of docker/Dockerfile: import what a pod imports, so Python writes exactly those .pyc.

The packages are installed with `pip install --no-compile`: compiling everything would add about
330 MB of .pyc to the cpu image (1.84 GB instead of about 1.5 GB), most of it for modules no
workload imports (pandas/sympy internals, test suites). Without any .pyc every pod start would
compile torch and transformers again on the (wiped) container disk: seconds of cold start.
Run at build time only:  python docker/warm_imports.py [--nf4-on-cpu] [extra.module ...]

--nf4-on-cpu (the cpu image) also proves that bitsandbytes loaded its native CPU kernels: when the
library cannot be loaded on a CPU-only machine, bitsandbytes swaps in a stand-in that fails only at
the first 4-bit call, so a bare `import bitsandbytes` would pass on a broken image.
"""

import importlib
import os
import sys

os.environ.setdefault("MPLBACKEND", "Agg")
MODULES = [
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "torch.utils.tensorboard",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.llama.configuration_llama",
    "tokenizers",
    "safetensors.torch",
    "pydantic",
    "yaml",
    "numpy",
    "pyarrow.parquet",
    "matplotlib.pyplot",
    "datasets",
    # finetune / convert: LoRA adapters over 4-bit NF4 layers
    "accelerate",
    "peft",
    "peft.tuners.lora",
    "bitsandbytes",
    "bitsandbytes.nn",
    # W&B tracking, imported when WANDB_API_KEY is set (about 0.6 s to compile on every start otherwise)
    "wandb",
]


def check_nf4_on_cpu() -> None:
    import bitsandbytes.functional as bnbf
    import torch
    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

    assert not isinstance(lib, ErrorHandlerMockBNBNativeLibrary), (
        "bitsandbytes could not load libbitsandbytes_cpu.so: 4-bit layers would fail at their first call"
    )
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    packed, state = bnbf.quantize_4bit(weights, quant_type="nf4")
    restored = bnbf.dequantize_4bit(packed, state)
    # NF4 keeps 16 levels per block: the round trip is close, not exact (relative error about 0.1;
    # kernels that return zeros or garbage give 1 or more).
    relative_error = ((restored - weights).norm() / weights.norm()).item()
    assert relative_error < 0.2, (
        f"NF4 round trip on CPU has relative error {relative_error:.3f}: bitsandbytes' CPU kernels are broken"
    )


args = sys.argv[1:]
nf4_on_cpu = "--nf4-on-cpu" in args
extra = [name for name in args if name != "--nf4-on-cpu"]
for name in MODULES + extra:
    importlib.import_module(name)
if nf4_on_cpu:
    check_nf4_on_cpu()
print(f"imported {len(MODULES) + len(extra)} modules; their .pyc are written")
