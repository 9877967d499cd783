"""tools/math_answers.py: boxed extraction with nested braces, normalisation, a checker that agrees with every
real evaluation answer (and rejects each one perturbed), the loader's bundled sets, user files and errors,
and the synthetic arithmetic set."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from tools.math_answers import (
    ENV_VAR,
    MathProblem,
    answers_match,
    bundled_sets,
    extract_boxed,
    load_math,
    math_dir,
    normalize_answer,
    parse_number,
    synthetic_arithmetic,
)

EVAL_SETS = ("aime_eval_32", "amc_eval_32", "aime_2025")


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return math_dir()  # the copy shipped in examples/data: missing data fails, never skips


# ---- extraction -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    (r"so the answer is \boxed{35}.", "35"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\dfrac{\sqrt{3}}{2}"),
    (r"first \boxed{1}, then corrected: \boxed{2}", "2"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{ 12 }", " 12 "),
    (r"\boxed{3} and a cut-off \boxed{\frac{1", "3"),
])
def test_extract_boxed(text: str, want: str) -> None:
    assert extract_boxed(text) == want


@pytest.mark.parametrize("text", ["no box here", "", None, r"\boxed{unclosed", r"\boxedx{3}"])
def test_extract_boxed_none(text: str | None) -> None:
    assert extract_boxed(text) is None


# ---- normalisation and checking ---------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    ("023", "23"), ("142.0", "142"), (142.0, "142"), (7, "7"), ("$35$", "35"), ("35.", "35"), (" 1 2 ", "12"),
    (r"\text{5}", "5"), (r"\textbf{17}", "17"), ("1,000", "1000"), ("338,551", "338551"),
    (r"\dfrac{2}{4}", "0.5"), (r"\frac{1}{2}", "0.5"), (r"\frac12", "0.5"), ("2/4", "0.5"), ("0.50", "0.5"),
    (r"-\frac{1}{8}", "-0.125"), (r"\tfrac{2}{6}", "1/3"), ("4/6", "2/3"), (r"\frac{6}{3}", "2"),
    (r"336^\circ", "336"), (r"336^{\circ}", "336"), ("90°", "90"), (r"50\%", "50"), ("50%", "50"),
    (r"\left(1,2\right)", "(1,2)"), ("x = 5", "5"), ("+5", "5"), ("-0", "0"), ("007", "7"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{\sqrt{2}}{2}"), (r"\rightarrow", r"\rightarrow"),
])
def test_normalize_answer(text: object, want: str) -> None:
    assert normalize_answer(text) == want


def test_parse_number() -> None:
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("-1.25") == Fraction(-5, 4)
    assert parse_number("1/0") is None and parse_number("x") is None and parse_number("1,2") is None


@pytest.mark.parametrize(("predicted", "reference"), [
    ("142", 142.0), (r"\frac{1}{2}", "0.5"), ("0.5", "1/2"), (r"\dfrac{1}{2}", "1/2"), ("23", "023"),
    ("336", r"336^\circ"), (r"336^\circ", "336"), ("1000", "1,000"), (r"\boxed{9}", 9), ("-4", -4.0),
    (r"\sqrt{2}", r"\sqrt{2}"), (r"2\sqrt{3}", r"2 \sqrt{3}"),
    ("080", "080 or 081 (both were accepted)"), ("81", "080 or 081 (both were accepted)"),
])
def test_answers_match(predicted: str, reference: object) -> None:
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(("predicted", "reference"), [
    ("143", 142.0), ("0.51", "1/2"), ("1/3", "0.333"), (r"\sqrt{3}", r"\sqrt{2}"), (None, "5"), ("", "0"),
    ("82", "080 or 081 (both were accepted)"), ("5", None),
])
def test_answers_do_not_match(predicted: str | None, reference: object) -> None:
    assert not answers_match(predicted, reference)


@pytest.mark.parametrize("name", EVAL_SETS)
def test_checker_agrees_with_every_real_answer(data_dir: Path, name: str) -> None:
    raw = json.loads((data_dir / f"{name}.json").read_text())
    problems = load_math(name)
    assert len(problems) == len(raw) >= 30
    for record, problem in zip(raw, problems):
        label = record["answer"]
        for written in (label, problem.answer):  # as stored (142.0, "023") and as loaded ("142", "023")
            response = f"Working through the cases gives the result. Therefore the answer is $\\boxed{{{written}}}$."
            assert answers_match(extract_boxed(response), label), (problem.id, label)
        value = parse_number(normalize_answer(label))
        assert value is not None, f"{problem.id}: answer {label!r} does not normalise to a number"
        perturbed = f"The answer is \\boxed{{{value + 1}}}."
        assert not answers_match(extract_boxed(perturbed), label), (problem.id, label)


def test_training_answers_all_normalise_to_numbers(data_dir: Path) -> None:
    for name in ("AIME_1983_2024", "amc"):
        for p in load_math(name):
            if " or " in p.answer:
                assert answers_match("80", p.answer) and answers_match("081", p.answer)
                continue
            assert parse_number(normalize_answer(p.answer)) is not None, (p.id, p.answer)


# ---- loading ----------------------------------------------------------------------------------------------
def test_bundled_sets_load_by_short_name(data_dir: Path) -> None:
    assert {"AIME_1983_2024", "amc", *EVAL_SETS} <= set(bundled_sets())
    sizes = {"AIME_1983_2024": 933, "amc": 117, "aime_eval_32": 32, "amc_eval_32": 32, "aime_2025": 30}
    for name, size in sizes.items():
        problems = load_math(name)
        assert len(problems) == size
        assert len({p.id for p in problems}) == size
        assert all(isinstance(p.answer, str) and p.answer and p.prompt for p in problems)
    amc = load_math("amc_eval_32", limit=3)
    assert len(amc) == 3 and amc[0].answer == "18" and amc[0].source == "amc" and amc[0].id == "amc_eval_32/72"
    assert load_math("aime_2025")[0].id == "aime_2025/#0"  # no id field: the index
    assert load_math("AIME_EVAL_32.json", limit=1)[0].solution  # case-insensitive; the solution is kept


def test_unknown_set_names_the_bundled_ones(data_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown math set 'aime_2035'.*aime_2025"):
        load_math("aime_2035")


def test_missing_data_dir_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        load_math("aime_2025")


def test_user_jsonl_and_json_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"problem": "What is 2+2?", "answer": 4}\n\n{"question": "Half of 1?", "answer": "1/2", '
                     '"id": "q2"}\n{"prompt": "Again?", "answer": "1", "id": "q2"}\n')
    problems = load_math(jsonl)
    assert problems == [
        MathProblem(id="mine/#0", prompt="What is 2+2?", answer="4", source="mine"),
        MathProblem(id="mine/q2", prompt="Half of 1?", answer="1/2", source="mine"),
        MathProblem(id="mine/q2#2", prompt="Again?", answer="1", source="mine"),  # a repeated id kept apart
    ]
    array = tmp_path / "mine.json"
    array.write_text(json.dumps([{"prompt": "p", "answer": 3.0, "source": "home"}]))
    assert load_math(str(array))[0].model_dump(include={"answer", "source"}) == {"answer": "3", "source": "home"}


@pytest.mark.parametrize(("name", "content", "message"), [
    ("no_answer.jsonl", '{"prompt": "p"}\n', r"no_answer\.jsonl: record 0 has no 'answer' field \(fields: prompt\)"),
    ("no_prompt.json", '[{"answer": 1}, {"text": "p", "answer": 2}]',
     r"no_prompt\.json: record 0 has no 'prompt' / 'problem' / 'question' field"),
    ("bad_line.jsonl", '{"prompt": "p", "answer": 1}\n{oops\n', r"bad_line\.jsonl: line 2 is not valid JSON"),
    ("object.json", '{"prompt": "p", "answer": 1}', r"object\.json: expected a JSON array"),
    ("lines.json", '{"prompt": "p", "answer": 1}\n{"prompt": "q", "answer": 2}\n', r"lines\.json: not valid JSON"),
])
def test_user_file_errors_name_the_file_and_field(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_math(path)


def test_missing_user_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no math problem file"):
        load_math(tmp_path / "absent.jsonl")


# ---- synthetic set ----------------------------------------------------------------------------------------
def test_synthetic_arithmetic() -> None:
    problems = synthetic_arithmetic(50, seed=1)
    assert problems == synthetic_arithmetic(50, seed=1)
    assert len({p.prompt for p in problems}) == 50
    for p in problems:
        expression = p.prompt.removeprefix("Compute ").removesuffix(".")
        assert int(p.answer) == eval(expression)  # noqa: S307 - digits and + - * only
        assert answers_match(extract_boxed(p.solution), p.answer)
    held_out = synthetic_arithmetic(20, seed=2, exclude={p.prompt for p in problems})
    assert not {p.prompt for p in held_out} & {p.prompt for p in problems}
