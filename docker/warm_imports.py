"""Build step of docker/Dockerfile: import what a pod imports, so Python writes exactly those .pyc.

The packages are installed with `pip install --no-compile`: compiling everything would add about
330 MB of .pyc to the cpu image (1.84 GB instead of about 1.5 GB), most of it for modules no
workload imports (pandas/sympy internals, test suites). Without any .pyc every pod start would
compile torch and transformers again on the (wiped) container disk: seconds of cold start.
Run at build time only:  python docker/warm_imports.py [extra.module ...]
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
    "peft",
]

for name in MODULES + sys.argv[1:]:
    importlib.import_module(name)
print(f"imported {len(MODULES) + len(sys.argv) - 1} modules; their .pyc are written")
