"""A character-level tokenizer: ids 0, 1, 2 are pad, bos, eos; then one id per alphabet character."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = 3


class CharTokenizer:
    """Maps each character of `alphabet` to one id; unknown characters are an error.

    Args:
      alphabet: the characters, in id order (the first gets id 3).
    """

    def __init__(self, alphabet: str):
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet must be non-empty without repeated characters")
        self.alphabet = alphabet
        self._ids = {ch: i + _SPECIALS for i, ch in enumerate(alphabet)}

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + _SPECIALS

    def sampleable_mask(self, model_vocab_size: int) -> np.ndarray:
        """[V] bool: the ids a completion may contain (every tokenizer id but pad and bos).

        The rollout engine samples only from these, so the trainer's log-probs must renormalize
        over the same set for the behavior and trainer policies to match (docs/DESIGN.md §6).
        """
        if model_vocab_size < self.vocab_size:
            raise ValueError(
                f"model vocab {model_vocab_size} is smaller than the tokenizer's {self.vocab_size}"
            )
        ids_v = np.arange(model_vocab_size)
        return (ids_v < self.vocab_size) & (ids_v != self.pad_id) & (ids_v != self.bos_id)

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
