"""The card's usage snippet samples a prompt the model can read: with a closed vocabulary, one of its words, also when
the training recorded no sample captions."""

import re

import pytest

from diffusers_lmlp import unknown_words
from diffusers_lmlp.hub import stage_pipeline, write_model_card
from diffusers_lmlp.hub.card import GENERIC_PROMPT, POOLED_TEXT_PROJECTION
from diffusers_lmlp.shapes import pretrained_shapes_pipeline


@pytest.mark.parametrize("how", ["write_model_card", "hub push"])
def test_a_closed_vocabulary_card_without_sample_captions_samples_words_the_model_knows(how, tmp_path):
    pipe = pretrained_shapes_pipeline()
    assert unknown_words(pipe.tokenizer, GENERIC_PROMPT)  # the generic prompt would be noise to this model
    pipe.save_pretrained(tmp_path / "shapes")
    if how == "write_model_card":
        text = write_model_card(tmp_path / "shapes", pipe).text
    else:  # a save_pretrained folder without a card or training summary, staged for a push
        staged = stage_pipeline(tmp_path / "shapes", "someone/shapes", tmp_path / "staged", sample_steps=2)
        text = (staged.folder / "README.md").read_text(encoding="utf-8")
    prompt = re.search(r'image = pipe\("([^"]*)"', text).group(1)
    assert prompt != GENERIC_PROMPT and unknown_words(pipe.tokenizer, prompt) == []


def test_the_card_names_the_caption_projection_only_where_the_backbone_has_it(tmp_path):
    pipe = pretrained_shapes_pipeline()  # the shapes preset has it; the papers' layout does not
    assert pipe.transformer.config.pooled_text_projection
    pipe.save_pretrained(tmp_path / "with")
    text = write_model_card(tmp_path / "with", pipe).text
    assert next(line for line in text.splitlines() if line.startswith("- Backbone:")).endswith(POOLED_TEXT_PROJECTION)
    config = {**pipe.transformer.config, "pooled_text_projection": False}
    pipe.transformer = type(pipe.transformer).from_config(config)
    pipe.save_pretrained(tmp_path / "without")
    assert "pooled_text_projection" not in write_model_card(tmp_path / "without", pipe).text
