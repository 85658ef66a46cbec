"""`feedback`: a wrong answer gets "That is not correct. Try again." until it is right.

The simplest multi-turn task: the policy answers, the environment checks the answer with
`task.reward` and, when it is wrong and turns remain, asks again as a user turn. The episode's
reward is the last answer's, times `task.turn_discount ** (turns - 1)` (1.0 = no discount), so a
discount below 1 prefers answers that are right the first time.
"""

from __future__ import annotations

from sat_jax.tasks.envs.base import Environment, Step

RETRY_MESSAGE = "That is not correct. Try again."


class Feedback(Environment):
    """Retries a wrong answer with a user turn, up to `max_turns` answers.

    An answer is right when its reward is 1 (the maximum of every reward in
    `sat_jax.tasks.rewards`). Rewards come only at the final step.
    """

    def step(self, text: str) -> Step:
        score = self.reward_fn(text, self.prompt.answer)
        if score >= 1.0 or self.turn >= self.cfg.max_turns:
            return Step(reward=score * self.cfg.turn_discount ** (self.turn - 1), done=True)
        return Step(observations=[{"role": "user", "content": RETRY_MESSAGE}])
