"""Which words a pipeline's tokenizer knows: closed (whole-word) vocabularies, and the words of a prompt outside them.

CLIP's byte-level BPE (`openai/clip-vit-large-patch14`, 48,894 merges) has an open vocabulary: its merges build
subword pieces, so any word becomes tokens the text encoder learned ("tokenization" is "token" + "ization</w>").
The shapes world's tokenizer (`tiny_clip_tokenizer`) has a closed one: its merges build whole words only, and any
other word is spelled byte by byte into tokens the model never saw in training, which steer the image like noise.

Closed or open is read from the tokenizer itself. In a BPE with an end-of-word suffix (`</w>`), a merged token
without the suffix is a piece of a longer word. A whole-word vocabulary makes such pieces only on the way to one of
its words, so each piece begins one of its whole-word tokens ("sm", "sma" and "smal" begin "small</w>"). A subword
vocabulary also has pieces made for the middle of words, which begin none: CLIP ViT-L/14 has 1,873 of them among
its 14,667 pieces ("staur", "nific"). A word is known when the tokenizer makes it one token; words of one letter or
digit are single byte symbols, so every byte-level tokenizer knows them.

Words are what the tokenizer's own normalizer and pre-tokenizer make of a text (CLIP lower-cases, and splits off
punctuation, contractions and digits), so "Red," is the word "red"; pieces without a letter or digit are not words.
"""

import bisect
import json
import weakref

from tokenizers import decoders, models
from transformers import PreTrainedTokenizerBase


# The closed vocabulary's words of each tokenizer seen (None for an open one), computed once per tokenizer object.
_KNOWN_WORDS = weakref.WeakKeyDictionary()


# A closed vocabulary of more words is described by this many of them (the emoji world's has thousands).
MAX_LISTED_WORDS = 40


def _is_word(text: str) -> bool:
    """Whether a piece of text counts as a word: it holds a letter or a digit (punctuation does not)."""
    return any(character.isalnum() for character in text)


def _closed_words(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...] | None:
    """The whole words of `tokenizer`'s merges if every piece they make begins one of them, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.pre_tokenizer is None or not isinstance(backend.model, models.BPE):
        return None
    suffix = backend.model.end_of_word_suffix
    if not suffix:
        return None  # without an end-of-word marker, whole words and pieces look alike
    merged = ["".join(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]
    whole = sorted(token for token in merged if token.endswith(suffix))
    for piece in merged:
        if piece.endswith(suffix):
            continue
        at = bisect.bisect_left(whole, piece)  # the first whole-word token from `piece` on, in sorted order
        if at == len(whole) or not whole[at].startswith(piece):
            return None
    words = (decoders.ByteLevel().decode([token.removesuffix(suffix)]) for token in whole)
    return tuple(sorted(word for word in words if _is_word(word)))


def known_words(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...] | None:
    """The words of a closed vocabulary, or None for an open one (such as CLIP's).

    Decided once per tokenizer object, then cached: a fraction of a second for CLIP's 49,408 tokens.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): A tokenizer backed by the `tokenizers` library, such as the
            pipeline's `CLIPTokenizer`; one without a byte-level BPE with an end-of-word suffix counts as open.

    Returns:
        `tuple[str, ...]` or `None`: The words the tokenizer makes one token each, sorted, as text ("small"),
        without the one-letter words and digits that every byte-level tokenizer knows; None when the vocabulary is
        open.
    """
    if tokenizer not in _KNOWN_WORDS:
        _KNOWN_WORDS[tokenizer] = _closed_words(tokenizer)
    return _KNOWN_WORDS[tokenizer]


def describe_vocabulary(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The known words of a closed vocabulary as one line of text, or None for an open one.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): The tokenizer.

    Returns:
        `str` or `None`: "`N` words: a, b, ..., and any single letter or digit"; for more than `MAX_LISTED_WORDS` words,
        "`N` words, such as ..." with `MAX_LISTED_WORDS` of them spread over the alphabet.
    """
    words = known_words(tokenizer)
    if words is None:
        return None
    if len(words) > MAX_LISTED_WORDS:
        sample = words[:: len(words) // MAX_LISTED_WORDS][:MAX_LISTED_WORDS]
        return f"{len(words):,} words, such as {', '.join(sample)}, and any single letter or digit"
    return f"{len(words)} words: {', '.join(words)}, and any single letter or digit"


def _words_and_pieces(tokenizer: PreTrainedTokenizerBase, text: str) -> list[tuple[str, str]]:
    """The words of `text` as the tokenizer splits them: (the word as text, its byte-level piece) in order."""
    backend = tokenizer.backend_tokenizer
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    pieces = backend.pre_tokenizer.pre_tokenize_str(normalized)  # [(piece, (start, end) in `normalized`)]
    return [(normalized[start:end], piece) for piece, (start, end) in pieces if _is_word(normalized[start:end])]


def prompt_words(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The words of `text` as the tokenizer sees them, in order: normalised (lower-cased, for CLIP) and split by its
    pre-tokenizer, punctuation left out ("Red, circle!" gives ["red", "circle"]).

    Args:
        tokenizer (`PreTrainedTokenizerBase`): A tokenizer backed by the `tokenizers` library, with a
            pre-tokenizer.
        text (`str`): The prompt.

    Returns:
        `list[str]`: Every word, repeats included.
    """
    return [word for word, _ in _words_and_pieces(tokenizer, text)]


def unknown_words(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The words of `text` outside the tokenizer's closed vocabulary: none for an open vocabulary.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): The tokenizer.
        text (`str`): The prompt.

    Returns:
        `list[str]`: Each unknown word once, in the order it first appears, as `prompt_words` writes it.
    """
    if known_words(tokenizer) is None:
        return []
    model = tokenizer.backend_tokenizer.model
    unknown = [word for word, piece in _words_and_pieces(tokenizer, text) if len(model.tokenize(piece)) > 1]
    return list(dict.fromkeys(unknown))
