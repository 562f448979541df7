"""What the package promises about itself: its licence, and that the documented commands' outputs stay out of git."""

import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def test_the_apache_license_that_setup_py_and_the_cards_name_is_there():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert re.search(r'license="Apache-2.0"', (ROOT / "setup.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "output",
    [
        "lmlp-shapes/model_index.json",  # the main command
        "lmlp-shapes-upload/README.md",  # hub push --dry-run --output-dir lmlp-shapes-upload
        "lmlp-demo-upload/app.py",  # hub push-space --dry-run --output-dir lmlp-demo-upload
        "tiny-lmlp/model_index.json",  # README examples
        "ul-mlp-f2-deep/config.json",
        "ablation-shapes/results.md",  # benchmarks/ablation_shapes.py --output_dir ablation-shapes
        "shapes-lora/pytorch_lora_weights.safetensors",
        "red_circle.png",
        ".venv-lowest/lowest.txt",  # scripts/test_lowest_versions.sh
    ],
)
def test_documented_outputs_are_ignored_by_git(output):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", output], cwd=ROOT)
    assert result.returncode == 0, f"{output} would show up in `git status`: add it to .gitignore"
