"""Templated questions over the DABench tables: answers are pandas' own, and the short-number filter keeps only
questions whose numbers (quantile, answer) a small model can copy."""

import re

import pandas as pd

from tools.dabench import check_answer
from tools.dabench_templates import SMALL_TABLES, code_for, count_condition, task_columns, templated_tasks


def test_small_tables_short_numbers_only_and_answers_are_pandas() -> None:
    tasks = templated_tasks(1000, seed=0, tables=SMALL_TABLES, max_number_chars=5)
    assert 100 <= len(tasks) < 1000  # the six tables hold fewer distinct questions than asked for
    assert len({t.id for t in tasks}) == len(tasks)
    assert {t.file_name for t in tasks} == set(SMALL_TABLES)
    for task in tasks:
        numbers = re.findall(r"-?\d[\d.]*", task.question) + [task.answers[0][1]]
        assert all(len(x) <= 5 for x in numbers), (task.question, task.answers)
    for task in tasks[:40]:  # the template's own code answers each question correctly
        df = pd.read_csv(task.table_path)
        kind = task.concepts[0]
        op, quantile = count_condition(task.question) if kind == "count" else (">", None)
        code = code_for(kind, task_columns(task), quantile, op)
        printed = str(eval(code.removeprefix("print(")[:-1], {"df": df}))
        field = task.answers[0][0]
        assert check_answer(task.answers, f"@{field}[{printed}]", task.format).correct, (task.question, printed)


def test_count_questions_name_a_quantile_that_the_code_computes() -> None:
    tasks = [t for t in templated_tasks(200, seed=1, tables=SMALL_TABLES) if t.concepts[0] == "count"]
    assert {count_condition(t.question) for t in tasks} >= {(">", 0.9), ("<", 0.1)}
    task = tasks[0]
    op, q = count_condition(task.question)
    code = code_for("count", task_columns(task), q, op)
    assert f".quantile({q:g})" in code and f"{q:g} quantile?" in task.question


def test_without_the_filter_long_numbers_appear() -> None:
    tasks = templated_tasks(300, seed=0)
    assert any(len(t.answers[0][1]) > 5 for t in tasks)
