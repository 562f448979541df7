"""Closed and open tokenizer vocabularies, and the pipeline's warning about prompt words outside a closed one."""

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import CLIPTokenizer

from diffusers_lmlp import LMLPPipeline, known_words, unknown_words
from diffusers_lmlp.pipelines import vocabulary
from diffusers_lmlp.pipelines.vocabulary import describe_vocabulary, prompt_words
from diffusers_lmlp.shapes import shapes_tokenizer
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.shapes.text import WORLD_WORDS
from diffusers_lmlp.tiny import TINY_VOCAB_WORDS, tiny_clip_text_encoder, tiny_clip_tokenizer


# As CLIP ViT-L/14's: "restaurant" is "re" + "staur" + "ant</w>", and "staur" begins no whole-word token.
SUBWORD_MERGES = [("s", "t"), ("st", "a"), ("sta", "u"), ("stau", "r"), ("a", "n"), ("an", "t</w>")]


def subword_tokenizer(folder: Path) -> CLIPTokenizer:
    """A CLIP-layout BPE whose merges build subword pieces: an open vocabulary, as CLIP's."""
    tiny_clip_tokenizer(16, folder, words=("red",))  # the byte alphabet, and "re" on the way to "red</w>"
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    for left, right in SUBWORD_MERGES:
        vocab[left + right] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    with open(folder / "merges.txt", "a", encoding="utf-8") as f:
        f.write("".join(f"{left} {right}\n" for left, right in SUBWORD_MERGES))
    return CLIPTokenizer.from_pretrained(folder, model_max_length=16)


def test_shapes_tokenizers_are_closed_over_the_world_words_split_as_the_tokenizer_does(monkeypatch):
    calls, decide = [], vocabulary._closed_words  # known words are decided once per tokenizer
    monkeypatch.setattr(vocabulary, "_closed_words", lambda tokenizer: calls.append(tokenizer) or decide(tokenizer))
    shipped_tokenizer = CLIPTokenizer.from_pretrained(PIPELINE_PATH / "tokenizer")  # a fresh one, never decided
    expected = tuple(sorted(word for word in WORLD_WORDS if len(word) > 1))  # "a" is a byte symbol, always known
    assert known_words(shapes_tokenizer()) == expected
    shipped = known_words(shipped_tokenizer)  # the words of the world when the shipped pipeline was trained
    assert {"at", "the", "small", "large", "red", "circle", "square", "triangle", "top", "center"} <= set(shipped)
    described = describe_vocabulary(shipped_tokenizer)
    assert described == f"{len(shipped)} words: {', '.join(shipped)}, and any single letter or digit"
    prompt = "A Red, circle!! at the DOG's café 12"
    assert prompt_words(shipped_tokenizer, prompt) == "a red circle at the dog 's café 1 2".split()
    assert unknown_words(shipped_tokenizer, prompt) == ["dog", "'s", "café"]
    assert unknown_words(shipped_tokenizer, "a dog, a DOG and a Dog") == ["dog", "and"]  # each word once
    assert unknown_words(shipped_tokenizer, "") == [] and unknown_words(shipped_tokenizer, "?!") == []
    assert known_words(shipped_tokenizer) == shipped and sum(t is shipped_tokenizer for t in calls) == 1


@pytest.mark.parametrize("layout", ["vocab.json and merges.txt", "tokenizer.json"])
def test_whole_word_merges_are_closed_and_subword_merges_open_in_either_file_layout(tmp_path, layout):
    closed = tiny_clip_tokenizer(16, tmp_path / "closed", words=TINY_VOCAB_WORDS)
    subword = subword_tokenizer(tmp_path / "open")
    if layout == "tokenizer.json":
        for tokenizer, folder in ((closed, tmp_path / "c"), (subword, tmp_path / "o")):
            tokenizer.save_pretrained(folder)
            assert (folder / "tokenizer.json").is_file()
        closed, subword = CLIPTokenizer.from_pretrained(tmp_path / "c"), CLIPTokenizer.from_pretrained(tmp_path / "o")
    assert known_words(closed) == tuple(sorted(word for word in TINY_VOCAB_WORDS if len(word) > 1))
    assert unknown_words(closed, "a red cat on a beach") == ["beach"]
    assert subword.tokenize("restaurant") == ["re", "staur", "ant</w>"]
    assert known_words(subword) is None and describe_vocabulary(subword) is None
    assert unknown_words(subword, "a restaurant with xylophones") == []


def test_pipeline_warns_once_per_prompt_of_unknown_words_or_cut_text_else_silent(pipe, generate, tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    def unknown_warnings():
        return [r.getMessage() for r in caplog.records if "outside the tokenizer's vocabulary" in r.getMessage()]

    # Silent for known words, empty prompts, prompt embeds and open vocabularies.
    generate(pipe, prompt="A red circle, on a blue square.", num_inference_steps=1)
    generate(pipe, prompt="", num_inference_steps=1)
    prompt_embeds, _ = pipe.encode_prompt("a red circle", "cpu", do_classifier_free_guidance=False)
    generate(pipe, prompt=None, prompt_embeds=torch.randn_like(prompt_embeds), num_inference_steps=1)
    sub = subword_tokenizer(tmp_path)
    open_pipe = LMLPPipeline(**{**pipe.components, "tokenizer": sub, "text_encoder": tiny_clip_text_encoder(sub)})
    open_pipe.set_progress_bar_config(disable=True)
    generate(open_pipe, prompt="a restaurant by the sea", num_inference_steps=1)
    assert unknown_warnings() == [] and "dropped" not in caplog.text
    generate(pipe, prompt=["a red beach", "a red beach", "the Blue sky!"], num_inference_steps=1)
    first, second = unknown_warnings()
    assert first == (
        "The prompt 'a red beach' has words outside the tokenizer's vocabulary: 'beach'. They do not steer the image; "
        "`diffusers_lmlp.known_words(pipe.tokenizer)` lists the known ones."
    )
    assert second.startswith("The prompt 'the Blue sky!' has words outside the tokenizer's vocabulary: 'sky'.")
    caplog.clear()
    generate(pipe, prompt="a red circle", negative_prompt="blurry", guidance_scale=2.0, num_inference_steps=1)
    assert [m.split(" has ")[0] for m in unknown_warnings()] == ["The negative prompt 'blurry'"]
    caplog.clear()  # a prompt beyond the text encoder's tokens warns with what is dropped
    generate(pipe, prompt="a red circle on a blue square with a green triangle and a yellow shape riding a horse")
    assert "dropped: 'shape riding a horse'" in caplog.text
