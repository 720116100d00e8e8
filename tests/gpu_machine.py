"""A bare GPU machine, rehearsed on CPU: `make gpu-check` must run where only the packages below (with what
they need) and the wheels of `make gpu-wheels` (bench/gpu_wheels.py) are installed. The list is the image of
the GPU machines this project is lent (its Python packages as read on one on 2026-11-17: a CUDA torch 2.11,
transformers 5.17, peft, accelerate, torchvision and the usual scientific stack; no bitsandbytes, pydantic or
jiwer). A package trainpod or the check imports that is neither fails `tests/test_gpu_check.py` here instead
of a paid GPU run. Versions are not rehearsed here: the code ran on that machine's versions once, on CPU
(torch 2.11.0+cu130, transformers 5.17.0: BENCHMARKS.md, "GPU").

`block_imports_beyond(machine, carried, folder)` writes a sitecustomize.py into `folder`: with that folder
first on PYTHONPATH, every Python process (the check's units and the pytest it starts inherit the variable)
finds every other installed distribution missing, as that machine would: importing its modules fails,
`importlib.util.find_spec` returns None (transformers' optional-package checks) and importlib.metadata does
not list it (pytest's plugins)."""

from __future__ import annotations

import json
import re
from importlib.metadata import PackageNotFoundError, distribution, distributions, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

_LISTED = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"""
GPU_MACHINE_PACKAGES = frozenset(_LISTED.split())


def normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def installed_closure(names: set[str]) -> set[str]:
    """`names` and what they need, as the versions installed here declare it (extras left out): the GPU
    machine's own versions of those packages come with their own needs installed."""
    seen: set[str] = set()
    todo = [normalized(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for line in requirements:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalized(requirement.name))
    return seen


# Run at the start of every Python process that has its folder first on PYTHONPATH. None in sys.modules:
# `import x` raises ModuleNotFoundError and find_spec("x") returns None. The distributions go from
# importlib.metadata too, so nothing finds a plugin or version of a package that is "not installed".
_SITECUSTOMIZE = """\
import json, re, sys
from importlib.machinery import PathFinder
from pathlib import Path

_hidden = json.loads((Path(__file__).parent / "hidden.json").read_text())
for _module in _hidden["modules"]:
    sys.modules.setdefault(_module, None)
_distributions = set(_hidden["distributions"])
_find_distributions = PathFinder.find_distributions


def _visible_distributions(*args, **kwargs):
    for found in _find_distributions(*args, **kwargs):
        if re.sub(r"[-_.]+", "-", found.metadata["Name"] or "").lower() not in _distributions:
            yield found


PathFinder.find_distributions = _visible_distributions
"""


def block_imports_beyond(machine: set[str], carried: set[str], folder: Path) -> list[str]:
    """Hides, from processes with `folder` first on PYTHONPATH, every installed distribution that is neither
    on the machine (with what those need) nor carried (wheels are carried without their needs, so these
    are taken as named); returns the hidden top-level module names."""
    allowed = installed_closure(machine) | {normalized(name) for name in carried}
    hidden = {normalized(found.metadata["Name"]) for found in distributions()} - allowed
    modules = sorted(
        module
        for module, owners in packages_distributions().items()
        if not any(normalized(owner) in allowed for owner in owners)
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hidden.json").write_text(json.dumps({"modules": modules, "distributions": sorted(hidden)}))
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return modules
