"""`calculator`: the policy may call a calculator tool before it answers.

Tool calls are read in the model's chat format, Qwen3's (and Qwen2.5's, Hermes'):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
    </tool_call>

Each call in an assistant turn is answered by one tool message, `{"role": "tool", "content":
"84"}`, computed by the AST evaluator of expression.py (no `eval`, bounded sizes and time). A
malformed or hostile call (not JSON, an unknown tool, missing or extra arguments, an unterminated
`<tool_call>`, an expression the evaluator refuses) is answered with an "error: ..." message: the
policy sees its mistake, the episode goes on, nothing raises. An assistant turn without a tool
call is the final answer, scored by `task.reward`; the episode is done. Running out of turns
while still calling tools scores 0.

`CALCULATOR_TOOL` is the tool's JSON schema; the server passes `Calculator.tools` to the chat
template (`apply_chat_template(..., tools=...)`), which describes the tool and its call format to
the model.
"""

from __future__ import annotations

import json
from typing import Any

from sat_jax.tasks.envs.base import Environment, Message, Step
from sat_jax.tasks.envs.expression import MAX_CHARS, calculate

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8  # answered per assistant turn; more get one error message
MAX_CALL_CHARS = 2000  # the JSON between the tags

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses, "
            "the constants pi and e, and abs, round, min, max, sqrt, floor, ceil."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression, e.g. '12 * (3 + 4) / 2'.",
                }
            },
            "required": ["expression"],
        },
    },
}


def find_tool_calls(text: str) -> list[str | None]:
    """The bodies of the `<tool_call>...</tool_call>` blocks of an assistant turn, in order.

    Text inside `<think>...</think>` is not searched (only what follows the last `</think>`). An
    unterminated last block (the turn was cut) is returned as None.
    """
    visible = text.rsplit("</think>", 1)[-1]
    calls: list[str | None] = []
    start = visible.find(OPEN)
    while start >= 0:
        end = visible.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(None)
            break
        calls.append(visible[start + len(OPEN) : end])
        start = visible.find(OPEN, end + len(CLOSE))
    return calls


def run_tool_call(body: str | None) -> str:
    """The tool message's content for one call's body: the result, or "error: ...". Never raises."""
    if body is None:
        return f"error: the tool call has no closing {CLOSE}"
    if len(body) > MAX_CALL_CHARS:
        return f"error: the tool call is longer than {MAX_CALL_CHARS} characters"
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return 'error: the tool call is not JSON like {"name": ..., "arguments": {...}}'
    if not isinstance(call, dict):
        return 'error: the tool call must be a JSON object {"name": ..., "arguments": {...}}'
    name = call.get("name")
    if name != "calculator":
        shown = json.dumps(name)[:40] if isinstance(name, str) else "missing"
        return f"error: unknown tool {shown}; the only tool is calculator"
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # OpenAI-style arguments: a JSON string
        try:
            arguments = json.loads(arguments[:MAX_CALL_CHARS])
        except (ValueError, RecursionError):
            return "error: arguments is not a JSON object"
    if not isinstance(arguments, dict) or "expression" not in arguments:
        return 'error: calculator needs arguments {"expression": "..."}'
    extra = sorted(str(k)[:40] for k in arguments if k != "expression")
    if extra:
        return f"error: calculator takes only 'expression', not {', '.join(extra[:4])}"
    expression = arguments["expression"]
    if isinstance(expression, str) and len(expression) > MAX_CHARS:
        return f"error: the expression is longer than {MAX_CHARS} characters"
    return calculate(expression)


class Calculator(Environment):
    """Answers calculator tool calls until the policy answers without one (module docstring)."""

    tools = (CALCULATOR_TOOL,)

    def step(self, text: str) -> Step:
        calls = find_tool_calls(text)
        if not calls:
            return Step(reward=self.reward_fn(text, self.prompt.answer), done=True)
        if self.turn >= self.cfg.max_turns:
            return Step(done=True)
        return Step(observations=tool_messages(calls))


def tool_messages(calls: list[str | None]) -> list[Message]:
    """One tool message per call, at most `MAX_CALLS`, then one error for the calls left over."""
    messages = [{"role": "tool", "content": run_tool_call(c)} for c in calls[:MAX_CALLS]]
    if len(calls) > MAX_CALLS:
        left = len(calls) - MAX_CALLS
        content = f"error: at most {MAX_CALLS} tool calls per turn; {left} more were not run"
        messages.append({"role": "tool", "content": content})
    return messages
