"""DABench (InfiAgent-DABench dev split): load the tasks and check `@name[value]` answers against the labels.

The data ships in examples/data/dabench (override with MAPPA_DABENCH_DIR); see the README there. Checking follows the benchmark's rule, made explicit: a field is right when its value matches the
label, numbers compared at the precision the label is written with, strings case-insensitively, lists
element by element; a response is right when every labelled field is.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

Level = Literal["easy", "medium", "hard"]
LEVELS: tuple[Level, ...] = ("easy", "medium", "hard")
ENV_VAR = "MAPPA_DABENCH_DIR"

__all__ = ["AnswerCheck", "DABenchTask", "check_answer", "dabench_dir", "format_score", "load_dabench",
           "parse_answers", "values_match"]

# `@name[value]`, not preceded by a word character (e-mail addresses); the value ends at the first `]`, as
# in the benchmark's own evaluator (a label of "[" comes from a response "@outlier_list[[]]").
_FIELD = re.compile(r"(?<![\w.])@\s*([A-Za-z_]\w*)\s*\[(.*?)\]", re.DOTALL)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"


def dabench_dir() -> Path:
    """The DABench folder: $MAPPA_DABENCH_DIR, else the copy shipped in examples/data/dabench."""
    override = os.environ.get(ENV_VAR)
    default = Path(__file__).resolve().parents[1] / "examples" / "data" / "dabench"
    folder = Path(override) if override else default
    if not (folder / "questions.jsonl").is_file() or not (folder / "labels.jsonl").is_file():
        raise FileNotFoundError(
            f"DABench data not found in {folder} (expected questions.jsonl and labels.jsonl there); "
            f"set {ENV_VAR} to the folder holding them"
        )
    return folder


class DABenchTask(BaseModel):
    """One question over one CSV table, with its labelled answer fields."""

    id: int
    question: str
    concepts: list[str] = Field(default_factory=list)
    constraints: str = ""
    format: str = Field("", description="how the answer must be written, e.g. @mean_fare[mean_fare_value]")
    file_name: str
    level: Level
    answers: list[tuple[str, str]] = Field(default_factory=list, description="[name, value] pairs")
    data_dir: Path | None = Field(None, exclude=True, repr=False, description="default: dabench_dir()")

    @field_validator("file_name")
    @classmethod
    def _a_table_in_the_tables_folder(cls, name: str) -> str:
        """The table is bound into the code sandbox: a name that leaves the tables folder (`../`, an absolute
        path) would hand the agents' code any file of this machine."""
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
            raise ValueError(f"file_name {name!r} is not a file name in the dataset's tables folder "
                             "(no folders, no '..', no absolute path): fix the dataset's questions.jsonl")
        return name

    @property
    def table_path(self) -> Path:
        return (self.data_dir or dabench_dir()) / "tables" / self.file_name


def load_dabench(
    ids: Iterable[int] | None = None, levels: Iterable[str] | None = None, limit: int | None = None
) -> list[DABenchTask]:
    """Tasks in file order, optionally only these ids and levels, at most `limit` of them."""
    folder = dabench_dir()
    labels = {row["id"]: row["common_answers"] for row in _read_jsonl(folder / "labels.jsonl")}
    tasks = [
        DABenchTask(**row, answers=[(str(n), str(v)) for n, v in labels.get(row["id"], [])], data_dir=folder)
        for row in _read_jsonl(folder / "questions.jsonl")
    ]
    if ids is not None:
        wanted = list(ids)
        wanted_set, known = set(wanted), {task.id for task in tasks}
        unknown = [i for i in wanted if i not in known]
        if unknown:
            raise ValueError(f"unknown DABench ids {unknown} (ids run from {min(known)} to {max(known)})")
        tasks = [task for task in tasks if task.id in wanted_set]
    if levels is not None:
        chosen = set(levels)
        if not chosen <= set(LEVELS):
            raise ValueError(f"unknown levels {sorted(chosen - set(LEVELS))} (levels: {', '.join(LEVELS)})")
        tasks = [task for task in tasks if task.level in chosen]
    return tasks[:limit] if limit is not None else tasks


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _answer_pairs(text: str) -> list[tuple[str, str]]:
    """Every `@name[value]` in order, values cleaned of spaces, quotes and trailing punctuation.

    A value with an unclosed `[` ("@outliers[[1, 2]]") takes in the following `]`, as long as no other field
    starts in between.
    """
    pairs = []
    for match in _FIELD.finditer(text):
        value, end = match.group(2), match.end()
        while value.count("[") > value.count("]"):
            close = text.find("]", end)
            if close < 0 or "@" in text[end:close]:
                break
            value, end = value + "]" + text[end:close], close + 1
        pairs.append((match.group(1), _clean(value)))
    return pairs


def parse_answers(text: str) -> dict[str, str]:
    """`@name[value]` fields of a free-text response; a repeated name keeps its last value (models often echo
    the format's placeholder first and give the answer after)."""
    return dict(_answer_pairs(text))


class AnswerCheck(BaseModel):
    """The verdict on one response, field by field."""

    correct: bool
    per_name: dict[str, bool] = Field(default_factory=dict, description="label name -> matched")
    missing: list[str] = Field(default_factory=list, description="labelled names absent from the response")
    parsed: dict[str, str] = Field(default_factory=dict, description="what parse_answers found")
    reason: str = ""


def check_answer(
    task_or_answers: DABenchTask | Sequence[tuple[str, str]] | dict[str, str],
    response_text: str,
    format_text: str | None = None,
) -> AnswerCheck:
    """Whether every labelled field of the response matches (see `values_match`).

    A name labelled several times (task 734 lists a coefficient per continent) must appear as often in the
    response, and the values are matched as a multiset. `format_text` (default: the task's format) is only
    used to tell the agent which fields were expected.
    """
    answers, format_text = _labels_and_format(task_or_answers, format_text)
    pairs = _answer_pairs(response_text)
    parsed = dict(pairs)
    given: dict[str, list[str]] = {}
    for name, value in pairs:
        given.setdefault(name.casefold(), []).append(value)
    expected: dict[str, list[str]] = {}
    for name, value in answers:
        expected.setdefault(name, []).append(value)

    per_name: dict[str, bool] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for name, labels in expected.items():
        values = given.get(name.casefold(), [])
        if not values:
            missing.append(name)
            per_name[name] = False
            continue
        candidates = values[-1:] if len(labels) == 1 else list(values)  # one label: the last value counts
        per_name[name] = _multiset_match(labels, candidates)
        if not per_name[name]:
            wrong.append(f"@{name}[{values[-1]}] (expected {' / '.join(labels)})")

    correct = bool(expected) and all(per_name.values())
    reasons = []
    if missing:
        fields = re.findall(r"@\s*([A-Za-z_]\w*)\s*\[", format_text or "")
        hint = f"; the format asks for {', '.join('@' + f for f in dict.fromkeys(fields))}" if fields else ""
        reasons.append(f"missing {', '.join('@' + m for m in missing)}{hint}")
    if wrong:
        reasons.append("wrong " + ", ".join(wrong))
    if not expected:
        reasons.append("no labelled answers to compare with")
    return AnswerCheck(correct=correct, per_name=per_name, missing=missing, parsed=parsed,
                       reason="; ".join(reasons) or "all fields match")


def format_score(response_text: str, task: DABenchTask | Sequence[tuple[str, str]]) -> float:
    """Fraction of the expected `@name[...]` fields present, right or wrong: a shaping signal for format."""
    answers, _ = _labels_and_format(task, None)
    names = {name.casefold() for name, _ in answers}
    if not names:
        return 0.0
    present = {name.casefold() for name, _ in _answer_pairs(response_text)}
    return len(names & present) / len(names)


def values_match(label: str, value: str) -> bool:
    """One field: lists element-wise, numbers within half a unit of the label's last decimal (so "34.6512"
    and "34.654" match "34.65", "34.66" does not), anything else case-insensitively after cleaning."""
    label_items, value_items = _items(label), _items(value)
    if len(label_items) != len(value_items) and len(label_items) == 1 and _THOUSANDS.fullmatch(_strip(value)):
        value_items = [_strip(value).replace(",", "")]  # "1,234" for a label 1234
    if len(label_items) != len(value_items):
        return False
    return all(_item_match(a, b) for a, b in zip(label_items, value_items))


def _labels_and_format(
    source: DABenchTask | Sequence[tuple[str, str]] | dict[str, str], format_text: str | None
) -> tuple[list[tuple[str, str]], str | None]:
    if isinstance(source, DABenchTask):
        return list(source.answers), format_text if format_text is not None else source.format
    if isinstance(source, dict):
        return [(str(k), str(v)) for k, v in source.items()], format_text
    return [(str(name), str(value)) for name, value in source], format_text


def _multiset_match(labels: list[str], values: list[str]) -> bool:
    remaining = list(values)
    for label in labels:
        hit = next((i for i, value in enumerate(remaining) if values_match(label, value)), None)
        if hit is None:
            return False
        remaining.pop(hit)
    return True


def _clean(value: str) -> str:
    value = value.strip()
    for _ in range(3):  # `'"yes"'.` and similar layers
        value = value.rstrip(".,;:").strip()
        if len(value) >= 2 and value[0] in _QUOTES and value[-1] in _QUOTES:
            value = value[1:-1].strip()
    return value


def _strip(value: str) -> str:
    """Drop list brackets and quotes around a value ("[]" and the mangled label "[" both become "")."""
    value = _clean(value)
    while value[:1] in ("[", "(") or value[-1:] in ("]", ")"):
        value = value.removeprefix("[").removeprefix("(").removesuffix("]").removesuffix(")").strip()
    return value


def _items(value: str) -> list[str]:
    return [_clean(part) for part in _strip(value).split(",")]


def _item_match(label: str, value: str) -> bool:
    label_number, value_number = _number(label), _number(value)
    if label_number is not None and value_number is not None:
        exponent = label_number.as_tuple().exponent
        assert isinstance(exponent, int)  # _NUMBER admits no NaN or infinity
        return abs(value_number - label_number) <= Decimal(5).scaleb(exponent - 1)
    return label.strip(_QUOTES).strip().casefold() == value.strip(_QUOTES).strip().casefold()


def _number(text: str) -> Decimal | None:
    text = text.strip().removesuffix("%").removeprefix("$").strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None
