# trainpod: `make demo` runs the whole pipeline on CPU; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for tests and the demo; the images install their own (docker/).
TORCH_SPEC ?= torch==2.13.0
# Where a plain PyPI torch is a CUDA build (GitHub runners), point this at the CPU wheels:
# TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PYTEST_ARGS ?=
# Test processes for the unit tier (pytest-xdist). Most tests wait on one trainer subprocess at a time,
# which keeps one core busy: two workers use both cores of a CI machine. worksteal: a worker that runs out
# takes tests queued for the other; xdist's default split left one worker alone on the last ten minutes.
TEST_WORKERS ?= 2
# OpenMP threads that wait spin first (libgomp's default): torch's two intra-op threads per trainer, two
# workers and the two-rank tests' ranks on two cores spent their slices spinning. Three tiny finetunes at once
# took 55 s for 28 passive (alone: no difference). Numerics are the same either way; the tests' own processes
# only, never the images' (docker/).
TEST_ENV ?= OMP_WAIT_POLICY=PASSIVE

.PHONY: setup lock-dev demo demo-vlm test test-container bench lint clean gpu-wheels gpu-check

setup: $(VENV)/.installed

# constraints-dev.txt: the venv's lock; PyPI releases change nothing here until it is regenerated.
DEV_LOCK ?= constraints-dev.txt

$(VENV)/.installed: pyproject.toml $(DEV_LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and alone: a later install sees it satisfied and never swaps it for a CUDA build.
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(DEV_LOCK) -e '.[dev,hub,tracking]'
	touch $@

# The newest versions PyPI resolves for the dev extras, written as the lock; run `make test` on it.
lock-dev:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	.venv-lock/bin/python -m pip install -q -e '.[dev,hub,tracking]'
	{ sed -n '/^#/p' $(DEV_LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } \
	  > $(DEV_LOCK).new && mv $(DEV_LOCK).new $(DEV_LOCK)
	rm -rf .venv-lock

demo: setup
	$(PY) -m trainpod.demo

# A vision-language finetune on CPU (22 s on 2 cores): a tiny random Qwen2-VL and 200 rendered strings
# (tests/vlm_support.py builds both offline), QLoRA with CER eval, then the adapter merged.
demo-vlm: setup
	PYTHONPATH=src:tests $(PY) -c "from pathlib import Path; import vlm_support as v; \
	  root = Path('demo-volume'); v.make_tiny_vlm(root / v.VLM_BASE); v.write_ocr_jsonl(root / v.OCR_FILE, 200, seed=0)"
	TRAINPOD_VOLUME=demo-volume $(PY) -m trainpod run finetune-vlm --config configs/finetune/tiny-vlm.yaml
	TRAINPOD_VOLUME=demo-volume $(PY) -m trainpod run convert --config configs/convert/tiny-vlm.yaml
	TRAINPOD_VOLUME=demo-volume $(PY) -m trainpod status tiny-vlm

test: setup
	$(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not container and not gpu" $(PYTEST_ARGS)

# The container tier: installs Docker's engine from Debian if missing (root), builds the cpu image
# offline and runs it like RunPod would (tests/container). CI runs it after `make test`.
test-container: setup
	$(PY) -m pytest -m container tests/container $(PYTEST_ARGS)

bench: setup
	$(PY) bench/run_all.py

# The GPU proof (bench/gpu_check.py): on a CUDA machine with torch, transformers, peft and accelerate, no
# internet needed. `make gpu-wheels` (where the package index is) fetches what such a machine lacks into
# .whl/; gpu-check installs those offline first. GPU_CHECK_ARGS: e.g. --part pretrain, --dry on CPU.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/trainpod-gpu-site
GPU_CHECK_ARGS ?=
gpu-wheels: setup
	$(PY) bench/gpu_wheels.py

gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR)/src $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench entrypoints examples
	$(VENV)/bin/ruff format --check src tests bench entrypoints examples
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(VENV)/bin/zizmor --offline --no-progress .github/workflows

clean:
	rm -rf $(VENV) demo-volume bench-out .pytest_cache

# ---------------------------------------------------------------------------------------------
# Images (docker/Dockerfile): make wheelhouse image push TARGET=cu128|cu130|cpu REGISTRY=ghcr.io/you
#   TARGET:     cu128 (default; hosts reporting CUDA 12.8, 12.9, 13.0: most of RunPod), cu130 (hosts
#               with CUDA 13.0 only, driver >= 580), cpu (datagen/convert/supervise CPU pods); each has
#               its lock docker/constraints-$(TARGET).txt; cu* build the Dockerfile's `cuda` target
#   wheelhouse: pip download every pin of that lock into $(WHEELHOUSE) (+ FLASH_ATTN_WHEEL_URL, cu* only)
#   wheelhouse-check: the same resolution as `pip install --dry-run --report`, downloading no wheel
#   image:      build from that wheelhouse (pip offline; BUILD_NETWORK=none for apt too), tagged version, git sha,
#               flavour (cu128-torch<torch> | cu130-torch<torch> | cpu-torch<torch>) and latest; the
#               tags of cu130 and cpu carry a suffix (-cu130, -cpu): `latest` and `0.1.0` are cu128;
#               with SOURCE_IMAGE=<local image> it tags that already-built image instead of building
#               (the container tier pushes the image its fixture built: a rebuild, even from cache,
#               would be a new image ID)
#   push:       pushes those four tags to $(REGISTRY) (docker/push.sh), logging in first when the
#               environment has REGISTRY_USER + REGISTRY_PASSWORD, or GITHUB_TOKEN for ghcr.io;
#               the password only ever goes through `docker login --password-stdin`
#   image-refs, image-build-args: the tags and the build args, one per line (images.yml reads them)
# Debian's client with BuildKit: another `docker` earlier on PATH may lack buildx.
# ---------------------------------------------------------------------------------------------
TARGET ?= cu128
REGISTRY ?= trainpod
DOCKER ?= /usr/bin/docker
WHEELHOUSE ?= .cache/wheelhouse/$(TARGET)
LOCK := docker/constraints-$(TARGET).txt
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
GIT_SHA := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
TORCH_PIN := $(shell sed -n 's/^torch==//p' $(LOCK) 2>/dev/null)
TORCH_RELEASE := $(firstword $(subst +, ,$(TORCH_PIN)))
# Per flavour: the CUDA torch is built for, the nvidia/cuda base of that CUDA, and where pip finds
# torch (cu128: PyTorch's index; cu130: PyPI's own torch is that build; cpu: PyTorch's CPU index).
CUDA_cu128 := 12.8
CUDA_cu130 := 13.0
CUDA_BASE_cu128 := nvidia/cuda:12.8.1-base-ubuntu24.04
CUDA_BASE_cu130 := nvidia/cuda:13.0.1-base-ubuntu24.04
WHEEL_INDEX_cu128 := https://download.pytorch.org/whl/cu128
WHEEL_INDEX_cu130 :=
WHEEL_INDEX_cpu := https://download.pytorch.org/whl/cpu
ifeq ($(TARGET),cpu)
DOCKER_TARGET := cpu
BASE_IMAGE ?= debian:bookworm-slim
BASE_ARG := CPU_BASE_IMAGE
TORCH_VERSION := $(TORCH_PIN)
FLAVOUR := cpu-torch$(TORCH_RELEASE)
SUFFIX := -cpu
# The image's Python: pip downloads wheels for it, not for the host's.
WHEEL_PYTHON ?= 3.11
FLAVOUR_ARGS :=
else ifneq ($(CUDA_$(TARGET)),)
DOCKER_TARGET := cuda
CUDA_VERSION := $(CUDA_$(TARGET))
BASE_IMAGE ?= $(CUDA_BASE_$(TARGET))
BASE_ARG := BASE_IMAGE
# torch.__version__ carries the CUDA build as a local version (2.13.0+cu130) even when the pin does not.
TORCH_VERSION := $(if $(findstring +,$(TORCH_PIN)),$(TORCH_PIN),$(TORCH_PIN)+$(TARGET))
FLAVOUR := $(TARGET)-torch$(TORCH_RELEASE)
SUFFIX := $(if $(filter cu128,$(TARGET)),,-$(TARGET))
WHEEL_PYTHON ?= 3.12
FLAVOUR_ARGS := LOCK=$(LOCK) CUDA_VERSION=$(CUDA_VERSION) FLAVOUR=$(TARGET)
else
$(error TARGET=$(TARGET) is not a flavour: use cu128 (the default), cu130 or cpu)
endif
# TORCH_INDEX (the CPU wheels of `make setup`) wins where it is set, as in GitHub Actions' cpu job.
WHEEL_INDEX ?= $(or $(TORCH_INDEX),$(WHEEL_INDEX_$(TARGET)))
# Both bases have glibc >= 2.36; pip takes --platform literally, so every manylinux level that
# wheels use is listed (bitsandbytes ships manylinux_2_24, grpcio manylinux_2_17).
WHEEL_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
PIP_WHEEL_ARGS = --only-binary=:all: $(foreach p,$(WHEEL_PLATFORMS),--platform $(p)) \
  --python-version $(WHEEL_PYTHON) --implementation cp $(if $(WHEEL_INDEX),--extra-index-url $(WHEEL_INDEX)) -r $(LOCK)
# flash-attn is optional and not on PyPI as a wheel: a prebuilt one whose name's torch/CUDA/Python
# tags fit the flavour (README, Images; the build checks them and imports it). cu* only.
FLASH_ATTN_WHEEL_URL ?=
TAG ?= $(IMAGE_VERSION)$(SUFFIX)
IMAGE_TAGS := $(TAG) $(GIT_SHA)$(SUFFIX) $(FLAVOUR) latest$(SUFFIX)
IMAGE_BUILD_ARGS := $(BASE_ARG)=$(BASE_IMAGE) WHEELHOUSE=$(WHEELHOUSE) TORCH_VERSION=$(TORCH_VERSION) \
  $(FLAVOUR_ARGS) VERSION=$(IMAGE_VERSION) GIT_SHA=$(GIT_SHA)

# RUN steps' network: the wheelhouse makes pip offline either way (--no-index), but the apt step
# needs the network unless the base already has every system package (the CI base does):
# BUILD_NETWORK=none proves a build needs nothing from outside.
BUILD_NETWORK ?= default

.PHONY: wheelhouse wheelhouse-check image push image-refs image-build-args

# Any pip will do (pip download fetches for the image's platform, not the host's): no venv needed.
# With dependencies: the cu130 lock pins cuda-toolkit[...] with extras and the cu128 lock pins torch
# alone (its nvidia-*-cu12 pins are exact in torch's metadata): only a resolver brings those wheels.
# The flash-attn line is not echoed (@): its URL may hold a token (a private host's), and images.yml's
# build log is public; it prints the command with the variable's name instead. The wheel's file name is
# the URL's path's last part: a presigned URL's query (?X-Amz-Signature=...) would hide it from the
# Dockerfile's flash_attn-*.whl.
wheelhouse:
	mkdir -p $(WHEELHOUSE)
	rm -f $(WHEELHOUSE)/flash_attn-*.whl
	$(PYTHON) -m pip download -d $(WHEELHOUSE) $(PIP_WHEEL_ARGS)
	@$(if $(and $(filter cu%,$(TARGET)),$(FLASH_ATTN_WHEEL_URL)),cd $(WHEELHOUSE) && \
	  url='$(FLASH_ATTN_WHEEL_URL)' && wheel="$$(basename "$${url%%[?#]*}" | sed 's/%2B/+/g')" && \
	  echo "curl -fL -o $$wheel \$$FLASH_ATTN_WHEEL_URL" && curl -fL -o "$$wheel" '$(FLASH_ATTN_WHEEL_URL)')

# The wheelhouse's resolution without the downloads (index metadata only): what it would fetch, in
# $(WHEELHOUSE)/report.json. Fails like `make wheelhouse` would on a pin the index lacks.
wheelhouse-check:
	mkdir -p $(WHEELHOUSE)
	$(PYTHON) -m pip install --dry-run --ignore-installed --target $(WHEELHOUSE)/.dry-run \
	  --report $(WHEELHOUSE)/report.json $(PIP_WHEEL_ARGS)

SOURCE_IMAGE ?=
# Docker's rule: the first part of a name is a registry host when it has a dot or a colon or is
# localhost; otherwise the name lives on Docker Hub.
REGISTRY_FIRST := $(firstword $(subst /, ,$(REGISTRY)))
REGISTRY_HOST := $(if $(or $(findstring .,$(REGISTRY_FIRST)),$(findstring :,$(REGISTRY_FIRST)),$(filter localhost,$(REGISTRY_FIRST))),$(REGISTRY_FIRST),docker.io)

image:
ifneq ($(SOURCE_IMAGE),)
	$(foreach t,$(IMAGE_TAGS),$(DOCKER) tag $(SOURCE_IMAGE) $(REGISTRY)/trainpod:$(t) &&) true
else
	DOCKER_BUILDKIT=1 $(DOCKER) build --network $(BUILD_NETWORK) -f docker/Dockerfile --target $(DOCKER_TARGET) \
	  $(foreach a,$(IMAGE_BUILD_ARGS),--build-arg $(a)) \
	  $(foreach t,$(IMAGE_TAGS),-t $(REGISTRY)/trainpod:$(t)) .
endif

push:
	DOCKER=$(DOCKER) sh docker/push.sh $(REGISTRY_HOST) $(foreach t,$(IMAGE_TAGS),$(REGISTRY)/trainpod:$(t))

# The references `make image push` makes, one per line (.github/workflows/images.yml tags with them).
image-refs:
	@$(foreach t,$(IMAGE_TAGS),echo $(REGISTRY)/trainpod:$(t);)

# The Dockerfile target and its build args for this flavour, one NAME=VALUE per line after the first
# line `target=<cpu|cuda>` (.github/workflows/images.yml hands them to docker/build-push-action).
image-build-args:
	@echo target=$(DOCKER_TARGET)
	@$(foreach a,$(IMAGE_BUILD_ARGS),echo $(a);)
