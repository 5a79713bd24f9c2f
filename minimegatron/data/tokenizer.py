"""Tokenizers: text <-> token ids, the part of Megatron-LM's ``MegatronTokenizer`` training needs:

    encode(text: str) -> list[int]     ids in [0, vocab_size)
    decode(ids: list[int]) -> str      invalid UTF-8 becomes U+FFFD (errors="replace")
    eod -> int                         the end-of-document id appended after each document
    vocab_size -> int                  number of ids; the model's embedding table has this many rows

``ByteTokenizer`` (the default): ids 0..255 are UTF-8 bytes, 256 is ``<eod>`` (vocab_size 257).
``BPETokenizer``: a byte-level BPE (GPT-2's scheme) trained locally with HuggingFace
``tokenizers``, one JSON file. Both round-trip every string; ``<eod>`` comes only from
appending ``tokenizer.eod`` (never from encoding the text "<eod>") and decodes to "<eod>".
``build_tokenizer("byte")`` returns a ByteTokenizer; any other spec is a BPE JSON's path.
Megatron-LM: megatron/core/tokenizers/ (MegatronTokenizer, utils/build_tokenizer.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from .errors import DataError

EOD_TEXT = "<eod>"


class ByteTokenizer:
    """UTF-8 bytes as tokens: id b (0..255) is the byte b, id 256 is ``<eod>``."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``: len(result) == len(text.encode("utf-8"))."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; ``<eod>`` becomes the text "<eod>"; bad UTF-8 becomes U+FFFD."""
        runs = [bytearray()]       # the byte ids between two <eod>s, decoded together (multi-byte chars)
        for i in map(int, ids):
            if not 0 <= i <= self.eod:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, 257)")
            if i == self.eod:
                runs.append(bytearray())
            else:
                runs[-1].append(i)
        return EOD_TEXT.join(run.decode("utf-8", errors="replace") for run in runs)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257)"


class BPETokenizer:
    """A byte-level BPE tokenizer in a HuggingFace ``tokenizers`` JSON file: ``BPETokenizer.train(texts,
    vocab_size, path)`` or ``BPETokenizer.load(path)``. ``<eod>`` is special (id 0 after training)."""

    def __init__(self, hf_tokenizer, path: str | os.PathLike | None = None):
        self._tok = hf_tokenizer
        self.path = None if path is None else str(path)
        eod = hf_tokenizer.token_to_id(EOD_TEXT)
        if eod is None:
            raise DataError(f"{self.path or 'tokenizer'}: has no {EOD_TEXT} special token; "
                            "train it with BPETokenizer.train")
        self.eod = int(eod)
        # Treat "<eod>" written inside a text as ordinary characters (see module docstring).
        # The setting is not stored in the JSON file, so it is applied on every load.
        self._tok.encode_special_tokens = True

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> "BPETokenizer":
        """Train a byte-level BPE on ``texts``, save it as JSON at ``path``. vocab_size counts the 256
        bytes and ``<eod>`` (>= 257); a small corpus may stop early: read ``.vocab_size`` afterwards."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs "
                             "256 byte symbols + <eod> = 257 ids at least")
        tok = Tokenizer(models.BPE())
        # add_prefix_space=False: no space is invented before the text, so decode(encode(s)) == s.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        # initial_alphabet: every byte is in the vocabulary even if the training text never uses it
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TEXT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
        return cls(tok, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Open a tokenizer saved by ``train``; DataError if missing or not a tokenizer file."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file not found")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for bad JSON
            raise DataError(f"{path}: not a valid tokenizers JSON file ({e})") from e
        return cls(tok, path)

    # -- the shared interface -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        # skip_special_tokens=False: show "<eod>" instead of silently dropping it
        return self._tok.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """``"byte"`` -> ByteTokenizer(); anything else is the path of a BPE tokenizer JSON."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise DataError(f"{spec}: tokenizer file not found (the tokenizer spec is either "
                        "'byte' or the path of a BPE JSON made by BPETokenizer.train)")
    return BPETokenizer.load(spec)


__all__ = ["ByteTokenizer", "BPETokenizer", "build_tokenizer", "EOD_TEXT"]
