"""The README's Python examples run as written (all but those that need a real Hub repo)."""

import re
from pathlib import Path

import pytest


README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 4


def test_readme_examples_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {}
    ran = 0
    for block in BLOCKS:
        if "<user>" in block:  # needs a published model on the Hub
            continue
        exec(compile(block, str(README), "exec"), namespace)
        ran += 1
    assert ran >= 3
    assert Path("ul-mlp-f2/diffusion_pytorch_model.safetensors").is_file()
    assert len(namespace["images"]) == 1 and namespace["images"][0].size == (16, 16)
    assert namespace["eps"].shape == (2, 4, 32, 32) and namespace["loss"].ndim == 0


@pytest.mark.parametrize("marker", ["<!-- main-command -->", "<!-- test-command -->"])
def test_readme_commands_pin_torch_first(marker):
    text = README.read_text(encoding="utf-8")
    block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.index("pip install torch==2.13.0") < block.index("pip install -e")
