"""The numbers of docs/training.md that come from the code, read from the page and compared with what it computes."""

import re

from documents import text

from diffusers_lmlp import known_words
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.training.components import add_lora, lora_config


TRAINING = text("docs/training.md")


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
