"""scripts/train_emoji_clip.py as docs/emoji.md runs it (tiny CLIP), and the world tokenizer's whole words."""

import shlex

import pytest
import torch
from documents import block
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp.emoji import EmojiScorer, load_emoji
from diffusers_lmlp.emoji.scorer import PIPELINE_PATH, TEXT_SEQ_LEN


SCRIPT = "train_emoji_clip"


@pytest.mark.slow
def test_the_documented_command_writes_the_scorers_clip_and_the_pipelines_text_side(script, tmp_path, capsys):
    argv = shlex.split(block("docs/emoji.md", "The components, trained on the world").strip().splitlines()[0])
    assert argv[:2] == ["python", "scripts/train_emoji_clip.py"]
    clip, pipeline = tmp_path / "clip", tmp_path / "pipeline"
    tiny = ["--steps", "2", "--batch-size", "8", "--width", "16", "--layers", "1"]
    script.main([*argv[2:], *tiny, "--output-dir", str(clip), "--pipeline-dir", str(pipeline)])
    assert "plain names to pictures among all 3,786" in capsys.readouterr().out
    scorer = EmojiScorer.from_pretrained(clip)  # safetensors, with its processor
    text_encoder = CLIPTextModel.from_pretrained(pipeline / "text_encoder", use_safetensors=True)
    ids = CLIPTokenizer.from_pretrained(pipeline / "tokenizer")(
        ["red apple"], padding="max_length", return_tensors="pt"
    )
    with torch.no_grad():  # the pipeline's text tower is the CLIP's
        ours, theirs = text_encoder(ids.input_ids), scorer.clip.model.text_model(ids.input_ids)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)


def test_the_world_tokenizer_reads_each_word_as_one_token_and_every_phrasing_fits():
    tokenizer = CLIPTokenizer.from_pretrained(PIPELINE_PATH / "tokenizer")
    assert tokenizer.model_max_length == TEXT_SEQ_LEN
    captions = [caption for emoji in load_emoji() for caption in emoji.captions]
    assert max(len(ids) for ids in tokenizer(captions).input_ids) <= TEXT_SEQ_LEN
    assert tokenizer.tokenize("extraterrestrial alien") == ["extraterrestrial</w>", "alien</w>"]
    assert tokenizer.tokenize("são tomé") == ["sÃ£o</w>", "tomÃ©</w>"]  # whole words in UTF-8 bytes too
