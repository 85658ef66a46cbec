"""How completions are sampled and how far generation may run ahead of training: the
``rollout.*`` keys, shared by the rollout server's admission and the trainer (docs/DESIGN.md §6).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How completions are sampled and how far generation may run ahead of training.

    Attributes:
      group_size: G samples per prompt.
      max_new_tokens: completion length limit (EOS included).
      temperature, top_p, top_k: the sampler; top_p = 1 and top_k = 0 disable truncation.
      logprob_replay: how the trainer scores a token sampled under top-k / top-p truncation:
        "truncated" (the default) renormalises over the trainer's own top-max(n, r) tokens, n
        the sampler's kept-set size recorded per token and r the trainer's rank of the sampled
        token, so that at lag 0 the trainer's log-prob is the behavior log-prob; "full" over the
        whole vocabulary (the truncation then reads as a mismatch). Without truncation both are the same.
      batch_groups: B, groups per trainer step (the batch of the admission rule).
      max_staleness: S, the versions a trained token may lag. A server admits (starts) a group
        only while its groups not yet acknowledged number fewer than
        (S + 1 − (T − v)) · share · B, v the weights version it holds, T the trainer's version
        and share its part of the batch (measured capacity over the fleet's); a group is
        counted at the version it was admitted at, so none is trained more than S versions
        later (``rollout_api.admission``; why: docs/DESIGN.md §6.3).
      queue_groups: capacity of the finished-group queue.
      stop_token_ids: ids that end a completion besides the tokenizer's eos ids (an HF
        checkpoint's eos set comes from its config.json and generation_config.json).
    """

    group_size: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprob_replay: str = "truncated"
    batch_groups: int = 8
    max_staleness: int = 1
    queue_groups: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for name in ("group_size", "max_new_tokens", "batch_groups", "queue_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_staleness < 0:
            raise ValueError("top_k and max_staleness must be >= 0")
        if self.logprob_replay not in ("truncated", "full"):
            raise ValueError(
                f"logprob_replay must be 'truncated' or 'full', got {self.logprob_replay!r}"
            )

    @property
    def replays_truncation(self) -> bool:
        """Whether trajectories carry kept counts the trainer replays: the sampler truncates
        (top_k > 0 or top_p < 1) and `logprob_replay` is "truncated"."""
        return (self.top_k > 0 or self.top_p < 1.0) and self.logprob_replay == "truncated"
