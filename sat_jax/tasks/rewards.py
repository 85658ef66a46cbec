"""Rewards of one completion against a reference answer, in [0, 1].

`math_reward` uses the `math-verify` package to compare the last `\\boxed{...}` of a completion
with the answer symbolically ("1/2" == "0.5" == "\\frac12"); `gsm8k_reward` takes GSM8K's reference
(the text after "####") and the completion's last boxed answer or else its last number.
"""

from __future__ import annotations

import re
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
    from math_verify import parse, verify  # imported only when used (slow to import)

    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    gold_text = answer if "\\boxed{" in answer else f"\\boxed{{{answer}}}"
    gold = parse(f"${gold_text}$")
    guess = parse(f"$\\boxed{{{boxed}}}$")
    if not gold or not guess:
        return float(boxed.strip() == (last_boxed(gold_text) or "").strip())
    return float(verify(gold, guess))


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in `text` ("1,234.5" -> "1234.5"), or None."""
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's answer equals GSM8K's reference, checked by math-verify.

    The reference is the text after the last "####" of `answer` (all of it when there is none);
    the completion's answer is its last `\\boxed{}`, or else its last number. Thousands
    separators are dropped on both sides.
    """
    from math_verify import parse, verify

    reference = answer.rsplit("####", 1)[-1].strip().replace(",", "")
    guess = last_boxed(completion)
    guess = last_number(completion) if guess is None else guess.replace(",", "")
    if guess is None or not reference:
        return 0.0
    gold, mine = parse(f"${reference}$"), parse(f"${guess}$")
    if not gold or not mine:
        return float(guess.strip() == reference)
    return float(verify(gold, mine))


def make_reward(name: str) -> RewardFn:
    """The reward function named in `TaskConfig.reward`."""
    rewards = {"exact_match": exact_match_reward, "math": math_reward, "gsm8k": gsm8k_reward}
    if name not in rewards:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(rewards)}")
    return rewards[name]
