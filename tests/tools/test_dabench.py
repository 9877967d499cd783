"""tools/dabench.py: the loader finds all 206 dev tasks and their tables; the checker agrees with the labels
on responses built from real rows, rejects perturbed ones and parses the answer fields of messy text."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from tools.dabench import _NUMBER as NUMBER
from tools.dabench import (
    ENV_VAR,
    DABenchTask,
    check_answer,
    dabench_dir,
    format_score,
    load_dabench,
    parse_answers,
    values_match,
)


@pytest.fixture(scope="module")
def tasks() -> list[DABenchTask]:
    return load_dabench()  # the copy shipped in examples/data: missing data fails, never skips


@pytest.fixture(scope="module")
def by_id(tasks: list[DABenchTask]) -> dict[int, DABenchTask]:
    return {task.id: task for task in tasks}


def respond(pairs: list[tuple[str, str]]) -> str:
    return "Here is my analysis.\n" + "\n".join(f"@{name}[{value}]" for name, value in pairs)


def is_number(value: str) -> bool:
    return bool(NUMBER.fullmatch(value.strip()))


def bump_last_digit(value: str) -> str:
    """+1 in the last decimal place the label shows: 34.65 -> 34.66, 55 -> 56."""
    number = Decimal(value)
    return str(number + Decimal(1).scaleb(number.as_tuple().exponent))


def test_loader_returns_206_tasks_whose_tables_exist(tasks: list[DABenchTask]) -> None:
    assert len(tasks) == 206
    assert len({task.id for task in tasks}) == 206
    assert {task.level for task in tasks} == {"easy", "medium", "hard"}
    missing = [task.file_name for task in tasks if not task.table_path.is_file()]
    assert not missing, missing
    assert all(task.answers and task.question and task.format for task in tasks)


def test_loader_filters(tasks: list[DABenchTask]) -> None:
    assert [task.id for task in load_dabench(ids=[5, 0])] == [0, 5]  # file order
    easy = load_dabench(levels=["easy"])
    assert easy and all(task.level == "easy" for task in easy)
    assert len(load_dabench(limit=3)) == 3
    with pytest.raises(ValueError, match="unknown DABench ids"):
        load_dabench(ids=[999999])
    with pytest.raises(ValueError, match="unknown levels"):
        load_dabench(levels=["trivial"])


def test_missing_data_folder_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        dabench_dir()


def test_env_var_overrides_the_folder(monkeypatch: pytest.MonkeyPatch, tasks: list[DABenchTask]) -> None:
    real = tasks[0].table_path.parent.parent
    monkeypatch.setenv(ENV_VAR, str(real))
    assert dabench_dir() == real


def test_response_built_from_the_label_is_correct(tasks: list[DABenchTask]) -> None:
    wrong = [(task.id, check_answer(task, respond(task.answers)).reason) for task in tasks]
    assert not [w for w in wrong if w[1] != "all fields match"]


def test_perturbed_number_is_wrong(tasks: list[DABenchTask]) -> None:
    checked = 0
    for task in tasks:
        for position, (name, value) in enumerate(task.answers):
            if is_number(value):
                answers = list(task.answers)
                answers[position] = (name, bump_last_digit(value))
                verdict = check_answer(task, respond(answers))
                assert not verdict.correct, (task.id, name, value, answers[position][1])
                assert verdict.per_name[name] is False or len([n for n, _ in task.answers if n == name]) > 1
                checked += 1
                break
    assert checked >= 20


def test_wrong_string_is_wrong(tasks: list[DABenchTask]) -> None:
    checked = 0
    for task in tasks:
        for position, (name, value) in enumerate(task.answers):
            if not any(is_number(part) for part in value.split(",")):
                answers = list(task.answers)
                answers[position] = (name, "definitely_not_the_answer")
                assert not check_answer(task, respond(answers)).correct, (task.id, name, value)
                checked += 1
                break
    assert checked >= 20


def test_extra_decimals_that_round_to_the_label_are_correct(tasks: list[DABenchTask]) -> None:
    checked = 0
    for task in tasks:
        if task.answers and all(is_number(value) for _, value in task.answers):
            longer = [(n, v + ("04" if "." in v else ".04")) for n, v in task.answers]
            verdict = check_answer(task, respond(longer))
            assert verdict.correct, (task.id, longer, verdict.reason)
            checked += 1
    assert checked >= 20


def test_missing_fields_are_reported(tasks: list[DABenchTask]) -> None:
    checked = 0
    for task in tasks:
        names = [name for name, _ in task.answers]
        if len(set(names)) > 1:
            dropped = names[-1]
            verdict = check_answer(task, respond([(n, v) for n, v in task.answers if n != dropped]))
            assert not verdict.correct and verdict.missing == [dropped], (task.id, verdict)
            assert f"@{dropped}" in verdict.reason
            checked += 1
    assert checked >= 20


# (task id, response, correct?) on real rows, for the rules the generated cases above do not reach.
CASES = [
    (0, "The mean fare is @mean_fare[34.65].", True),
    (0, "@mean_fare[34.654]", True),  # rounds to the label
    (0, "@mean_fare[34.6449]", False),  # rounds to 34.64
    (0, "@mean_fare[34.66]", False),
    (0, "@mean_fare[34.6]", False),
    (0, "The mean fare is 34.65", False),  # no field at all
    (0, "@mean_fare[mean_fare_value]\n...\nSo: @mean_fare[34.65]", True),  # format echoed, answer last
    (0, "@mean_fare[34.65] then on reflection @mean_fare[30.00]", False),  # the last value counts
    (0, "@Mean_Fare[ '34.65' ]", True),
    (10, "@is_normal[No]", True),
    (10, '@is_normal["no"].', True),
    (10, "@is_normal[yes]", False),
    (11, "@relationship_type[Linear], @correlation_coefficient[0.99]", True),
    (77, "@Highest_Monthly_Average_Close_Price[1, 2018, 88.32]", True),
    (77, "@Highest_Monthly_Average_Close_Price[1,2018,88.3249]", True),
    (77, "@Highest_Monthly_Average_Close_Price[1, 2018, 88.33]", False),
    (77, "@Highest_Monthly_Average_Close_Price[1, 2018]", False),
    (116, "@outlier_countries[]", True),  # label is empty
    (116, "@outlier_countries[Denmark]", False),
    (273, "@correlation_coefficient[0.922] @outlier_count[0] @outlier_list[[]]", True),  # label is "["
    (550, '@missing_values_handled["Yes"] @min_max_scaler_scale["0-1"] @distribution_type[non-normal]', True),
    (554, "@median_ht_m[NaN]", True),
    (554, "@median_ht_m[12.5]", False),
]


@pytest.mark.parametrize(("task_id", "response", "correct"), CASES)
def test_checker_on_real_rows(task_id: int, response: str, correct: bool, by_id: dict[int, DABenchTask]) -> None:
    verdict = check_answer(by_id[task_id], response)
    assert verdict.correct is correct, verdict.reason


def test_repeated_label_names_match_as_a_multiset(by_id: dict[int, DABenchTask]) -> None:
    task = by_id[734]  # one coefficient and significance per continent, under the same names
    assert check_answer(task, respond(list(reversed(task.answers)))).correct
    assert not check_answer(task, respond(task.answers[:1] + task.answers[2:])).correct
    assert not check_answer(task, "@correlation_coefficient[0.38] @correlation_significance[significant]").correct


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is @mean_fare[34.65].", {"mean_fare": "34.65"}),
        ("@mean_fare[ 34.65 ]", {"mean_fare": "34.65"}),
        ("**@is_normal['no']**, @x[\"Yes\"];", {"is_normal": "no", "x": "Yes"}),
        ("@x[1] and later @x[2]", {"x": "2"}),
        ("@mean_fare[mean_fare_value]\nSo @mean_fare[34.65]", {"mean_fare": "34.65"}),
        ("@ids[1, 2, 3] @r_squared[0.6059.]", {"ids": "1, 2, 3", "r_squared": "0.6059"}),
        ("@outliers[[1, 2]] @count[2]", {"outliers": "[1, 2]", "count": "2"}),
        ("@outliers[[] @count[0]", {"outliers": "[", "count": "0"}),  # an unclosed [ does not eat @count
        ("mail me at a@b[1] or @c [2]", {"c": "2"}),
        ("@name[Preferred Hotels & Resorts]", {"name": "Preferred Hotels & Resorts"}),
        ("@multi[line\nvalue]", {"multi": "line\nvalue"}),
        ("no fields here [1]", {}),
    ],
)
def test_parse_answers_on_tricky_strings(text: str, expected: dict[str, str]) -> None:
    assert parse_answers(text) == expected


def test_values_match_rules() -> None:
    assert values_match("1234", "1,234") and values_match("0.20", "0.2") and values_match("-0.04", "-0.0449")
    assert not values_match("-0.04", "-0.0451") and not values_match("55", "56")
    assert values_match("314, 577", "[314, 577]") and not values_match("314, 577", "577, 314")
    assert values_match("34.65", "34.65%") and values_match("not normal", "Not Normal")
    assert not values_match("not normal", "not_normal")  # exact strings, as the labels are written


def test_check_answer_accepts_plain_pairs_and_format_score() -> None:
    answers = [("a", "1.5"), ("b", "yes")]
    assert check_answer(answers, "@a[1.5] @b[YES]").correct
    assert check_answer({"a": "1.5"}, "@a[1.52]").correct
    verdict = check_answer(answers, "@a[1.5]", format_text="@a[value] @b[yes_or_no]")
    assert verdict.missing == ["b"] and "@a, @b" in verdict.reason and verdict.parsed == {"a": "1.5"}
    assert format_score("@a[1.5]", answers) == 0.5
    assert format_score("@a[9] @b[no]", answers) == 1.0
    assert format_score("nothing", answers) == 0.0
    assert not check_answer([], "@a[1]").correct
