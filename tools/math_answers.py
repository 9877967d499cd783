"""Competition math answers: extract the `\\boxed{}` answer, normalise it, check it, and load the problems.

The AIME/AMC sets ship in examples/data/math (override with MAPPA_MATH_DIR); see the README there. Their answers are integers, stored as strings with leading zeros ("023"), as floats (AMC:
`142.0`), once with a degree sign (`336^\\circ`) and once as alternatives ("080 or 081 (both were
accepted)"). Checking is exact: both sides are normalised, compared as rational numbers when both parse as
numbers (integers, decimals, `a/b`, `\\frac{a}{b}`), else as normalised strings.
"""

from __future__ import annotations

import json
import os
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ENV_VAR = "MAPPA_MATH_DIR"
PROMPT_FIELDS = ("prompt", "problem", "question")

__all__ = ["ENV_VAR", "MathProblem", "answers_match", "bundled_sets", "extract_boxed", "load_math", "math_dir",
           "normalize_answer", "parse_number", "synthetic_arithmetic"]

_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_RATIO = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))/([+-]?(?:\d+(?:\.\d*)?|\.\d+))")
# Markup that never changes the value: sizing, thin spaces, degree and percent signs.
_SIZING = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])")
_NOISE = (r"\!", r"\,", r"\;", r"\:", r"\ ", "^{\\circ}", "^\\circ", r"\circ", r"\degree", "°", r"\%", "%", "$")


# ---- extraction -------------------------------------------------------------------------------------------
def extract_boxed(text: str | None) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces kept;
    `\\boxed 5` (no braces) gives "5". None when there is none, or only an unclosed one (a cut-off reply)."""
    if not text:
        return None
    found = None
    for match in _BOX.finditer(text):
        content = _braced(text, match.end())
        if content is not None:
            found = content
    return found


def _braced(text: str, start: int) -> str | None:
    i = start
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        bare = re.match(r"[^\s$]+", text[i:]) if i > start else None  # `\boxed 5`, not `\boxedx`
        return bare.group(0) if bare else None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped character (`\{`, `\}`) never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


# ---- normalisation and checking ---------------------------------------------------------------------------
def normalize_answer(text: Any) -> str:
    """A canonical string for an answer: markup, spaces and units of angle/percent dropped, numbers written
    in lowest terms ("023" -> "23", "142.0" -> "142", "\\dfrac{2}{4}" / "2/4" / "0.50" -> "0.5",
    "\\frac{2}{6}" -> "1/3", "1,000" -> "1000", "x = 5" -> "5"). Anything that is not a number comes back
    with only the markup and spaces removed."""
    s = _number_text(text) if isinstance(text, (int, float)) and not isinstance(text, bool) else str(text)
    s = s.strip()
    for _ in range(3):  # \text{\textbf{5}}
        s = _TEXT.sub(r"\1", s)
    s = _SIZING.sub("", s)
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")  # "35." at the end of a sentence
    s = re.sub(r"^\\boxed\{(.*)\}$", r"\1", s)
    s = re.sub(r"^[A-Za-z]\w*=(?=.)", "", s)  # "x = 5"
    for _ in range(3):
        s = _FRAC.sub(lambda m: f"({m.group(1) or m.group(2)})/({m.group(3) or m.group(4)})", s)
    s = re.sub(r"\((-?[\d.]+)\)", r"\1", s)  # the parentheses _FRAC put around plain numbers
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    value = parse_number(s)
    return _canonical(value) if value is not None else s


def parse_number(text: str) -> Fraction | None:
    """An exact rational for a normalised number: integer, decimal or ratio of two; None otherwise."""
    s = text.strip()
    try:
        if _NUMBER.fullmatch(s):
            return Fraction(s)
        ratio = _RATIO.fullmatch(s)
        if ratio:
            denominator = Fraction(ratio.group(2))
            return Fraction(ratio.group(1)) / denominator if denominator else None
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _canonical(value: Fraction) -> str:
    """Integers as integers, terminating decimals as decimals ("1/2" -> "0.5"), the rest as reduced "p/q"."""
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 40):
        scaled = value * 10**places
        if scaled.denominator == 1:
            digits = str(abs(scaled.numerator)).rjust(places + 1, "0")
            return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"
    return f"{value.numerator}/{value.denominator}"


def _number_text(value: int | float) -> str:
    return repr(value)  # repr of a float is its shortest round-tripping decimal: 0.1 -> "0.1", not 0.1000...


def answers_match(predicted: Any, reference: Any) -> bool:
    """True when the predicted answer equals the reference: as numbers when both parse as numbers (so "142"
    matches 142.0 and "\\frac{1}{2}" matches "0.5"), else as normalised strings. A reference of alternatives
    ("080 or 081 (both were accepted)") matches any of them. A missing prediction (None) never matches."""
    if predicted is None or reference is None:
        return False
    guess = normalize_answer(predicted)
    if not guess:
        return False
    for option in _alternatives(reference):
        want = normalize_answer(option)
        a, b = parse_number(guess), parse_number(want)
        if (a is not None and b is not None and a == b) or guess == want:
            return True
    return False


def _alternatives(reference: Any) -> list[Any]:
    if not isinstance(reference, str) or " or " not in reference:
        return [reference]
    text = re.sub(r"\([^()]*\)\s*$", "", reference)  # "(both were accepted)"
    return [part for part in re.split(r"\s+or\s+", text.strip()) if part]


# ---- problems ---------------------------------------------------------------------------------------------
class MathProblem(BaseModel):
    """One problem with its reference answer (as a string: "23", "142", "336^\\circ", "1/2")."""

    id: str
    prompt: str
    answer: str
    source: str = ""
    solution: str | None = None


def math_dir() -> Path:
    """The bundled math folder: $MAPPA_MATH_DIR, else the copy shipped in examples/data/math."""
    override = os.environ.get(ENV_VAR)
    folder = Path(override) if override else Path(__file__).resolve().parents[1] / "examples" / "data" / "math"
    if not folder.is_dir() or not any(folder.glob("*.json")):
        raise FileNotFoundError(
            f"math data not found in {folder} (expected the AIME/AMC JSON files there, e.g. aime_2025.json); "
            f"set {ENV_VAR} to the folder holding them, or pass a path to your own JSON/JSONL file"
        )
    return folder


def bundled_sets() -> list[str]:
    """Short names of the bundled sets ("AIME_1983_2024", "amc", "aime_eval_32", ...)."""
    return sorted(p.stem for p in math_dir().glob("*.json"))


def load_math(name_or_path: str | Path, limit: int | None = None) -> list[MathProblem]:
    """Problems from a bundled set by short name ("aime_2025", "amc_eval_32"; case-insensitive) or from any
    JSON array / JSONL file whose records have a `prompt`, `problem` or `question` field and an `answer`."""
    path = Path(name_or_path)
    if not path.is_file():
        if len(path.parts) > 1 or path.suffix not in ("", ".json"):
            raise FileNotFoundError(f"no math problem file at {path}")
        path = _bundled(path.stem, shown=str(name_or_path))
    problems, seen = [], set()
    for i, record in enumerate(_records(path)):
        problem = _problem(record, i, path)
        if problem.id in seen:  # a repeated id in the file: keep both problems apart
            problem.id = f"{problem.id}#{i}"
        seen.add(problem.id)
        problems.append(problem)
    return problems[:limit] if limit is not None else problems


def _bundled(name: str, *, shown: str) -> Path:
    names = {n.lower(): n for n in bundled_sets()}
    if name.lower() not in names:
        raise ValueError(f"unknown math set {shown!r}: no such file, and no bundled set of that name (bundled: "
                         f"{', '.join(sorted(names.values()))}); pass a bundled name or a JSON/JSONL file path")
    return math_dir() / f"{names[name.lower()]}.json"


def _records(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {n} is not valid JSON ({exc.msg})") from exc
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); JSONL files need a .jsonl "
                         f"suffix") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of problems, got {type(data).__name__}")
    return data


def _problem(record: Any, index: int, path: Path) -> MathProblem:
    where = f"{path}: record {index}"
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, expected an object with a prompt and an answer")
    prompt_field = next((f for f in PROMPT_FIELDS if isinstance(record.get(f), str) and record[f].strip()), None)
    if prompt_field is None:
        raise ValueError(f"{where} has no {' / '.join(repr(f) for f in PROMPT_FIELDS)} field "
                         f"(fields: {', '.join(record) or 'none'})")
    answer = record.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"{where} has no 'answer' field (fields: {', '.join(record)})")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # AMC answers are stored as 142.0
    raw_id = record.get("id")
    solution = record.get("solution")
    return MathProblem(
        id=f"{path.stem}/{raw_id}" if raw_id is not None else f"{path.stem}/#{index}",  # "#": never a file's id
        prompt=record[prompt_field].strip(),
        answer=str(answer).strip(),
        source=str(record.get("source") or path.stem),
        solution=solution if isinstance(solution, str) else None,
    )


# ---- the synthetic set for the CPU run ----------------------------------------------------------------------
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def synthetic_arithmetic(n: int, seed: int = 0, *, exclude: set[str] | None = None) -> list[MathProblem]:
    """n distinct two-step integer problems ("Compute (3 + 4) * 5.") with a worked solution that ends in
    `\\boxed{35}`: what the tiny model learns the team's format on (the real sets are far beyond it)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen = set(exclude or ())
    problems: list[MathProblem] = []
    for _ in range(100 * n + 100):
        if len(problems) == n:
            break
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+*")
        if rng.random() < 0.5:
            first = _OPS[op1](a, b)
            value = _OPS[op2](first, c)
            prompt = f"Compute ({a} {op1} {b}) {op2} {c}."
            steps = f"{a} {op1} {b} = {first}. {first} {op2} {c} = {value}."
        else:
            first = _OPS[op1](b, c)
            value = _OPS[op2](a, first)
            prompt = f"Compute {a} {op2} ({b} {op1} {c})."
            steps = f"{b} {op1} {c} = {first}. {a} {op2} {first} = {value}."
        if prompt in seen:
            continue
        seen.add(prompt)
        problems.append(MathProblem(id=f"synthetic/{len(problems)}-{seed}", prompt=prompt, answer=str(value),
                                    source="synthetic", solution=f"{steps} \\boxed{{{value}}}"))
    if len(problems) < n:
        raise ValueError(f"only {len(problems)} distinct synthetic problems left for n={n} (exclude is too large)")
    return problems
