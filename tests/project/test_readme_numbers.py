"""What the README and docs/ state about the code (prompts, progress lines, limits, the Space, options), checked."""

import ast
import re
from pathlib import Path

import pytest
from accelerate.commands.launch import launch_command_parser
from benchmark_scripts import load_benchmark
from documents import ROOT, blocks, section
from documents import text as page_text
from PIL import Image
from test_readme import PYTHON_BLOCKS, stand_ins

from diffusers_lmlp import unknown_words
from diffusers_lmlp.evaluation.__main__ import PARTIAL_REPORT, PROGRESS_FOLDER
from diffusers_lmlp.evaluation.__main__ import build_parser as evaluation_parser
from diffusers_lmlp.hub.space import SPACE_FILE_LIMIT, SPACE_NAME, SPACE_TOTAL_LIMIT
from diffusers_lmlp.hub.upload import IMAGE_LIMIT, TEXT_LIMIT
from diffusers_lmlp.progress import LINE_EVERY_FRACTION, LINE_EVERY_SECONDS
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.training.arguments import DIFFUSERS_ONLY_OPTIONS
from diffusers_lmlp.training.arguments import build_parser as training_parser
from diffusers_lmlp.training.data import load_training_data


README = page_text("README.md")
SPACE_DIR = ROOT / "spaces" / SPACE_NAME


def stated(pattern: str, text: str = README) -> tuple[str, ...]:  # the one match's groups; a space: any whitespace
    [match] = re.finditer(pattern.replace(" ", r"\s+"), text)
    return match.groups()


def requirement_name(requirement: str) -> str:  # "peft>=0.20" -> "peft"
    return re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0)


def sampled_prompts(block: str) -> list[str]:
    """A block's non-empty prompts: `pipe(...)`'s (or a just loaded one's) first argument, `(negative_)prompt=`."""
    prompts = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Call):
            called = isinstance(node.func, ast.Call) or getattr(node.func, "id", None) == "pipe"
            prompts += [node.args[0]] if called and node.args else []
            prompts += [keyword.value for keyword in node.keywords if keyword.arg in ("prompt", "negative_prompt")]
        elif isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "prompt" for target in node.targets):
            prompts.append(node.value)
    return [node.value for node in prompts if isinstance(node, ast.Constant) and node.value]


def test_every_prompt_the_readme_samples_the_shapes_model_with_is_in_its_vocabulary():
    # The blocks test_readme.py runs on the shipped shapes model: with a placeholder, or loading it themselves.
    shapes = [*stand_ins("http://127.0.0.1:7860/", Path("lora"), Path("with-code")), "pretrained_shapes_pipeline()"]
    blocks = [block for block in PYTHON_BLOCKS if any(marker in block for marker in shapes)]
    prompts = [sampled_prompts(block) for block in blocks]
    assert len(blocks) >= 4 and all(prompts), "every such block samples a prompt this test reads"
    tokenizer = pretrained_shapes_pipeline().tokenizer
    assert {text: words for block in prompts for text in block if (words := unknown_words(tokenizer, text))} == {}


def test_the_progress_lines_and_files_the_pages_describe_are_the_codes():
    percent, period = stated(r"each write a plain line at every (\d+)% of their count, at least one (a minute),")
    assert int(percent) == round(100 * LINE_EVERY_FRACTION) and {"a minute": 60.0}[period] == LINE_EVERY_SECONDS
    page = page_text("docs/evaluation.md")  # the evaluation's progress folder and partial report
    assert f"`OUTPUT_DIR/{PROGRESS_FOLDER}`" in page and f"`{PARTIAL_REPORT}`" in page


def test_the_upload_size_limits_and_the_spaces_requirements_docs_hub_lists_are_the_codes():
    hub = page_text("docs/hub.md")
    mbs = stated(r"files other than weights over (\d+) MB \(images: (\d+) MB\)", hub)
    mbs += stated(r"A Space leaves out any file over (\d+) MB and is refused over (\d+) MB in all", hub)
    limits = (TEXT_LIMIT, IMAGE_LIMIT, SPACE_FILE_LIMIT, SPACE_TOTAL_LIMIT)
    assert [int(mb) * 10**6 for mb in mbs] == [limit for limit, _ in limits]
    [listed] = stated(r"`requirements.txt` \(([^)]+)\) and `README.md`", hub)
    lines = (SPACE_DIR / "requirements.txt").read_text(encoding="utf-8").splitlines()
    required = {requirement_name(line) for line in lines if line.strip() and not line.startswith("#")}
    assert set(listed.replace("\n", " ").split(", ")) == required


def test_the_readme_runs_the_space_from_its_folder_with_the_apps_settings():
    commands = blocks(section("docs/hub.md", "Run the Space locally"), "bash")[0]  # the first
    [folder] = re.findall(r"cd (\S+)", commands)
    assert (ROOT / folder).resolve() == SPACE_DIR.resolve() and (SPACE_DIR / "app.py").is_file()
    app = (SPACE_DIR / "app.py").read_text(encoding="utf-8")
    assigned = [node for node in ast.parse(app).body if isinstance(node, ast.Assign)]  # read without importing app
    constants = {getattr(node.targets[0], "id", None): getattr(node.value, "value", None) for node in assigned}
    variables = set(re.findall(r"\b(LMLP_[A-Z_]+)=", commands))  # each one the app reads
    names = {"LMLP_MODEL", "LMLP_QUEUE_SIZE", "LMLP_CONCURRENCY", constants["THREADS_VARIABLE"]}
    assert variables == names | {constants["FREEZE_VARIABLE"]} and all(f'"{name}"' in app for name in variables)
    # The example's values are those its comment describes, and the defaults are the app's.
    queue, concurrency = stated(r"LMLP_QUEUE_SIZE=(\d+) LMLP_CONCURRENCY=(\d+) python app.py", commands)
    described = stated(r"queue: (\d+) may wait \(default (\d+)\), (\d+) run at once \(default (\d+)\)", commands)
    defaults = [str(constants[f"DEFAULT_{name}"]) for name in ("QUEUE_SIZE", "CONCURRENCY")]
    assert described == (queue, defaults[0], concurrency, defaults[1])


def test_the_train_extra_of_the_main_command_is_setup_pys():
    main_command = README.split("<!-- main-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert 'pip install -e ".[train]"' in main_command
    [listed] = stated(r"`\.\[train\]` installs what the job needs \(([^)]+)\)")
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    _, extras = load_benchmark("lowest_requirements", "scripts").requirement_literals(setup)
    assert listed.split(", ") == [requirement_name(requirement) for requirement in extras["train"]]


def test_the_readme_metadata_example_is_an_imagefolder_the_trainer_reads(tmp_path):
    layouts = section("docs/data.md", "An imagefolder, a datasets repo, a COCO folder")
    [example] = re.findall(r"```json\n(.*?)```", layouts, flags=re.DOTALL)
    folder = tmp_path / "data"
    for name in re.findall(r'"file_name": "([^"]+)"', example):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), "red").save(folder / name)
    (folder / "metadata.jsonl").write_text(example, encoding="utf-8")
    dataset = load_training_data(
        dataset_name=None, dataset_config_name=None, train_data_dir=str(folder), image_column="image",
        caption_column="text", max_train_samples=None, streaming=False, seed=0, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert list(dataset["text"]) == re.findall(r'"text": "([^"]+)"', example)
    assert len(dataset) == 2 and all(image.size == (8, 8) for image in dataset["image"])


# The README's training and evaluation sections, and the pages that took over its former ones.
TITLES = ("Train on the shapes world", "Train on your own data and on COCO", "Evaluate")
SECTIONS = [("README.md", title) for title in TITLES] + [(f"docs/{name}.md", None) for name in ("training", "data")]
SECTIONS += [("docs/coco.md", None), ("docs/evaluation.md", None)]


@pytest.mark.parametrize("page, title", SECTIONS)
def test_every_option_the_readme_names_for_training_and_evaluation_exists(page, title):
    parsers = (training_parser(), evaluation_parser(), launch_command_parser())
    options = {option for parser in parsers for action in parser._actions for option in action.option_strings}
    options |= set(DIFFUSERS_ONLY_OPTIONS)  # diffusers' options, which the trainer answers with what to give instead
    # Benchmark commands quoted inline, and scripts/ commands, have options of their own.
    text = re.sub(r"`python benchmarks/[^`]*`", "", section(page, title) if title else page_text(page))
    text = re.sub(r"`python scripts/[^`]*`|^python scripts/.*$", "", text, flags=re.MULTILINE)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_]*(?![\w-])", text))  # not hub's --dash-options
    assert named and sorted(named - options) == []
