"""Rewards of one completion against a reference answer, in [0, 1].

`math_reward` uses the `math-verify` package (an optional dependency) to compare the last
`\\boxed{...}` of a completion with the answer symbolically ("1/2" == "0.5" == "\\frac12").
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace."""
    return float(completion.strip() == answer.strip())


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's last `\\boxed{}` is mathematically equal to `answer`.

    A completion without a boxed answer scores 0. The answer may itself be boxed or plain.
    """
    from math_verify import parse, verify  # optional dependency, imported only when used

    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    gold_text = answer if "\\boxed{" in answer else f"\\boxed{{{answer}}}"
    gold = parse(f"${gold_text}$")
    guess = parse(f"$\\boxed{{{boxed}}}$")
    if not gold or not guess:
        return float(boxed.strip() == (last_boxed(gold_text) or "").strip())
    return float(verify(gold, guess))


def make_reward(name: str) -> RewardFn:
    """The reward function named in `TaskConfig.reward`."""
    rewards = {"exact_match": exact_match_reward, "math": math_reward}
    if name not in rewards:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(rewards)}")
    return rewards[name]
