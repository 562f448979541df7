"""The README and docs/ as a whole: every command block is run by a named test, every relative link resolves, every
page is listed, the README stays a five-minute read, and the numbers that have a results file in the repository
(the shipped shapes pipeline's `training_summary.json`) or come from the code (the named configurations' sizes and
costs) are what those say."""

import ast
import importlib.util
import json
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import torch
from documents import COMMAND_LANGUAGES, PAGES, ROOT, blocks, headings, section, text

from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH


# Which test runs each command block, as (page, the block's index among the page's command blocks, a line the block
# holds): the tests that run it. A new, moved or reordered block fails test_every_command_block_is_run_by_a_test
# until it is entered here.
COVERAGE = {
    ("README.md", 0, 'pip install -e ".[train]" && accelerate launch'): [
        "tests/test_first_minutes.py::test_readme_main_command_is_quiet_logs_plain_progress_and_ends_with_the_summary",
        "tests/test_readme.py::test_readme_commands_pin_torch_first",  # and .ci/run installs with it
    ],
    ("README.md", 1, 'pip install -e ".[test]" && python -m pytest -q'): [
        "tests/test_readme.py::test_readme_commands_pin_torch_first",  # .ci/run runs it
    ],
    ("README.md", 2, "python -m diffusers_lmlp.evaluation --pipeline shapes"): [
        "tests/test_evaluation_readme.py::test_readme_has_the_evaluation_commands",  # it is docs/evaluation.md's
        "tests/test_evaluation_readme.py::test_the_shapes_command_runs_as_written_offline",
    ],
    ("README.md", 3, "python -m diffusers_lmlp.hub push-space <user>/lmlp-demo --model <user>/lmlp-shapes"): [
        "tests/test_readme.py::test_hub_dry_run_commands_run_as_written",  # each push is a dry run without the dry
    ],
    ("README.md", 4, "ruff check . && ruff format --check ."): [
        "tests/test_readme.py::test_development_command_lints_clean",
    ],
    ("docs/hub.md", 0, "--dry-run --output-dir lmlp-shapes-upload"): [
        "tests/test_readme.py::test_hub_dry_run_commands_run_as_written",
    ],
    ("docs/hub.md", 1, "--with-code --dry-run --output-dir lmlp-shapes-code-upload"): [
        "tests/test_readme.py::test_hub_dry_run_commands_run_as_written",
    ],
    ("docs/hub.md", 2, "--dry-run --output-dir lmlp-demo-upload"): [
        "tests/test_readme.py::test_hub_dry_run_commands_run_as_written",
    ],
    ("docs/hub.md", 3, "LMLP_QUEUE_SIZE=8 LMLP_CONCURRENCY=2 python app.py"): [
        "tests/test_readme_numbers.py::test_the_readme_runs_the_space_from_its_folder_with_the_apps_settings",
        "tests/test_space.py::test_the_app_serves_on_the_threads_it_chose_and_says_why",
    ],
    ("docs/training.md", 0, "--preset shapes-lora"): [
        "tests/test_train_lora.py::test_the_documented_shapes_lora_preset_runs_offline_and_scores_before_and_after",
    ],
    ("docs/coco.md", 0, "hf download openai/clip-vit-large-patch14"): [
        "tests/test_train_coco.py::test_readme_downloads_are_the_files_the_run_reads",
    ],
    ("docs/coco.md", 1, "--num_machines 2 --machine_rank $MACHINE_RANK"): [
        "tests/test_train_coco.py::test_readme_has_the_coco_commands",
        "tests/test_train_coco.py::test_one_gpu_command_trains_from_the_default_ids_and_the_pipeline_samples",
        "tests/test_train_coco.py::test_two_cpu_processes_train_together",
        "tests/test_train_coco.py::test_two_machines_command_trains_as_one_run",
    ],
    ("docs/evaluation.md", 0, "python -m diffusers_lmlp.evaluation --pipeline shapes"): [
        "tests/test_evaluation_readme.py::test_the_shapes_command_runs_as_written_offline",
    ],
    ("docs/evaluation.md", 1, "--fid_reference coco2014/val2014"): [
        "tests/test_evaluation_readme.py::test_coco_fid_and_clip_score_against_the_published_statistics",
        "tests/test_evaluation_readme.py::test_coco_fid_against_the_val_images_themselves_equals_the_published_statistics",
    ],
    ("docs/analysis.md", 0, "python -m diffusers_lmlp.analysis lateralization"): [
        "tests/test_analysis.py::test_the_readme_command_draws_the_shipped_model_as_docs_show_it",
        "tests/test_analysis.py::test_every_documented_command_runs_as_written",
    ],
    ("docs/analysis.md", 1, "--pipeline uvit-shapes"): [
        "tests/test_analysis.py::test_every_documented_command_runs_as_written",
    ],
    ("docs/benchmarks.md", 0, "python benchmarks/speed_vs_uvit.py --precisions fp32"): [
        "tests/test_speed_benchmark.py::test_the_readme_and_docs_document_the_cpu_and_gpu_commands",
        "tests/test_speed_benchmark.py::test_the_documented_command_runs",
    ],
    ("docs/speed-gpu.md", 0, "examples/train_text_to_image.py"): [
        "tests/test_documents.py::test_the_gpu_page_ran_the_readme_main_command",
        "tests/test_first_minutes.py::test_readme_main_command_is_quiet_logs_plain_progress_and_ends_with_the_summary",
    ],
    ("docs/speed-gpu.md", 1, "python benchmarks/speed_vs_uvit.py --device cuda"): [
        "tests/test_speed_benchmark.py::test_the_readme_and_docs_document_the_cpu_and_gpu_commands",
    ],
    ("docs/ablation.md", 0, "python benchmarks/ablation_shapes.py --output_dir ablation-shapes"): [
        "tests/test_documents.py::test_the_ablation_command_is_the_scripts_own",
        "tests/test_ablation_shapes.py::test_two_entries_train_score_and_resume_end_to_end",
    ],
}


def command_blocks() -> dict[tuple[str, int], str]:
    """Every command block of every page, by (page, index among the page's command blocks)."""
    found = {}
    for page in PAGES:
        language = "|".join(COMMAND_LANGUAGES)
        for index, code in enumerate(blocks(text(page), f"(?:{language})")):
            found[page, index] = code
    return found


def test_every_page_in_docs_is_one_the_tests_read():
    assert sorted(PAGES) == sorted(["README.md", *(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))])


def test_every_command_block_is_run_by_a_test():
    found = command_blocks()
    registered = {(page, index): line for page, index, line in COVERAGE}
    assert sorted(found) == sorted(registered), "enter each new or moved command block in COVERAGE"
    for key, line in registered.items():
        assert line in found[key], f"{key} no longer holds {line!r}: update COVERAGE"
    for tests in COVERAGE.values():
        for test in tests:
            path, name = test.split("::")
            defined = {
                node.name
                for node in ast.parse((ROOT / path).read_text(encoding="utf-8")).body
                if hasattr(node, "name")
            }
            assert name in defined, f"{test} does not exist"


def github_anchor(title: str) -> str:
    """The #anchor GitHub gives a heading: lower case, punctuation dropped, spaces made hyphens."""
    title = re.sub(r"`|\*\*", "", title).strip().lower()
    kept = "".join(c for c in title if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen, found = {}, set()
    for _, _, title in headings(page.read_text(encoding="utf-8")):
        anchor = github_anchor(title)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def links(markdown: str) -> list[str]:
    """The targets of the Markdown links and images of a text, code blocks and inline code left out."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    source = ROOT / page
    relative = [link for link in links(text(page)) if not re.match(r"[a-z]+:", link)]
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{page}: {link} names no file"
        if anchor:
            assert target.suffix == ".md", f"{page}: {link} has an anchor in a file that is not a page"
            assert anchor in anchors(target), f"{page}: {link} names no heading of {target.name}"


def test_the_links_of_the_readme_are_found():
    # The link checker's reading of a page: the README's links to docs/ pages, images and anchors are all found.
    found = links(text("README.md"))
    assert (
        "docs/index.md" in found and "#on-a-fresh-machine" in found and "docs/training.md#fine-tune-with-lora" in found
    )
    assert "src/diffusers_lmlp/shapes/assets/pipeline/samples.png" in found


def test_the_docs_index_lists_every_page():
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", text("docs/index.md")))
    assert listed == {path.name for path in (ROOT / "docs").glob("*.md")} - {"index.md"}


def test_the_readme_is_a_five_minute_read_with_a_table_of_contents():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 300
    contents = re.search(r"\*\*Contents:\*\*(.*?)\n\n", readme, flags=re.DOTALL).group(1)
    sections = [title for _, level, title in headings(readme) if level == 2]
    assert re.findall(r"\(#([\w-]+)\)", contents) == [github_anchor(title) for title in sections]


def test_the_gpu_page_ran_the_readme_main_command():
    # docs/speed-gpu.md ran the README's main job, which tests/test_first_minutes.py runs as written.
    main = text("README.md").split("<!-- main-command -->", 1)[1]
    [install_and_run] = blocks(main, "bash")[:1]
    [on_the_gpu] = blocks(section("docs/speed-gpu.md", "The README's main command, on the GPU"), "bash")
    assert on_the_gpu.strip() == install_and_run.strip().split(" && ")[-1]


def test_the_ablation_command_is_the_scripts_own():
    # Its options and values are the script's; tests/test_ablation_shapes.py runs the script end to end, shortened.
    spec = importlib.util.spec_from_file_location("ablation_shapes", ROOT / "benchmarks" / "ablation_shapes.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    [command] = [line for line in blocks("docs/ablation.md", "bash")[0].splitlines() if line.startswith("python")]
    argv = shlex.split(command.split("  #", 1)[0])
    assert argv[:2] == ["python", "benchmarks/ablation_shapes.py"]
    args, extra = ablation.parse_args(argv[2:])
    assert (args.output_dir, args.minutes_per_model, extra) == ("ablation-shapes", 3.0, [])


def percent(value: float) -> str:
    return f"{round(100 * value)}"


def test_the_shapes_quality_table_is_the_shipped_training_summary():
    summary = json.loads((PIPELINE_PATH / "training_summary.json").read_text(encoding="utf-8"))
    training = text("docs/training.md")
    columns = ["colour", "shape", "position", "size", "colour+position", "all"]
    for split, label in [("train", "32 training"), ("held-out", "all 32 held-out")]:
        [row] = re.findall(
            rf"^ *\| {label} \| (.*) \|$",
            section("docs/training.md", "The shapes preset: the main job"),
            flags=re.MULTILINE,
        )
        images, *cells = [cell.strip() for cell in row.split("|")]
        seeds = summary["images_per_caption"][split]
        assert images == f"{summary['shapes_fid'][split]['num_images']} ({seeds} seeds each)"
        expected = [
            f"{percent(summary['scores'][split][c])}% ({'-'.join(map(percent, summary['score_intervals'][split][c]))})"
            for c in columns
        ]
        assert cells == expected, split
    # The run's steps and training time, in the README and docs/training.md.
    minutes, seconds = divmod(round(summary["train_seconds"]), 60)
    assert re.search(rf"of which 8 min\s+{seconds} s of training", training) and minutes == 8
    steps = f"{summary['steps']:,}"
    assert f"{steps} steps of batch 64" in training and f"for {steps} steps" in " ".join(text("README.md").split())


def test_the_shapes_models_size_is_the_shipped_ones():
    from diffusers_lmlp.shapes import pretrained_shapes_pipeline

    params = sum(p.numel() for p in pretrained_shapes_pipeline().transformer.parameters())
    for page in ("README.md", "docs/training.md"):
        assert f"a UL-MLP with {params / 1e6:.2f} M parameters" in " ".join(text(page).split())


def test_the_named_configurations_sizes_and_costs_are_the_codes():
    from diffusers_lmlp import from_named_config
    from diffusers_lmlp.complexity import analytic_complexity

    table = section("docs/backbones.md", "Block families and the papers' named configurations")
    rows = re.findall(r"^\| ([^|]+) \| [^|]+ \| ([\d, /]+(?: each)?) \| ([\d. /]+) G \|$", table, flags=re.MULTILINE)
    assert len(rows) == 12
    checked = set()
    for names, params, macs in rows:
        names = re.split(r", | / ", names.replace(" (the default)", ""))
        params = params.replace(" each", "").split(" / ")
        macs = macs.split(" / ")
        for index, name in enumerate(names):
            with torch.device("meta"):
                cost = analytic_complexity(from_named_config(name))
            assert f"{cost.params:,}" == params[index if len(params) > 1 else 0], name
            assert f"{cost.macs / 1e9:.2f}" == macs[index if len(macs) > 1 else 0], name
            checked.add(name)
    assert {"F2-deep", "U-ViT-S/2", "4E2H", "A2"} <= checked
    # The README's parameter count of the default model.
    [stated] = re.findall(r"\*\*F2-deep\*\*: ([\d,]+) parameters", text("README.md"))
    with torch.device("meta"):
        assert stated == f"{analytic_complexity(from_named_config('F2-deep')).params:,}"
