"""sat_jax.tasks: tokenizer, arithmetic generator, rewards, grain pipelines with resumable state."""

import json
import threading

import pytest

from sat_jax.tasks import (
    ArithmeticTask,
    CharTokenizer,
    arithmetic_dataset,
    arithmetic_task,
    exact_match_reward,
    file_dataset,
    gsm8k_reward,
    make_reward,
    math_reward,
    prompt_dataset,
    prompt_source,
    read_prompts,
)
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.rewards import last_boxed

ALPHABET = "0123456789+-*=() "


def test_tokenizer_round_trip():
    tok = CharTokenizer(ALPHABET)
    ids = tok.encode("12+7=19", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "12+7=19"
    assert tok.decode([*tok.encode("3"), tok.eos_id, *tok.encode("4")]) == "3"
    assert tok.vocab_size == len(ALPHABET) + 3


def test_tokenizer_rejects_unknown():
    tok = CharTokenizer(ALPHABET)
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([999])


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_arithmetic_answers_are_correct(ops):
    task = ArithmeticTask(seed=3, min_digits=1, max_digits=3, operators=ops)
    for i in range(50):
        p = task.problem(i)
        assert p.text.endswith("=")
        assert int(p.answer) == eval(p.text[:-1])  # the operands are plain integers
        assert p.id == f"arith-3-{i}"
        lhs = p.text[:-1].replace("-", "+").replace("*", "+").split("+")
        assert all(1 <= len(x) <= 3 for x in lhs)


def test_arithmetic_deterministic_and_seeded():
    a, b = ArithmeticTask(seed=1), ArithmeticTask(seed=2)
    assert a.problem(5) == ArithmeticTask(seed=1).problem(5)
    assert [a.problem(i).text for i in range(20)] != [b.problem(i).text for i in range(20)]
    with pytest.raises(ValueError):
        ArithmeticTask(operators="/")


def test_exact_match():
    assert exact_match_reward(" 19 ", "19") == 1.0
    assert exact_match_reward("190", "19") == 0.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{3}", "4", 0.0),
        ("no box", "1", 0.0),
        (r"\boxed{x^2+1}", "1+x^2", 1.0),
        (r"first \boxed{1} then \boxed{2}", "2", 1.0),
        (r"\boxed{", "1", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_last_boxed_nested():
    assert last_boxed(r"\boxed{\frac{a}{b}} x") == r"\frac{a}{b}"


def test_make_reward():
    assert make_reward("exact_match") is exact_match_reward
    with pytest.raises(ValueError):
        make_reward("bleu")


def _drain(it, n):
    return [next(it) for _ in range(n)]


def test_arithmetic_pipeline_resumes_exactly():
    ds = arithmetic_dataset(ArithmeticTask(seed=0))
    it = iter(ds)
    _drain(it, 7)
    state = it.get_state()
    json.dumps(state)  # the state must persist as JSON
    rest = _drain(it, 5)
    it2 = iter(ds)
    it2.set_state(state)
    assert _drain(it2, 5) == rest
    assert rest[0].id == "arith-0-7"


def test_file_pipeline_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    rows[2]["id"] = "special"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    it = iter(file_dataset(str(path), seed=1))
    first = _drain(it, 5)
    assert sorted(p.text for p in first) == [f"q{i}" for i in range(5)]
    assert {p.id for p in first} >= {"special", "p.jsonl:0"}
    state = it.get_state()
    more = _drain(it, 3)  # endless: the second epoch starts
    it2 = iter(file_dataset(str(path), seed=1))
    it2.set_state(state)
    assert _drain(it2, 3) == more


def test_file_pipeline_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    it = iter(file_dataset(str(path), shuffle=False))
    assert [(p.text, p.answer) for p in _drain(it, 2)] == [("a", "1"), ("b", "2")]


def test_file_pipeline_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="no prompts .*1 without 'answer'"):
        file_dataset(str(path))
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        file_dataset(str(path))


def test_prompt_dataset_from_config(tmp_path):
    it = iter(prompt_dataset(TaskConfig(seed=4)))
    assert next(it) == ArithmeticTask(seed=4).problem(0)


def test_arithmetic_task_offsets_the_seed_and_needs_the_arithmetic_source():
    cfg = TaskConfig(seed=4, max_digits=3, operators="*")
    assert arithmetic_task(cfg, seed_offset=7) == ArithmeticTask(
        seed=11, max_digits=3, operators="*"
    )
    with pytest.raises(ValueError, match="task.source 'arithmetic'"):
        arithmetic_task(TaskConfig(source="file", path="p.jsonl"), seed_offset=0)


def test_rows_without_the_prompt_or_answer_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    rows = [{"q": "a", "a": "1"}, {"q": "b"}, {"a": "2"}, {"q": "c", "a": "3"}, {"x": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, skipped = read_prompts(str(path), prompt_key="q", answer_key="a")
    assert [p.text for p in prompts] == ["a", "c"] and skipped == 3
    assert "skipped 3 of 5 rows (1 without 'a', 2 without 'q')" in caplog.text
    _, skipped = prompt_source(TaskConfig(source="file", path=str(path), prompt_key="q",
                                          answer_key="a"))  # fmt: skip
    assert skipped == 3


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("3 + 4 = 7", "3+4 = 7\n#### 7", 1.0),  # the last number
        ("so \\boxed{7}. Check: 8", "#### 7", 1.0),  # a boxed answer wins over later numbers
        ("7 apples, not 8", "#### 7", 0.0),
        ("1,234 pens", "#### 1,234", 1.0),
        ("7.0", "#### 7", 1.0),
        ("-3", "#### -3", 1.0),
        ("\\boxed{\\frac{1}{2}}", "#### 0.5", 1.0),
        ("no number here", "#### 7", 0.0),
        ("7", "7", 1.0),  # an answer without #### is its own reference
    ],
)
def test_gsm8k_reward(completion, answer, expected):
    assert gsm8k_reward(completion, answer) == expected
    assert make_reward("gsm8k") is gsm8k_reward


def test_math_rewards_work_off_the_main_thread():
    # The rollout server scores on its loop thread, where math-verify's signal timeouts fail.
    got = []
    worker = threading.Thread(
        target=lambda: got.extend([gsm8k_reward("so 7", "#### 7"), math_reward("\\boxed{7}", "7")])
    )
    worker.start()
    worker.join()
    assert got == [1.0, 1.0]
