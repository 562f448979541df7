"""scripts/train_emoji_clip.py as docs/emoji.md runs it (tiny CLIP), and the world tokenizer's whole words."""

import shlex
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark
from documents import blocks, section
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp.emoji import EmojiScorer, load_emoji
from diffusers_lmlp.emoji.scorer import TEXT_SEQ_LEN


ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "2", "--batch-size", "8", "--width", "16", "--layers", "1"]


@pytest.fixture(scope="module")
def script():
    return load_benchmark("train_emoji_clip", "scripts")


@pytest.mark.slow
def test_the_documented_command_writes_the_scorers_clip_and_the_pipelines_text_side(script, tmp_path, capsys):
    [block] = blocks(section("docs/emoji.md", "The components, trained on the world"), "bash")
    argv = shlex.split(block.strip().splitlines()[0])
    assert argv[:2] == ["python", "scripts/train_emoji_clip.py"]
    clip, pipeline = tmp_path / "clip", tmp_path / "pipeline"
    script.main([*argv[2:], *TINY, "--output-dir", str(clip), "--pipeline-dir", str(pipeline)])
    assert "plain names to pictures among all 3,786" in capsys.readouterr().out
    scorer = EmojiScorer.from_pretrained(clip)  # safetensors, with its processor
    text_encoder = CLIPTextModel.from_pretrained(pipeline / "text_encoder", use_safetensors=True)
    tokenizer = CLIPTokenizer.from_pretrained(pipeline / "tokenizer")
    ids = tokenizer(["red apple"], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():  # the pipeline's text tower is the CLIP's
        ours = text_encoder(ids).last_hidden_state
        theirs = scorer.clip.model.text_model(ids).last_hidden_state
    torch.testing.assert_close(ours, theirs)


def test_the_world_tokenizer_reads_each_word_as_one_token_and_every_phrasing_fits():
    tokenizer = CLIPTokenizer.from_pretrained(ROOT / "src/diffusers_lmlp/emoji/assets/pipeline/tokenizer")
    assert tokenizer.model_max_length == TEXT_SEQ_LEN
    captions = [caption for emoji in load_emoji() for caption in emoji.captions]
    lengths = [len(ids) for ids in tokenizer(captions).input_ids]
    assert max(lengths) <= TEXT_SEQ_LEN
    assert tokenizer.tokenize("extraterrestrial alien") == ["extraterrestrial</w>", "alien</w>"]
    assert tokenizer.tokenize("são tomé") == ["sÃ£o</w>", "tomÃ©</w>"]  # whole words in UTF-8 bytes too
