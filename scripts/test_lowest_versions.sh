#!/usr/bin/env bash
# Install the lowest versions setup.py allows (every `>=` floor pinned with `==`, torch as the README pins it) in a
# fresh venv, and run the model, pipeline and LoRA tests there. CI runs this after the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-lowest
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install torch==2.13.0
python scripts/lowest_requirements.py train > "$venv/lowest.txt"
echo "lowest versions:" && cat "$venv/lowest.txt"
pip install -c "$venv/lowest.txt" -e ".[train]" "pytest>=8" "pytest-xdist>=3.6"
pip list | grep -iE "^(torch|diffusers|transformers|accelerate|safetensors|huggingface.hub|datasets|peft) "
python -m pytest -q -p no:cacheprovider tests/test_models.py tests/test_pipeline.py tests/test_pipeline_loading.py \
    tests/test_bad_inputs.py tests/test_peft.py tests/test_lora_loading.py tests/test_train_lora.py

