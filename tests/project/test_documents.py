"""The README and docs/ as a whole: command blocks run by named tests, links, a short README, the stated numbers."""

import ast
import functools
import json
import math
import re
import unicodedata
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark
from documents import COMMAND_LANGUAGES, PAGES, ROOT, blocks, headings, prose, section, text
from safetensors import safe_open

from diffusers_lmlp import LMLPPipeline, from_named_config, known_words
from diffusers_lmlp.analysis.metrics import noise_band, token_mixing_measures
from diffusers_lmlp.analysis.regions import TokenRegions
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.emoji.scorer import PIPELINE_PATH as EMOJI_PIPELINE_PATH
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.training.components import add_lora, lora_config


# Each command block, in page order ("page: a line it holds"), then the tests under tests/ that run it; a new, moved
# or reordered block fails test_every_command_block_is_run_by_a_test.
COVERAGE = """
README.md: pip install -e ".[train]" && accelerate launch
    training/test_first_minutes.py::test_readme_main_command_is_quiet_logs_plain_progress_and_ends_with_the_summary
    project/test_readme.py::test_readme_commands_pin_torch_first  # and .ci/run installs with it
README.md: pip install -e ".[test]" && python -m pytest -q
    project/test_readme.py::test_readme_commands_pin_torch_first  # .ci/run runs it
README.md: --preset emoji
    training/test_train_emoji.py::test_the_readme_emoji_command_trains_the_world_and_ends_with_its_scores
README.md: python -m diffusers_lmlp.evaluation --pipeline shapes
    evaluation/test_evaluation_readme.py::test_readme_has_the_evaluation_commands  # it is docs/evaluation.md's
    evaluation/test_evaluation_readme.py::test_the_shapes_command_runs_offline_with_the_documented_defaults
README.md: --model <user>/lmlp-emoji <user>/lmlp-shapes
    project/test_readme.py::test_hub_dry_run_commands_run_as_written  # each push is a dry run without the dry
README.md: python benchmarks/roofline.py
    benchmarks/test_roofline.py::test_the_pages_print_the_scripts_estimate
README.md: ruff check . && ruff format --check .
    project/test_readme.py::test_development_command_lints_clean
docs/hub.md: --dry-run --output-dir lmlp-shapes-upload
    project/test_readme.py::test_hub_dry_run_commands_run_as_written
docs/hub.md: --with-code --dry-run --output-dir lmlp-shapes-code-upload
    project/test_readme.py::test_hub_dry_run_commands_run_as_written
docs/hub.md: --dry-run --output-dir lmlp-demo-upload
    project/test_readme.py::test_hub_dry_run_commands_run_as_written
docs/hub.md: LMLP_QUEUE_SIZE=8 LMLP_CONCURRENCY=2 python app.py
    project/test_readme_numbers.py::test_the_readme_runs_the_space_from_its_folder_with_the_apps_settings
    space/test_space.py::test_the_app_serves_on_the_threads_it_chose_and_says_why
docs/hub.md: python benchmarks/space_sampling.py --num_images 1 --rounds 9
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
    benchmarks/test_quantized_sampling_benchmark.py::test_a_short_run_times_the_apps_request_eager_and_frozen
docs/training.md: --decoder-from shapes-vae --latent-noise 0.4
    worlds/test_vae_script.py::test_the_documented_stages_train_the_decoder_alone_and_keep_the_latents
docs/training.md: --preset shapes-lora
    training/test_train_lora.py::test_the_documented_shapes_lora_preset_runs_offline_and_scores_before_and_after
docs/emoji.md: python scripts/build_emoji_world.py --size 64
    worlds/test_emoji.py::test_the_documented_build_commands_run_on_the_npm_layout
docs/emoji.md: python scripts/train_emoji_clip.py
    worlds/test_emoji.py::test_the_documented_command_writes_the_scorers_clip_and_the_pipelines_text_side
    worlds/test_vae_script.py::test_the_documented_emoji_vae_command_trains_on_the_training_pictures
docs/emoji.md: --pipeline emoji --captions emoji:heldout
    worlds/test_emoji.py::test_the_documented_emoji_evaluations_run_on_the_shipped_pipeline
docs/emoji.md: --preset emoji
    training/test_train_emoji.py::test_the_readme_emoji_command_trains_the_world_and_ends_with_its_scores
docs/coco.md: hf download openai/clip-vit-large-patch14
    training/test_train_coco.py::test_readme_downloads_are_the_files_the_run_reads_from_the_cache_or_as_local_folders
docs/coco.md: --num_machines 2 --machine_rank $MACHINE_RANK
    training/test_train_coco.py::test_readme_has_the_coco_commands
    training/test_train_coco.py::test_one_gpu_command_trains_from_the_default_ids_and_the_pipeline_samples
    training/test_train_coco.py::test_two_cpu_processes_train_together
    training/test_train_coco.py::test_two_machines_command_trains_as_one_run
docs/evaluation.md: python -m diffusers_lmlp.evaluation --pipeline shapes
    evaluation/test_evaluation_readme.py::test_the_shapes_command_runs_offline_with_the_documented_defaults
docs/evaluation.md: python benchmarks/scorer_agreement.py
    benchmarks/test_scorer_agreement.py::test_the_documented_command_samples_scores_and_writes_its_results
docs/evaluation.md: --fid_reference coco2014/val2014
    evaluation/test_evaluation_readme.py::test_coco_fid_and_clip_score_against_the_published_statistics
    evaluation/test_evaluation_readme.py::test_coco_fid_against_the_val_images_themselves_equals_the_published_statistics
docs/analysis.md: python -m diffusers_lmlp.analysis lateralization
    evaluation/test_analysis.py::test_the_readme_command_draws_the_shipped_model_as_docs_show_it
    evaluation/test_analysis.py::test_every_documented_command_runs_as_written
docs/analysis.md: --pipeline uvit-shapes
    evaluation/test_analysis.py::test_every_documented_command_runs_as_written
docs/benchmarks.md: python benchmarks/speed_vs_uvit.py --precisions fp32
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
    benchmarks/test_speed_benchmark.py::test_the_documented_command_runs
docs/benchmarks.md: python benchmarks/profile_passes.py --models U-ViT-S/2 F2-deep --mode eager
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
    benchmarks/test_profile_passes.py::test_the_documented_command_profiles_each_pass_and_counts_every_gemm
docs/benchmarks.md: python benchmarks/trainer_overhead.py --torch_compile yes
    benchmarks/test_trainer_overhead.py::test_the_documented_command_times_the_trainer_beside_a_bare_step
docs/speed-gpu.md: examples/train_text_to_image.py
    project/test_documents.py::test_the_gpu_page_ran_the_readme_main_command
    training/test_first_minutes.py::test_readme_main_command_is_quiet_logs_plain_progress_and_ends_with_the_summary
docs/speed-gpu.md: python benchmarks/speed_vs_uvit.py --device cuda
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
docs/speed-gpu.md: python benchmarks/roofline.py
    benchmarks/test_roofline.py::test_the_pages_print_the_scripts_estimate
docs/speed-gpu.md: python benchmarks/gpu_check.py --device cpu --quick
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
    benchmarks/test_gpu_check.py::test_the_quick_check_runs_every_part_but_emoji_on_a_cpu
docs/speed-gpu.md: python benchmarks/profile_passes.py --device cuda --precision bf16 --mode regional
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
docs/ablation.md: python benchmarks/ablation_shapes.py --output_dir ablation-shapes
    benchmarks/test_arguments.py::test_every_documented_command_is_one_the_script_takes
    benchmarks/test_ablation_shapes.py::test_an_entry_trains_scores_and_resumes_end_to_end_beside_a_finished_one
"""


def test_every_page_in_docs_is_one_the_tests_read_and_the_docs_index_lists():
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert sorted(PAGES) == sorted(["README.md", *(f"docs/{name}" for name in pages)])
    assert set(re.findall(r"\]\(([\w.-]+\.md)\)", text("docs/index.md"))) == pages - {"index.md"}


def test_every_command_block_is_run_by_a_test():
    # Both by (page, the block's index among the page's command blocks): its code, and (a line it holds, its tests).
    language = f"(?:{'|'.join(COMMAND_LANGUAGES)})"
    found = {(page, index): code for page in PAGES for index, code in enumerate(blocks(page, language))}
    registered = {}
    for page, held, listed in re.findall(r"^(\S+): (.*)\n((?: .*\n)*)", COVERAGE, flags=re.MULTILINE):
        tests = ["tests/" + line.split("  #", 1)[0].strip() for line in listed.splitlines()]
        registered[page, sum(key[0] == page for key in registered)] = held, tests
    assert sorted(found) == sorted(registered), "enter each new or moved command block in COVERAGE"
    for key, (line, tests) in registered.items():
        assert line in found[key], f"{key} no longer holds {line!r}: update COVERAGE"
        assert tests, key
        for test in tests:
            path, name = test.split("::")
            tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
            assert name in {getattr(node, "name", None) for node in tree.body}, f"{test} does not exist"


def github_anchor(title: str) -> str:
    """The #anchor GitHub gives a heading: lower case, punctuation dropped, spaces made hyphens."""
    title = re.sub(r"`|\*\*", "", title).strip().lower()
    kept = "".join(c for c in title if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:  # a repeated heading's anchor gets -1, -2, ...
    titles = [github_anchor(title) for _, _, title in headings(page.read_text(encoding="utf-8"))]
    return {f"{a}-{titles[:i].count(a)}" if a in titles[:i] else a for i, a in enumerate(titles)}


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    # The targets of the page's Markdown links and images, code blocks and inline code left out.
    outside_code = re.sub(r"^( *)```.*?^\1```", "", text(page), flags=re.DOTALL | re.MULTILINE)
    source, found = ROOT / page, re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", outside_code))
    if page == "README.md":  # links to docs/ pages, images and anchors are found
        readme = {"docs/index.md", "#on-a-fresh-machine", "docs/training.md#fine-tune-with-lora"}
        assert readme | {"src/diffusers_lmlp/shapes/assets/pipeline/samples.png"} <= set(found)
    for link in [link for link in found if not re.match(r"[a-z]+:", link)]:
        path, _, anchor = link.partition("#")
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{page}: {link} names no file"
        if anchor:
            assert target.suffix == ".md", f"{page}: {link} has an anchor in a file that is not a page"
            assert anchor in anchors(target), f"{page}: {link} names no heading of {target.name}"


def test_the_readme_is_a_five_minute_read_with_a_table_of_contents():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 300
    contents = re.search(r"\*\*Contents:\*\*(.*?)\n\n", readme, flags=re.DOTALL).group(1)
    sections = [title for _, level, title in headings(readme) if level == 2]
    assert re.findall(r"\(#([\w-]+)\)", contents) == [github_anchor(title) for title in sections]


def test_the_gpu_page_ran_the_readme_main_command():  # which tests/training/test_first_minutes.py runs
    install_and_run = blocks(text("README.md").split("<!-- main-command -->", 1)[1], "bash")[0]
    [on_the_gpu] = blocks(section("docs/speed-gpu.md", "The README's main command, on the GPU"), "bash")
    assert on_the_gpu.strip() == install_and_run.strip().split(" && ")[-1]


def test_the_shapes_quality_table_is_the_shipped_training_summary():
    summary = json.loads((PIPELINE_PATH / "training_summary.json").read_text(encoding="utf-8"))
    training, table = text("docs/training.md"), section("docs/training.md", "The shapes preset: the main job")
    columns = ["colour", "shape", "position", "size", "colour+position", "all"]
    for split, label in [("train", "32 training"), ("held-out", "all 32 held-out")]:
        [row] = re.findall(rf"^ *\| {label} \| (.*) \|$", table, flags=re.MULTILINE)
        images, *cells = [cell.strip() for cell in row.split("|")]
        seeds, scores, intervals = (summary[key][split] for key in ("images_per_caption", "scores", "score_intervals"))
        assert images == f"{summary['shapes_fid'][split]['num_images']} ({seeds} seeds each)"
        assert cells == [f"{scores[c]:.0%} ({'-'.join(f'{100 * v:.0f}' for v in intervals[c])})" for c in columns]
    # The run's steps and training time, in the README and docs/training.md.
    minutes, seconds = divmod(round(summary["train_seconds"]), 60)
    assert re.search(rf"of which {minutes} min\s+{seconds} s of training", training)
    steps = f"{summary['steps']:,}"
    assert f"{steps} steps of batch 64" in training and f"for {steps} steps" in prose("README.md")


def test_the_emoji_quality_table_is_the_shipped_training_summary():
    summary = json.loads((EMOJI_PIPELINE_PATH / "training_summary.json").read_text(encoding="utf-8"))
    scores, fid = summary["scores"], summary["emoji_fid"]
    for page, title in [("README.md", "Draw real pictures: the emoji world"), ("docs/emoji.md", "The preset")]:
        for split, label in [("train", "162 training"), ("held-out", "the 162 held-out tone variants")]:
            [row] = re.findall(rf"^\| {label} \| (.*) \|$", section(page, title), flags=re.MULTILINE)
            s = scores[split]  # each name's score / its pixel scorer's, then the FID (its floor)
            expected = [f"{s[n]:.0%} / {s['pixel ' + n]:.0%}" for n in ("top-5", "top-1", "tone")]
            expected.append(f"{fid[split]['fid']:.3f} ({fid[split]['fid_floor']:.3f})")
            assert [cell.strip() for cell in row.split("|")] == expected, (page, split)
        assert summary["images_per_caption"] == {"train": 2, "held-out": 2} and "two seeds per name" in prose(page)
    params = sum(p.numel() for p in LMLPPipeline.from_pretrained(EMOJI_PIPELINE_PATH).transformer.parameters())
    assert f"(`emoji-S`, {params / 1e6:.1f} M parameters)" in prose("README.md")
    assert f"{summary['steps']:,} steps" in prose("docs/emoji.md")


def test_the_shapes_models_size_layout_vae_and_vocabulary_are_the_shipped_ones():
    pipe, training = pretrained_shapes_pipeline(), prose("docs/training.md")
    params = sum(p.numel() for p in pipe.transformer.parameters())
    for page in (prose("README.md"), training):
        assert f"a UL-MLP with {params / 1e6:.2f} M parameters" in page
    assert f"(`shapes-S` with the caption projection below, {params:,} parameters)" in prose("docs/shapes-runs.md")
    # The ablation and the H100 run trained the named configuration, the papers' layout without the projection.
    with torch.device("meta"):
        named = sum(p.numel() for p in from_named_config("shapes-S").parameters())
    assert named < params and f"`shapes-S`'s {named:,} parameters" in prose("docs/ablation.md")
    assert f"the {named / 1e6:.2f}M-parameter model" in prose("docs/speed-gpu.md")
    # The layout of its shipped config, its VAE's size (the weights file) and its tokenizer's vocabulary.
    config = json.loads((PIPELINE_PATH / "transformer" / "config.json").read_text(encoding="utf-8"))
    grid, words = config["sample_size"] // config["patch_size"], config["text_seq_len"]
    tokens, width, depth = 1 + words + grid**2, config["hidden_size"], config["num_layers"]
    layers = f"(D = {width}, {depth} + 1 layers, {tokens} tokens: 1 time, {words} text, {grid**2} image)"
    layout = f"{words} text and {grid**2} image tokens on a {grid} × {grid} grid; D = {width}; {depth + 1} blocks)"
    assert layers in training and f"(L = {tokens}: 1 time, {layout}" in prose("docs/analysis.md")
    weights = PIPELINE_PATH / "vae" / "diffusion_pytorch_model.safetensors"
    with safe_open(weights, "pt") as tensors:
        vae = sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    assert f"The shipped VAE has {vae:,} parameters ({weights.stat().st_size / 1e6:.1f} MB)" in training
    [vocabulary] = re.findall(r"an offline CLIP tokenizer over the world's (\d+) words", text("docs/training.md"))
    assert int(vocabulary) == len(known_words(pipe.tokenizer))


def test_the_lora_sizes_are_the_trainers():
    # F2-deep's at rank 8, and the shapes model's as the trainer logs them (as a share of the frozen backbone's).
    def adapted(model) -> tuple[int, int, int]:  # the layers adapted at rank 8, the base's and the trainable params
        base = sum(p.numel() for p in model.parameters())
        layers = add_lora(model, lora_config(model, rank=8, alpha=None, dropout=0.0, target_modules=None))
        return len(layers), base, sum(p.numel() for p in model.parameters() if p.requires_grad)

    with torch.device("meta"):
        _, base, trainable = adapted(from_named_config("F2-deep"))
    page = prose("docs/training.md")
    assert f"at rank 8, F2-deep gets {trainable / 1e6:.2f} M, {trainable / base:.1%} of its {base / 1e6:.0f} M" in page
    layers, base, trainable = adapted(pretrained_shapes_pipeline().transformer)
    logged = f"{layers} layers, {trainable:,} parameters ({trainable / base:.1%} of this small backbone"
    assert f"token mixers included: {logged}" in page


def test_the_ablation_tables_sizes_and_costs_are_the_scripts_plan():
    # The columns fixed before any training (entry, family, D, params, Δ params, MMACs/sample) are the script's plan.
    ablation = load_benchmark("ablation_shapes")
    target = ablation.reference_params()
    lines = [line for line in text("docs/ablation.md").splitlines() if re.match(r"\| [\w-]+ \| ", line)]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert rows[0][0] == "entry" and [row[0] for row in rows[1:]] == ablation.default_entries()
    for row in rows[1:]:
        planned = ablation.table_row(ablation.plan_entry(row[0], target), target)
        assert row[:6] == list(planned[:6]), row[0]


def test_the_coco_feature_store_sizes_are_the_benchmarks_formula(capsys):
    load_benchmark("feature_store_memory").coco()
    printed = capsys.readouterr().out
    [images] = re.findall(r"train2014 \(([\d,]+) images", printed)
    table = section("docs/coco.md", "The feature store")
    assert f"| | per image (5 captions) | train2014 ({images} images) |" in table
    labels = {"float32": "text states in float32 (default)", "float16": "`--cache_text_dtype float16`"}
    computed = re.findall(r"^\| (float\d+) \| [^|]* = ([\d,]+) B \| ([\d.]+ GB) \|$", printed, flags=re.MULTILINE)
    assert [dtype for dtype, _, _ in computed] == list(labels)
    for dtype, per_image, total in computed:  # the bytes per image, in MiB
        assert f"| {labels[dtype]} | {int(per_image.replace(',', '')) / 2**20:.2f} MiB | {total} |" in table, dtype


def test_the_flops_the_speed_pages_compare_are_the_codes():
    with torch.device("meta"):
        models = {name: from_named_config(name) for name in ("F2-deep", "U-ViT-S/2", "F2")}
        macs = {name: complexity(model).macs for name, model in models.items()}
    # One image forward: 2 FLOPs a multiply-add.
    flops = f"{2 * macs['F2-deep'] / 1e9:.1f} and {2 * macs['U-ViT-S/2'] / 1e9:.1f} GFLOP per image forward"
    assert flops in prose("docs/benchmarks.md") and flops in prose("docs/speed-gpu.md")
    fewer = round(100 * (1 - macs["F2"] / macs["F2-deep"]))
    width = models["F2"].stack.in_blocks[0].joint_mlp.fc1.out_features
    assert f"despite {fewer}% fewer FLOPs. Its joint MLP is {width:,} wide" in prose("docs/benchmarks.md")


def test_the_analysis_findings_are_the_printed_measures():
    # docs/analysis.md's table (as the command prints it): each layer's measures, then the noise bands; its findings.
    [table] = blocks("docs/analysis.md", "text")
    measured, names = {"left": {}, "right": {}}, ("diagonal", "locality", "periodicity", "mean_abs")
    pattern = r"^(\d+)\s+\S+\s+(left|right)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$"
    for layer, side, *values in re.findall(pattern, table, flags=re.MULTILINE):
        measured[side][int(layer)] = {name: float(value) for name, value in zip(names, values) if value != "–"}
    left, right = measured["left"], measured["right"]
    left_band, right_band = (
        {name: (float(low), float(high)) for name, low, high in re.findall(r"(\w+) (-?[\d.]+) to (-?[\d.]+)", part)}
        for part in table.split("95% of 200 draws: ", 1)[1].split("; right: ")
    )
    assert sorted(left) == sorted(right) == list(range(1, 10))
    page = prose("docs/analysis.md")

    def span(values) -> str:
        return f"{min(values):.2f}–{max(values):.2f}"

    def layers(numbers) -> str:
        *rest, last = numbers
        return f"layers {', '.join(map(str, rest))} and {last}" if rest else f"layer {last}"

    def outside(measures, name, band) -> tuple[list[int], list[int]]:  # the layers above the band, and below it
        (low, high), values = band[name], {layer: measures[layer][name] for layer in measures}
        return [n for n, v in values.items() if v > high], [n for n, v in values.items() if v < low]

    (diagonal_low, diagonal_high), (low, high) = left_band["diagonal"], left_band["periodicity"]
    assert f"it is {diagonal_low:.2f}–{diagonal_high:.2f} for the diagonal and −{-low:.3f} to {high:.3f}" in page
    # 1. Periodicity: above the band, below it (the other sign), and the layers with neither.
    periodic, anti = outside(left, "periodicity", left_band)
    values = [left[layer]["periodicity"] for layer in periodic]
    assert f"above the noise band in {len(periodic)} of the 9 layers ({span(values)}: {layers(periodic)})" in page
    negative = " and ".join(f"{left[layer]['periodicity']:.2f}".replace("-", "−") for layer in anti)
    assert f"below it in {layers(anti)} ({negative}:" in page
    assert f"In {layers(sorted(set(left) - set(periodic)))} there is no repeat" in page
    # 2. Locality, and the left diagonal.
    higher, lower = outside(left, "locality", left_band)
    assert f"in {len(higher) + len(lower)} of the 9 layers (locality outside {span(left_band['locality'])})" in page
    assert f"in {layers(higher)} ({span([left[layer]['locality'] for layer in higher])})" in page
    assert lower == [3] and f"in layer 3 with lower weights than distant patches ({left[3]['locality']:.2f}:" in page
    assert f"inside its band except in {layers(sorted(sum(outside(left, 'diagonal', left_band), [])))})" in page
    # 3. The right hemisphere's diagonal, and the most diagonal matrix of all.
    right_above, right_below = outside(right, "diagonal", right_band)
    ratios = " and ".join(f"{right[layer]['diagonal']:.2f}" for layer in right_above)
    sides_of_band = [f"above it in {layers(right_above)} ({ratios})"] if right_above else []
    sides_of_band += [f"below it in {layers(right_below)}"] if right_below else []
    leaves = f"leaves its (narrower) noise band in {len(right_above) + len(right_below)} of 9 layers"
    assert f"its diagonal ratio {leaves}, {' and '.join(sides_of_band)}," in page
    sides = {(side, layer): m for side in measured for layer, m in measured[side].items()}
    (side, layer), most = max(sides.items(), key=lambda item: item[1]["diagonal"])
    most = f"the {side} hemisphere's of layer {layer} ({most['diagonal']:.2f})"
    assert f"the most diagonal matrix of all is {most}" in page
    # 4. Mean |w|, highest in the middle layers: every layer within 5% of the largest, none the first or last ones.
    mean_left, mean_right = ({n: m["mean_abs"] for n, m in side.items()} for side in (left, right))
    top = sorted(layer for layer, mean in mean_left.items() if mean >= 0.95 * max(mean_left.values()))
    assert 4 <= min(top) and max(top) <= 8
    peak = f"{min(mean_left[layer] for layer in top):.3f}–{max(mean_left[layer] for layer in top):.3f}"
    rises = f"rises from {mean_left[1]:.3f} (layer 1) to {peak} ({layers(top)})"
    assert f"left hemisphere {rises} and falls to {mean_left[9]:.3f} (layer 9)" in page
    middle = max(mean_right[layer] for layer in (3, 4, 5))
    rises = f"rises from {mean_right[1]:.3f} to {middle:.3f} (layers 3–5) and falls to {mean_right[9]:.3f}."
    assert middle == max(mean_right.values()) and f"the right one {rises}" in page
    # 5. The scale of the initial weights it compares them with.
    torch.manual_seed(0)
    named = from_named_config("shapes-S").named_parameters()
    initial = torch.cat([p.detach().flatten() for name, p in named if name.endswith("left.weight")])
    assert f"initialised with mean |w| ≈ {initial.abs().mean():.3f} (truncated" in page


@pytest.mark.slow  # about 20 s: 200 Gaussian 334 × 334 matrices, measured as the command measures F2-deep
def test_the_full_size_noise_band_is_the_codes():
    with torch.device("meta"):
        regions = TokenRegions.from_config(from_named_config("F2-deep").config)
    band = noise_band(functools.partial(token_mixing_measures, regions=regions), regions.seq_len)
    (low, high), periodicity = band["diagonal"], max(abs(bound) for bound in band["periodicity"])
    assert f"for L = {regions.seq_len}, {low:.2f}–{high:.2f} and ±{periodicity:.3f}" in prose("docs/analysis.md")


@pytest.mark.slow  # builds every named configuration on meta and counts its FLOPs (about 6 s)
def test_the_named_configurations_sizes_and_costs_are_the_codes():
    table = section("docs/backbones.md", "Block families and the papers' named configurations")
    rows = re.findall(r"^\| ([^|]+) \| [^|]+ \| ([\d, /]+(?: each)?) \| ([\d. /]+) G \|$", table, flags=re.MULTILINE)
    assert len(rows) == 12
    checked = {}
    for names, params, macs in rows:
        params, macs = params.replace(" each", "").split(" / "), macs.split(" / ")
        for index, name in enumerate(re.split(r", | / ", names.replace(" (the default)", ""))):
            with torch.device("meta"):
                cost = checked[name] = complexity(from_named_config(name))
            stated = (params[index if len(params) > 1 else 0], macs[index if len(macs) > 1 else 0])
            assert (f"{cost.params:,}", f"{cost.macs / 1e9:.2f}") == stated, name
    assert {"F2-deep", "U-ViT-S/2", "4E2H", "A2"} <= set(checked)
    # The README's parameter count of the default model, and what docs/backbones.md's example prints.
    f2, uvit, a2 = (checked[name].params for name in ("F2-deep", "U-ViT-S/2", "A2"))
    assert re.findall(r"\*\*F2-deep\*\*: ([\d,]+) parameters", text("README.md")) == [f"{f2:,}"]
    assert f"# {uvit:,} / {a2:,}" in text("docs/backbones.md")
