""".ci/run with stand-in commands: either failing fails CI; a failing README command stops the lowest-versions run."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from documents import ROOT


BUILT = ".venv/lib/python3.11/site-packages/diffusers_lmlp-0.1.0.dist-info"  # what the README's install leaves
pytestmark = pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason=".ci/run apt-gets chromium")


def run_ci(tmp_path: Path, test_command: str, lowest_script: str) -> subprocess.CompletedProcess:
    """Run a checkout of .ci/run alone, with the README test command and lowest-versions script given."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test_lowest_versions.sh").write_text(lowest_script, encoding="utf-8")
    readme = f"pip install torch==2.13.0\n\n<!-- test-command -->\n```bash\n{test_command}\n```\n"
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    return subprocess.run(["bash", tmp_path / ".ci" / "run"], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_failing_readme_command_fails_ci_and_stops_the_lowest_versions_run(tmp_path):
    marker = tmp_path / "still-running"
    lowest = f'sleep 3; touch "{marker}"\n'  # its `deps` step outlives the README's command
    result = run_ci(tmp_path, "sleep 1; false", lowest)  # a second for its session to start
    assert result.returncode != 0 and "+ sleep 1; false" in result.stdout
    time.sleep(4)
    assert not marker.exists(), "the lowest-versions run went on after CI failed"


@pytest.mark.slow
def test_a_failing_lowest_versions_run_fails_ci_after_the_readme_command(tmp_path):
    lowest = 'case "$1" in deps) ;; test) echo "the lowest tests ran"; exit 3 ;; esac\n'
    result = run_ci(tmp_path, f"mkdir -p {BUILT}", lowest)
    assert result.returncode == 1 and "the lowest tests ran" in result.stdout
    assert "the lowest-versions run failed (exit 3)" in result.stderr


@pytest.mark.slow
def test_the_lowest_versions_tests_wait_for_the_readme_install_to_build_the_package(tmp_path):
    order = tmp_path / "order"
    lowest = f'case "$1" in deps) ;; test) echo lowest >> "{order}" ;; esac\n'
    result = run_ci(tmp_path, f'sleep 1; echo readme >> "{order}"; mkdir -p {BUILT}', lowest)
    assert result.returncode == 0, result.stderr
    assert order.read_text(encoding="utf-8").split() == ["readme", "lowest"]
