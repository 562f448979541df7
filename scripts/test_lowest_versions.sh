#!/usr/bin/env bash
# Install the lowest versions setup.py allows (every `>=` floor pinned with `==`, torch as the README pins it) in a
# fresh venv, and run the model, pipeline and LoRA tests there. CI runs this beside the README's test command.
#
#   bash scripts/test_lowest_versions.sh            # both steps
#   bash scripts/test_lowest_versions.sh deps       # 1. a fresh venv with torch and the dependencies, not the package
#   bash scripts/test_lowest_versions.sh test       # 2. the package itself (editable), then the tests
#
# CI runs step 1 beside the README's install (each pip install keeps one core busy), and step 2 at the lowest priority
# beside the README's tests, once the README's install has built the package. Step 1 leaves the package out because
# installing it writes src/diffusers_lmlp.egg-info, which the README's install writes too.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-lowest
step=${1:-all}
case "$step" in
    all | deps | test) ;;
    *) echo "usage: bash scripts/test_lowest_versions.sh [deps|test]; got '$step'" >&2; exit 2 ;;
esac
testing=("pytest>=8" "pytest-xdist>=3.6")

if [ "$step" != test ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    . "$venv/bin/activate"
    pip install torch==2.13.0
    python scripts/lowest_requirements.py train > "$venv/lowest.txt"
    echo "lowest versions:" && cat "$venv/lowest.txt"
    python scripts/lowest_requirements.py --requirements train > "$venv/requirements.txt"
    pip install -c "$venv/lowest.txt" -r "$venv/requirements.txt" "${testing[@]}"
fi
if [ "$step" != deps ]; then
    [ -f "$venv/requirements.txt" ] || { echo "no $venv with its dependencies: run 'bash $0 deps' first" >&2; exit 1; }
    . "$venv/bin/activate"
    pip install -c "$venv/lowest.txt" -e ".[train]" "${testing[@]}"
    pip list | grep -iE "^(torch|diffusers|transformers|accelerate|safetensors|huggingface.hub|datasets|peft) "
    python -m pytest -q -p no:cacheprovider tests/models/test_models.py tests/pipelines/test_pipeline.py \
        tests/pipelines/test_pipeline_loading.py tests/pipelines/test_bad_inputs.py tests/models/test_peft.py \
        tests/pipelines/test_lora_loading.py tests/training/test_train_lora.py
fi
