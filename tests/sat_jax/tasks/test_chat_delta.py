"""The chat template's delta between turns (`HFTokenizer.observation_ids`): the opening, then
each turn and the ids inserted after it, are exactly the ids of the whole conversation rendered at
once, for a template with tools and tool messages (Qwen3's layout: tools in the system turn, tool
results as `<tool_response>` blocks of one user turn) and for the plain one; earlier turns are never
re-rendered. A template that closes an assistant turn with no stop token is refused by name."""

from __future__ import annotations

import pytest

from sat_jax.tasks.envs import CALCULATOR_TOOL
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests import hf_fixtures

transformers = pytest.importorskip("transformers")

# Tools in the system turn and consecutive tool messages in one user turn, as Qwen3's template
# lays them out (written for this test, reduced to what the layout needs).
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 + 7"}}\n</tool_call>'


def _tokenizer(tmp_path, template: str | None) -> HFTokenizer:
    tok = hf_fixtures.make_tokenizer(tmp_path)
    if template is not None:
        tok.chat_template = template
        tok.save_pretrained(str(tmp_path))
    return HFTokenizer(str(tmp_path), chat_template=True)


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE], ids=["plain", "tools"])
def test_opening_turns_and_deltas_are_the_whole_conversations_ids(tmp_path, template):
    tok = _tokenizer(tmp_path, template)
    end = tok._tok.convert_tokens_to_ids("<|im_end|>")
    tools = [CALCULATOR_TOOL] if template else []
    opening = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "5+7?"}]
    exchanges = [
        (CALL, [{"role": "tool", "content": "12"}, {"role": "tool", "content": "error: x"}]),
        ("Let me check.", [{"role": "user", "content": "That is not correct. Try again."}]),
        ("#### 12", []),
    ]
    ids = tok.encode_messages(opening, tools=tools)
    messages = list(opening)
    for text, observations in exchanges:
        ids += tok._tok(text, add_special_tokens=False)["input_ids"] + [end]
        messages += [{"role": "assistant", "content": text}, *observations]
        if observations:
            ids += tok.observation_ids(observations, tools=tools)
    whole = tok._tok.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=False
    )
    assert tok._tok.decode(ids) == whole.rstrip("\n")
    assert ids == tok._tok(whole.rstrip("\n"), add_special_tokens=False)["input_ids"]


def test_a_cut_turn_is_closed_by_the_templates_end_of_turn(tmp_path):
    tok = _tokenizer(tmp_path, None)
    end = tok._tok.convert_tokens_to_ids("<|im_end|>")
    obs = [{"role": "user", "content": "Go on."}]
    assert tok.observation_ids(obs, close_turn=True) == [end, *tok.observation_ids(obs)]
    assert tok.closes_turn(end)
    assert not tok.closes_turn(tok._tok.convert_tokens_to_ids("<|endoftext|>"))
    # No observations: only the next generation prompt follows.
    assert tok._tok.decode(tok.observation_ids([])) == "\n<|im_start|>assistant\n"


def test_a_template_that_closes_turns_without_a_stop_token_is_refused(tmp_path):
    template = (
        "{%- for m in messages %}{{ '[' + m.role + '] ' + m.content + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '[assistant] ' }}{%- endif %}"
    )
    tok = _tokenizer(tmp_path, template)
    with pytest.raises(ValueError, match="closes an assistant message with none of the stop"):
        tok.observation_ids([{"role": "user", "content": "again"}])
