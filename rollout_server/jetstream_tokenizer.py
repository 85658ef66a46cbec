"""JetStream's `tokenizer_api.Tokenizer` over our character tokenizer."""

from __future__ import annotations

import numpy as np

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.engine import token_utils, tokenizer_api

from sat_jax.tasks import CharTokenizer


class JetStreamCharTokenizer(tokenizer_api.Tokenizer):
    """Adapter so JetStream's text `Decode` path and its padding use `CharTokenizer`."""

    def __init__(self, tokenizer: CharTokenizer):
        self.tokenizer = tokenizer

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """Ids of `s`, BOS-prefixed when `is_bos`, padded to JetStream's prefill buckets."""
        ids = np.asarray(self.tokenizer.encode(s), np.int32)
        return token_utils.pad_tokens(
            ids,
            self.bos_id,
            self.pad_id,
            is_bos=kwargs.get("is_bos", True),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", False),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.tokenizer.decode(token_ids, stop_at_eos=False)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def stop_tokens(self) -> set[int]:
        return {self.tokenizer.eos_id}
