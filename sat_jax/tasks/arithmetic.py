"""The built-in verifiable task: integer arithmetic problems like "12+7=" with answer "19".

Problem `index` of a task is a pure function of (seed, index), so a pipeline position is enough to
reproduce every prompt after a restart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sat_jax.tasks.prompt import Prompt


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Problems "a op b=" with a, b of min_digits..max_digits digits and op from `operators`.

    Difficulty grows with the operand length and with "*" among the operators.
    """

    seed: int = 0
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}"
            )
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(
                f"operators must be a non-empty subset of '+-*', got {self.operators!r}"
            )

    def problem(self, index: int) -> Prompt:
        """Problem number `index` (any int >= 0), deterministic in (seed, index)."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        a, b = (self._operand(rng) for _ in range(2))
        op = self.operators[int(rng.integers(len(self.operators)))]
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Prompt(id=f"arith-{self.seed}-{index}", text=f"{a}{op}{b}=", answer=str(value))

    def _operand(self, rng: np.random.Generator) -> int:
        digits = int(rng.integers(self.min_digits, self.max_digits + 1))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10**digits))
