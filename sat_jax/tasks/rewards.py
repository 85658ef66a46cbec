"""Rewards of one completion against a reference answer, in [0, 1].

`math_reward` uses the `math-verify` package to compare the last `\\boxed{...}` of a completion
with the answer symbolically ("1/2" == "0.5" == "\\frac12"); `gsm8k_reward` takes GSM8K's reference
(the text after "####") and the completion's last boxed answer or else its last number.
"""

from __future__ import annotations

import logging
import re
import threading
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
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    gold_text = answer if "\\boxed{" in answer else f"\\boxed{{{answer}}}"
    same = _math_equal(f"${gold_text}$", f"$\\boxed{{{boxed}}}$")
    if same is None:
        return float(boxed.strip() == (last_boxed(gold_text) or "").strip())
    return float(same)


def _math_equal(gold_latex: str, guess_latex: str) -> bool | None:
    """math-verify's verdict on two LaTeX strings; None when either does not parse.

    math-verify's timeouts use `signal.alarm`, which works only on the main thread; elsewhere (the
    rollout server scores on its loop thread) they are off, and completions are short anyway.
    """
    from math_verify import parse, verify  # imported only when used (slow to import)

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        # Without a timeout math-verify warns on every call; the choice is deliberate here.
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    gold = parse(gold_latex, parsing_timeout=timeout)
    guess = parse(guess_latex, parsing_timeout=timeout)
    if not gold or not guess:
        return None
    return verify(gold, guess, timeout_seconds=timeout)


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
    reference = answer.rsplit("####", 1)[-1].strip().replace(",", "")
    guess = last_boxed(completion)
    guess = last_number(completion) if guess is None else guess.replace(",", "")
    if guess is None or not reference:
        return 0.0
    same = _math_equal(f"${reference}$", f"${guess}$")
    return float(guess.strip() == reference) if same is None else float(same)


def make_reward(name: str) -> RewardFn:
    """The reward function named in `TaskConfig.reward`."""
    rewards = {"exact_match": exact_match_reward, "math": math_reward, "gsm8k": gsm8k_reward}
    if name not in rewards:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(rewards)}")
    return rewards[name]
