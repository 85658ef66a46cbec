"""Tokenizers behind one small interface (docs/DESIGN.md §11): the built-in character tokenizer and
a Hugging Face tokenizer directory (`sat_jax.tasks.hf_tokenizer`).

What the server, the trainer and evaluation use of a tokenizer:

    ids = tok.encode_prompt(text)     # exactly what the policy sees (chat template, BOS if any)
    text = tok.decode(ids)            # special tokens skipped
    tok.stop_ids                      # ids that end a completion (finish reason EOS)
    tok.pad_id, len(tok)              # padding id; ids 0 .. len(tok) - 1 exist
    sampleable_mask(tok, vocab_size)  # [V] bool, the one sampleable set of engine and trainer

The character tokenizer: ids 0, 1, 2 are pad, bos, eos; then one id per alphabet character; its
prompts are BOS-prefixed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = 3


class Tokenizer(Protocol):
    """What a tokenizer provides to the server, the trainer and evaluation.

    Attributes:
      pad_id: fills prompts up to a prefill bucket (masked out, never attended).
      bos_id: the tokenizer's bos id (pad's when it has none); only `encode_prompt` decides
        whether a prompt starts with it.
      eos_id: the tokenizer's own eos id, one of `stop_ids`.
      stop_ids: ids that end a completion; the stop id is the completion's last token.
      unsampleable_ids: ids below `len()` that a completion never contains (the character
        tokenizer's pad and bos; none for an HF tokenizer).
    """

    pad_id: int
    bos_id: int
    eos_id: int
    stop_ids: frozenset[int]
    unsampleable_ids: tuple[int, ...]

    def __len__(self) -> int: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def sampleable_mask(tokenizer: Tokenizer, model_vocab_size: int) -> np.ndarray:
    """[V] bool: the ids a completion may contain, for the rollout engine and the trainer alike.

    Every id below `len(tokenizer)` except the tokenizer's `unsampleable_ids`; embedding rows past
    the tokenizer (a vocabulary padded for the hardware) never. The engine samples only from
    these and the trainer renormalizes over the same set, so behavior and trainer log-probs are
    of one distribution (docs/DESIGN.md §6, §11).

    Raises:
      ValueError: the model's vocabulary is smaller than the tokenizer's.
    """
    n = len(tokenizer)
    if model_vocab_size < n:
        raise ValueError(f"model vocab {model_vocab_size} is smaller than the tokenizer's {n}")
    ids_v = np.arange(model_vocab_size)
    return (ids_v < n) & ~np.isin(ids_v, np.asarray(tokenizer.unsampleable_ids, np.int64))


class CharTokenizer:
    """Maps each character of `alphabet` to one id; unknown characters are an error.

    Args:
      alphabet: the characters, in id order (the first gets id 3).
      stop_ids: ids that end a completion besides eos.
    """

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unsampleable_ids = (PAD_ID, BOS_ID)

    def __init__(self, alphabet: str, stop_ids: Sequence[int] = ()):
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet must be non-empty without repeated characters")
        self.alphabet = alphabet
        self._ids = {ch: i + _SPECIALS for i, ch in enumerate(alphabet)}
        self.stop_ids = frozenset({EOS_ID, *stop_ids})

    @property
    def vocab_size(self) -> int:
        """The number of ids, specials included (`len(self)`)."""
        return len(self.alphabet) + _SPECIALS

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`, optionally framed by bos/eos.

        Raises:
          ValueError: naming the first character outside the alphabet.
        """
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from e
        return [BOS_ID] * bos + ids + [EOS_ID] * eos

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt the policy continues: BOS, then the text's ids."""
        return self.encode(text, bos=True)

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids`; specials are skipped, and decoding stops at the first eos by default.

        Raises:
          ValueError: for an id outside [0, vocab_size).
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            if i == EOS_ID and stop_at_eos:
                break
            if i >= _SPECIALS:
                out.append(self.alphabet[i - _SPECIALS])
        return "".join(out)
