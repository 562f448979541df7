"""Which words a pipeline's tokenizer knows: closed (whole-word) vocabularies, and the words of a prompt outside them.

CLIP's byte-level BPE is open (its merges build subword pieces, so any word becomes learned tokens); the shapes
world's is closed, and spells other words byte by byte into tokens never seen in training. Closed is read from the
merges: with an end-of-word suffix (`</w>`), a whole-word vocabulary makes pieces only on the way to its words, so
each piece begins one of its whole-word tokens, while a subword one also has mid-word pieces ("staur") that begin
none. Words are what the tokenizer's normalizer and pre-tokenizer make of a text, punctuation left out.
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
    """The words of a closed vocabulary, or None for an open one (such as CLIP's); computed once per tokenizer.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): A `tokenizers`-backed tokenizer, such as the pipeline's; one that is not
            a byte-level BPE with an end-of-word suffix counts as open.

    Returns:
        `tuple[str, ...]` or `None`: The words it makes one token each ("small"), sorted, without the single letters
        and digits every byte-level tokenizer knows.
    """
    if tokenizer not in _KNOWN_WORDS:
        _KNOWN_WORDS[tokenizer] = _closed_words(tokenizer)
    return _KNOWN_WORDS[tokenizer]


def describe_vocabulary(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The known words of a closed vocabulary as one line of text (`MAX_LISTED_WORDS` of them, spread over the
    alphabet, when there are more), or None for an open one."""
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
    """The words of `text` as the tokenizer's normalizer and pre-tokenizer make them, punctuation left out, repeats
    included ("Red, circle!" gives ["red", "circle"] for CLIP)."""
    return [word for word, _ in _words_and_pieces(tokenizer, text)]


def unknown_words(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The words of `text` outside the tokenizer's closed vocabulary, each once, in the order they first appear (as
    `prompt_words` writes them); none for an open vocabulary.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): The tokenizer.
        text (`str`): The prompt.
    """
    if known_words(tokenizer) is None:
        return []
    model = tokenizer.backend_tokenizer.model
    unknown = [word for word, piece in _words_and_pieces(tokenizer, text) if len(model.tokenize(piece)) > 1]
    return list(dict.fromkeys(unknown))
