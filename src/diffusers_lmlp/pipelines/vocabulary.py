"""Which words a pipeline's tokenizer knows: closed (whole-word) vocabularies, and a prompt's words outside them.
CLIP's byte-level BPE is open; the shapes world's is closed and spells other words byte by byte. With an end-of-word
suffix (`</w>`), each piece a whole-word vocabulary makes begins one of its words; a subword one's may not."""

import bisect
import json
import weakref

from tokenizers import decoders, models
from transformers import PreTrainedTokenizerBase


_KNOWN_WORDS = weakref.WeakKeyDictionary()  # tokenizer -> its closed vocabulary's words, or None

MAX_LISTED_WORDS = 40  # a longer closed vocabulary is described by this many of its words


def _is_word(text: str) -> bool:
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
        if not piece.endswith(suffix):
            at = bisect.bisect_left(whole, piece)  # the first whole-word token from `piece` on
            if at == len(whole) or not whole[at].startswith(piece):
                return None
    words = (decoders.ByteLevel().decode([token.removesuffix(suffix)]) for token in whole)
    return tuple(sorted(word for word in words if _is_word(word)))


def known_words(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...] | None:
    """The sorted words a closed vocabulary makes one token each (not the single letters and digits every byte-level
    tokenizer knows), or None for an open one such as CLIP's; computed once per tokenizer."""
    if tokenizer not in _KNOWN_WORDS:
        _KNOWN_WORDS[tokenizer] = _closed_words(tokenizer)
    return _KNOWN_WORDS[tokenizer]


def describe_vocabulary(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A closed vocabulary's words as one line (`MAX_LISTED_WORDS` of them when more), or None for an open one."""
    words = known_words(tokenizer)
    if words is None:
        return None
    if len(words) > MAX_LISTED_WORDS:
        sample = words[:: len(words) // MAX_LISTED_WORDS][:MAX_LISTED_WORDS]
        return f"{len(words):,} words, such as {', '.join(sample)}, and any single letter or digit"
    return f"{len(words)} words: {', '.join(words)}, and any single letter or digit"


def _words_and_pieces(tokenizer: PreTrainedTokenizerBase, text: str) -> list[tuple[str, str]]:
    """(word, its byte-level piece) for each word of `text` as the tokenizer splits it, punctuation left out."""
    backend = tokenizer.backend_tokenizer
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    pieces = backend.pre_tokenizer.pre_tokenize_str(normalized)  # [(piece, (start, end) in `normalized`)]
    return [(normalized[start:end], piece) for piece, (start, end) in pieces if _is_word(normalized[start:end])]


def prompt_words(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The words of `text` as the tokenizer makes them, repeats included ("Red, circle!" -> ["red", "circle"])."""
    return [word for word, _ in _words_and_pieces(tokenizer, text)]


def unknown_words(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The words of `text` outside the tokenizer's closed vocabulary, each once, in order; none for an open one."""
    if known_words(tokenizer) is None:
        return []
    model = tokenizer.backend_tokenizer.model
    unknown = [word for word, piece in _words_and_pieces(tokenizer, text) if len(model.tokenize(piece)) > 1]
    return list(dict.fromkeys(unknown))
