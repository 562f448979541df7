"""`--preset emoji`: the trainer on the emoji world (a tiny slice and backbone) and its scores."""

import json
import shlex

import pytest
from documents import blocks, text

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.emoji.scorer import FLAGS
from diffusers_lmlp.emoji.world import VALIDATION_PROMPTS


TINY = ["--max_train_steps", "2", "--max_train_samples", "64", "--model_overrides", "hidden_size=32", "num_layers=2",
        "--validation_steps", "2", "--checkpointing_steps", "2", "--validation_inference_steps", "2",
        "--final_evaluation_inference_steps", "2", "--torch_compile", "no", "--report_to", "none"]  # fmt: skip


@pytest.mark.slow
def test_the_readme_emoji_command_trains_the_world_and_ends_with_its_scores(script, tmp_path, capsys):
    # The README's command, run by the script's main in this process, with a tiny slice, backbone and sampler.
    pages = [blocks(text(page), "bash") for page in ("README.md", "docs/emoji.md")]
    [command] = {block.strip() for page in pages for block in page if "--preset emoji" in block}
    argv, launcher = shlex.split(command), "accelerate launch --config_file examples/accelerate.yaml"
    assert argv[:5] == [*launcher.split(), "examples/train_text_to_image.py"]
    out = tmp_path / "lmlp-emoji"
    script.main([*argv[5:], *TINY, "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache")])
    summary = json.loads((out / "training_summary.json").read_text(encoding="utf-8"))
    assert summary["world"] == "emoji" and summary["sample_prompts"] == list(VALIDATION_PROMPTS)
    assert list(summary["scores"]) == ["train", "held-out"] and set(summary["scores"]["held-out"]) == set(FLAGS)
    # Every held-out tone variant twice, as many training names twice; emoji-FID with its floor, and the CLIP score.
    fid = {split: (fid["num_images"], fid["fid_floor"] > 0) for split, fid in summary["emoji_fid"].items()}
    assert fid == {"train": (324, True), "held-out": (324, True)} and set(summary["clip_score"]) == set(fid)
    [record] = [json.loads(line) for line in (out / "logs" / "scores.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and set(record["held-out"]) == set(FLAGS)
    printed = capsys.readouterr().out
    assert "emoji-FID" in printed and "CLIP score" in printed and "pixel top-5" in printed
    assert "the emoji world" in (out / "README.md").read_text(encoding="utf-8")
    pipe = LMLPPipeline.from_pretrained(out)
    assert pipe.tokenizer.model_max_length == pipe.transformer.config.text_seq_len == 25
    assert pipe.transformer.config.text_embed_dim == pipe.text_encoder.config.hidden_size
