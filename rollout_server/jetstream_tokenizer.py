"""JetStream's `tokenizer_api.Tokenizer` over a `sat_jax.tasks.Tokenizer`."""

from __future__ import annotations

import numpy as np

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.engine import token_utils, tokenizer_api

from sat_jax.tasks import Tokenizer


class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """Adapter so JetStream's text `Decode` path and its padding use our tokenizer.

    A text is encoded as a prompt (`encode_prompt`: chat template and BOS exactly as the
    tokenizer itself adds them); JetStream's `is_bos` is ignored, it never prepends a BOS
    (docs/DESIGN.md §11).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """Prompt ids of `s`, padded to JetStream's prefill buckets."""
        ids = np.asarray(self.tokenizer.encode_prompt(s), np.int32)
        return token_utils.pad_tokens(
            ids,
            self.bos_id,
            self.pad_id,
            is_bos=False,
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", False),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.tokenizer.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        """The tokenizer's bos (or pad) id; JetStream never prepends it here."""
        return self.tokenizer.bos_id

    @property
    def stop_tokens(self) -> set[int]:
        return set(self.tokenizer.stop_ids)
