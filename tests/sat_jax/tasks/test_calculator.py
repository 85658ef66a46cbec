"""The calculator environment: its AST evaluator, tool-call parsing, and a hostile-input battery.

The evaluator must only ever return a result or an error string: hypothesis fuzzes it with
arbitrary text and with expression-shaped text, and checks random arithmetic trees against values
computed here from the trees (no `eval` on either side). Each test has a pytest timeout, so a hang
fails instead of stalling.
"""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.tasks import Prompt, TaskConfig
from sat_jax.tasks.envs import CALCULATOR_TOOL, Calculator, CalculatorError, Episode, evaluate
from sat_jax.tasks.envs.calculator import MAX_CALLS, find_tool_calls, run_tool_call
from sat_jax.tasks.envs.expression import (
    MAX_CHARS,
    MAX_DEPTH,
    MAX_EXPONENT,
    MAX_MAGNITUDE,
    MAX_NODES,
    calculate,
)

PROMPT = Prompt(id="p0", text="What is 12*(3+4)?", answer="84")
FUZZ = settings(max_examples=300, deadline=None)


def call(expression, name="calculator"):
    body = json.dumps({"name": name, "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def episode(max_turns=4):
    cfg = TaskConfig(env="calculator", chat_template=True, max_turns=max_turns).env_config
    return Episode(Calculator, PROMPT, cfg)


# --- results ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1+2", "3"),
        ("12 * (3 + 4)", "84"),
        ("3*(4+5)/2", "13.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("-7 % 3", "2"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("-2**2", "-4"),
        ("(-2)**3", "-8"),
        ("+5 - -3", "8"),
        ("6/3", "2"),
        ("1/3", "0.333333333333"),
        ("0.1 + 0.2", "0.3"),
        ("1_000 * 3", "3000"),
        ("sqrt(16)", "4"),
        ("abs(-3.5)", "3.5"),
        ("round(2.567, 2)", "2.57"),
        ("round(2.5)", "2"),
        ("min(3, 1, 2) + max(4, 9)", "10"),
        ("floor(-1.5) + ceil(1.2)", "0"),
        ("2 * pi", "6.28318530718"),
        ("e ** 2", "7.38905609893"),
        ("10**100", str(10**100)),
        ("  (1 + 2) * 3  ", "9"),
        ("1e10", "10000000000"),
        ("1e20", "1e+20"),
    ],
)
def test_results(expression, expected):
    assert calculate(expression) == expected


# --- refused, never computed or raised ----------------------------------------------------------------

HOSTILE = [
    "9**9**9",
    "10**100000",
    "2**(2**(2**(2**5)))",
    "(10**100)**2",
    "10**101",
    "10**100 * 10**100",
    "e**1000",
    "1e999",
    "1e308 * 10",
    "0.5 ** -2000",
    "0 ** -1",
    "1/0",
    "1 // 0",
    "1 % 0.0",
    "(-8) ** (1/3)",
    "sqrt(-1)",
    "round(1.5, 10**9)",
    "1" * 200,
    "-" * 400 + "1",
    "(" * 240 + "1" + ")" * 240,
    "+".join(["1"] * (MAX_NODES // 2 + 1)),
    "1" + "+1" * (MAX_CHARS // 2),
    "max(" + ",".join(["1"] * 17) + ")",
    "__import__('os').system('true')",
    "().__class__.__bases__[0].__subclasses__()",
    "(1).real",
    "open('/etc/passwd').read()",
    "globals()",
    "exec('1')",
    "eval('1')",
    "print(1)",
    "f(1)",
    "x",
    "lambda: 1",
    "(lambda x: x)(1)",
    "[i for i in range(10**9)]",
    "{i: i for i in range(3)}",
    "(i for i in range(3))",
    "[1, 2]",
    "{1}",
    "(1, 2)",
    "'a' * 10**9",
    "b'x'",
    "f'{1}'",
    "'1' + '1'",
    "1 if 1 else 2",
    "(x := 5)",
    "1 < 2",
    "1 and 2",
    "not 1",
    "~1",
    "1 << 1000",
    "1 | 2",
    "2 @ 3",
    "True + 1",
    "None",
    "...",
    "1j",
    "abs(*[1])",
    "max(1, key=abs)",
    "round(x=1)",
    "sqrt(1, 2)",
    "abs()",
    "pi.real",
    "sqrt.__globals__",
    "1;2",
    "1\n2",
    "import os",
    "\x00",
    "１+１",
    "",
    "   ",
    "(" * 1000,
    "1" * 5000,
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("expression", HOSTILE)
def test_hostile_expressions_get_an_error_string(expression):
    result = calculate(expression)
    assert result.startswith("error: "), (expression[:60], result)
    assert len(result) < 200
    with pytest.raises(CalculatorError):
        evaluate(expression)


@pytest.mark.parametrize("value", [None, 12, 1.5, ["1"], {"a": 1}, b"1"])
def test_only_strings_are_expressions(value):
    assert calculate(value) == f"error: the expression must be a string, got {type(value).__name__}"


def test_bounds_are_what_the_module_says():
    assert calculate(f"2**{MAX_EXPONENT + 1}").startswith("error: exponents")
    assert calculate("1**1000") == "1"
    assert calculate(f"({MAX_MAGNITUDE}) + 1").startswith("error: numbers are limited")
    nested = "abs(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1)
    assert calculate(nested).startswith("error: the expression is nested deeper")
    assert calculate("1" * (MAX_CHARS + 1)).startswith("error: the expression is longer")


# --- fuzzing ---------------------------------------------------------------------------------------

EXPRESSION_CHARS = "0123456789+-*/%().,eE_ jpisqrtabsmxnroundflcei[]{}'\"\\:;=<>!~^&|@#\n\t"


def _returns_a_result_or_an_error(text):
    result = calculate(text)
    assert isinstance(result, str) and result
    if not result.startswith("error: "):
        value = float(result)  # a result is a number's text
        assert math.isfinite(value) and abs(value) <= MAX_MAGNITUDE


@pytest.mark.timeout(120)
@FUZZ
@given(st.text(max_size=MAX_CHARS + 20))
def test_fuzz_any_text(text):
    _returns_a_result_or_an_error(text)


@pytest.mark.timeout(120)
@FUZZ
@given(st.text(alphabet=EXPRESSION_CHARS, max_size=MAX_CHARS))
def test_fuzz_expression_shaped_text(text):
    _returns_a_result_or_an_error(text)


@pytest.mark.timeout(120)
@FUZZ
@given(
    st.lists(
        st.sampled_from(["9", "99", "**", "*", "-", "+", "(", ")", "1e300", "0", "/", "//", "%"]),
        max_size=60,
    )
)
def test_fuzz_operator_soup(tokens):
    _returns_a_result_or_an_error("".join(tokens))


def _trees():
    """(text, value) of random integer trees, the value computed here from the tree."""
    leaves = st.integers(-(10**6), 10**6).map(lambda n: (f"({n})", n))

    def combine(children):
        binary = st.tuples(children, st.sampled_from(["+", "-", "*"]), children).map(
            lambda t: (
                f"({t[0][0]} {t[1]} {t[2][0]})",
                {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[t[1]](t[0][1], t[2][1]),
            )
        )
        divide = (
            st.tuples(children, st.sampled_from(["//", "%"]), children)
            .filter(lambda t: t[2][1] != 0)
            .map(
                lambda t: (
                    f"({t[0][0]} {t[1]} {t[2][0]})",
                    t[0][1] // t[2][1] if t[1] == "//" else t[0][1] % t[2][1],
                )
            )
        )
        power = st.tuples(children, st.integers(0, 3)).map(
            lambda t: (f"({t[0][0]} ** {t[1]})", t[0][1] ** t[1])
        )
        unary = children.map(lambda c: (f"(-{c[0]})", -c[1]))
        calls = st.lists(children, min_size=1, max_size=3).flatmap(
            lambda cs: st.sampled_from(["min", "max"]).map(
                lambda f: (
                    f"{f}({', '.join(c[0] for c in cs)})",
                    (min if f == "min" else max)(c[1] for c in cs),
                )
            )
        )
        return binary | divide | power | unary | calls

    return st.recursive(leaves, combine, max_leaves=12)


@pytest.mark.timeout(120)
@FUZZ
@given(_trees())
def test_fuzz_integer_trees_match_their_value(tree):
    text, value = tree
    result = calculate(text)
    if abs(value) > MAX_MAGNITUDE:
        assert result.startswith("error: ")
    elif not result.startswith("error: "):  # a tree may exceed the node or depth bound
        assert result == str(value)


@pytest.mark.timeout(120)
@FUZZ
@given(st.text(max_size=3000))
def test_fuzz_tool_call_bodies(body):
    assert isinstance(run_tool_call(body), str)


@pytest.mark.timeout(120)
@FUZZ
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}"]),
            st.text(max_size=40),
            st.builds(call, st.text(alphabet=EXPRESSION_CHARS, max_size=40)),
        ),
        max_size=20,
    )
)
def test_fuzz_assistant_turns(parts):
    ep = episode(max_turns=3)
    for _ in range(3):
        step = ep.step("".join(parts))
        assert all(m["role"] == "tool" and isinstance(m["content"], str) for m in step.observations)
        assert len(step.observations) <= MAX_CALLS + 1
        if step.done:
            break
    assert ep.done


# --- tool calls ------------------------------------------------------------------------------------


def test_a_tool_call_gets_a_tool_message_and_a_final_answer_ends_the_episode():
    ep = episode()
    step = ep.step("Let me compute.\n" + call("12 * (3 + 4)"))
    assert step.observations == [{"role": "tool", "content": "84"}] and not step.done
    step = ep.step("The answer is 84")
    assert step.done and step.reward == 0.0  # exact_match: the whole text is not "84"
    ep = episode()
    ep.step(call("12*(3+4)") + call("1/0"))
    assert ep.messages[-2:] == [
        {"role": "tool", "content": "84"},
        {"role": "tool", "content": "error: division by zero"},
    ]
    assert ep.step(" 84 ").reward == 1.0 and ep.done and ep.turns == 2


def test_the_final_answer_is_scored_by_task_reward():
    cfg = TaskConfig(env="calculator", chat_template=True, reward="gsm8k").env_config
    ep = Episode(Calculator, PROMPT, cfg)
    ep.step(call("12*7"))
    assert ep.step("So the answer is \\boxed{84}.").reward == 1.0


def test_calling_tools_at_the_last_turn_scores_zero():
    ep = episode(max_turns=2)
    assert not ep.step(call("1+1")).done
    step = ep.step(call("84"))
    assert step.done and step.reward == 0.0 and step.observations == []


def test_tool_calls_inside_thinking_are_not_run():
    assert find_tool_calls("<think>" + call("1+1") + "</think>84") == []
    assert find_tool_calls("<think>hm</think>" + call("1+1")) == [
        '\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
    ]


def test_too_many_calls_are_answered_up_to_the_limit():
    step = episode().step(call("1+1") * (MAX_CALLS + 5))
    assert [m["content"] for m in step.observations] == ["2"] * MAX_CALLS + [
        f"error: at most {MAX_CALLS} tool calls per turn; 5 more were not run"
    ]


@pytest.mark.parametrize(
    "body, expected",
    [
        ("not json", "error: the tool call is not JSON"),
        ("[1, 2]", "error: the tool call must be a JSON object"),
        ('{"name": "shell", "arguments": {"cmd": "ls"}}', 'error: unknown tool "shell"'),
        ('{"arguments": {"expression": "1"}}', "error: unknown tool missing"),
        ('{"name": "calculator"}', "error: calculator needs arguments"),
        ('{"name": "calculator", "arguments": {"expr": "1"}}', "error: calculator needs"),
        ('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}', "error: calculator takes only"),
        ('{"name": "calculator", "arguments": {"expression": 5}}', "error: the expression must be a string"),
        ('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}', "2"),
        ('{"name": "calculator", "arguments": "nope"}', "error: arguments is not a JSON object"),
        ('{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}', "error: only these functions"),
        ("[" * 1900, "error: the tool call is not JSON"),
        ("x" * 10**6, "error: the tool call is longer than"),
        (json.dumps({"name": "calculator", "arguments": {"expression": "1" * 600}}), "error: the expression is longer"),
        (None, "error: the tool call has no closing </tool_call>"),
    ],
)  # fmt: skip
def test_malformed_tool_calls_get_an_error_observation(body, expected):
    assert run_tool_call(body).startswith(expected)


def test_an_unterminated_call_is_an_error_observation():
    step = episode().step('<tool_call>\n{"name": "calculator", "arguments": {"exp')
    assert step.observations == [
        {"role": "tool", "content": "error: the tool call has no closing </tool_call>"}
    ]


def test_the_tool_schema_is_json_for_the_chat_template():
    assert Calculator.tools == (CALCULATOR_TOOL,)
    schema = json.loads(json.dumps(CALCULATOR_TOOL))
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
