"""The model card's usage snippet samples a prompt the model can read: with a closed vocabulary, one made of its
words, also when the training recorded no sample captions (a pipeline saved with `save_pretrained` and pushed)."""

import re

from diffusers_lmlp import unknown_words
from diffusers_lmlp.hub import write_model_card
from diffusers_lmlp.hub.card import GENERIC_PROMPT, example_prompt
from diffusers_lmlp.shapes import pretrained_shapes_pipeline


def snippet_prompt(card_text: str) -> str:
    return re.search(r'image = pipe\("([^"]*)"', card_text).group(1)


def test_a_closed_vocabulary_card_without_sample_captions_samples_words_the_model_knows(tmp_path):
    pipe = pretrained_shapes_pipeline()
    assert unknown_words(pipe.tokenizer, GENERIC_PROMPT)  # the generic prompt would be noise to this model
    pipe.save_pretrained(tmp_path / "shapes")
    prompt = snippet_prompt(write_model_card(tmp_path / "shapes", pipe).text)
    assert prompt != GENERIC_PROMPT and unknown_words(pipe.tokenizer, prompt) == []


def test_recorded_sample_captions_come_first_and_an_open_vocabulary_keeps_the_generic_prompt():
    pipe = pretrained_shapes_pipeline()
    summary = {"sample_prompts": ["a big blue square in the centre"]}
    assert example_prompt(summary, pipe.tokenizer) == "a big blue square in the centre"
    assert example_prompt({}, None) == GENERIC_PROMPT  # no tokenizer known: nothing to keep to


def test_a_pushed_closed_vocabulary_pipeline_gets_a_card_whose_prompt_it_knows(tmp_path):
    # `hub push` of a folder without a card or training summary (save_pretrained's output): the staged card's
    # snippet keeps to the tokenizer's words.
    from diffusers_lmlp.hub import stage_pipeline

    pipe = pretrained_shapes_pipeline()
    pipe.save_pretrained(tmp_path / "shapes")
    staged = stage_pipeline(tmp_path / "shapes", "someone/shapes", tmp_path / "staged", sample_steps=2)
    prompt = snippet_prompt((staged.folder / "README.md").read_text(encoding="utf-8"))
    assert prompt != GENERIC_PROMPT and unknown_words(pipe.tokenizer, prompt) == []


def test_the_card_names_the_caption_projection_only_where_the_backbone_has_it(tmp_path):
    # The shipped model has it (the shapes preset); the papers' layout does not.
    from diffusers_lmlp.hub.card import POOLED_TEXT_PROJECTION

    pipe = pretrained_shapes_pipeline()
    assert pipe.transformer.config.pooled_text_projection
    pipe.save_pretrained(tmp_path / "with")
    backbone_line = "\n".join(
        line for line in write_model_card(tmp_path / "with", pipe).text.splitlines() if line.startswith("- Backbone:")
    )
    assert backbone_line.endswith(POOLED_TEXT_PROJECTION)
    config = {**pipe.transformer.config, "pooled_text_projection": False}
    pipe.transformer = type(pipe.transformer).from_config(config)  # the papers' layout, weights aside
    pipe.save_pretrained(tmp_path / "without")
    assert "pooled_text_projection" not in write_model_card(tmp_path / "without", pipe).text
