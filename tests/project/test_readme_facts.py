"""The numbers and example prompts of the README and docs/training.md come from the code: each is read from its page
and compared with what the package computes, so that neither can drift from the other."""

import re

from documents import text

from diffusers_lmlp import known_words, unknown_words
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.training.components import add_lora, lora_config


README = text("README.md")
TRAINING = text("docs/training.md")  # the shapes preset and LoRA fine-tuning, moved from the README


def test_the_shapes_vocabulary_size_is_the_tokenizers():
    [stated] = re.findall(r"an offline CLIP tokenizer over the world's (\d+) words", TRAINING)
    assert int(stated) == len(known_words(pretrained_shapes_pipeline().tokenizer))


def test_the_lora_example_numbers_are_what_the_trainer_logs():
    # The trainer's log line: trainable parameters, as a share of the frozen backbone's.
    [(layers, trainable, share)] = re.findall(
        r"every `nn.Linear` of every block, token mixers included: (\d+) layers, ([\d,]+)\s+parameters \(([\d.]+)% of "
        r"this small backbone",
        TRAINING,
    )
    model = pretrained_shapes_pipeline().transformer
    base = sum(parameter.numel() for parameter in model.parameters())
    adapted = add_lora(model, lora_config(model, rank=8, alpha=None, dropout=0.0, target_modules=None))
    counted = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    assert (int(layers), int(trainable.replace(",", ""))) == (len(adapted), counted)
    assert share == f"{counted / base:.1%}"[:-1]


def test_the_generate_example_prompt_is_in_the_shapes_vocabulary():
    # The README's Python example samples the shipped shapes model in its test, so its prompt must be words it knows.
    [prompt] = re.findall(r'image = pipe\(\n    "([^"]+)",', README)
    assert unknown_words(pretrained_shapes_pipeline().tokenizer, prompt) == []
