"""Reading a judge's reply: one top-level JSON verdict `{"score": 0-10, "rationale"}`, or a reason it cannot
be used (`ReplyError.kind`), never a guessed number."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage
from pydantic import BaseModel, Field

from ..errors import ReplyError
from ..messages import content_text
from .llm_prompt import as_text, clip_text


class JudgeVerdict(BaseModel):
    """The reply the judge must give: a 0-10 score and a short rationale."""

    score: float = Field(ge=0, le=10)
    rationale: str = ""


_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*(?:/\s*10)?\s*$")
_THINK = re.compile(r"<think>.*?</think>", re.S)


def reply_text(reply: Any) -> str:
    if isinstance(reply, BaseMessage):
        return content_text(reply.content)
    return "" if reply is None else str(reply)


def _finish_reason(reply: Any) -> str | None:
    meta = getattr(reply, "response_metadata", None) or {}
    return meta.get("finish_reason") or meta.get("stop_reason")


def _top_level_spans(text: str) -> list[str]:
    """The brace-balanced spans at depth 0 (string-aware), each a candidate top-level JSON object."""
    spans, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"' and depth:
            in_string = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                spans.append(text[start : i + 1])
    return spans


def _json_objects(text: str) -> tuple[list[tuple[str, Any]], list[str]]:
    """The top-level JSON objects in `text` (prose and code fences around them are skipped), and the top-level
    spans that look like a verdict but do not parse. Objects nested inside a malformed one never count: a reply
    `{"verdict": {"score": 2}, "score": 8, "rationale": "it is "done" now"}` is malformed, not a 2."""
    found, malformed = [], []
    for span in _top_level_spans(text):
        try:
            found.append((span, json.loads(span)))
        except ValueError:
            if "score" in span:
                malformed.append(span)
    return found, malformed


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _score_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ReplyError("bad_score", f"score {value!r} is not a number")
    if isinstance(value, str):
        match = _NUMBER.match(value)
        if match is None:
            raise ReplyError("bad_score", f"score {value!r} is not a number")
        value = match.group(1)
    score = float(value)
    if score != score or score in (float("inf"), float("-inf")):
        raise ReplyError("bad_score", f"score {value!r} is not a finite number")
    if not 0 <= score <= 10:
        raise ReplyError("out_of_range", f"score {score:g} outside 0-10")
    return score


def parse_reply(reply: Any, *, nonce: str | None = None, data: Sequence[str] = (),
                finish_reason: str | None = None) -> JudgeVerdict:
    """Read a verdict from the model's reply only; raises ReplyError saying why it cannot be used.

    Data blocks the model echoed back (markers with this prompt's `nonce`) are removed first, and a score object
    that appears verbatim in the agent's own text (`data`) is refused, so a score is never taken from agent text.
    """
    text = reply_text(reply)
    truncated = (finish_reason or _finish_reason(reply)) in {"length", "max_tokens"}
    if nonce:
        code = re.escape(nonce)
        text = re.sub(rf"<<<DATA-{code}>>>.*?(?:<<<END-{code}>>>|\Z)", " ", text, flags=re.S)
    text = _THINK.sub(" ", text)
    if "</think>" in text:  # the chat template opened the block, so only its end is in the reply
        text = text.rpartition("</think>")[2]
    if "<think>" in text:
        raise ReplyError("truncated", "reply ended inside its <think> block")
    if truncated:  # a reply cut off by the length limit may hold a draft verdict; it is never taken
        raise ReplyError("truncated", f"reply was cut off (finish_reason=length): {clip_text(text.strip(), 80)!r}")
    if not text.strip():
        raise ReplyError("empty", "empty reply")
    objects, malformed = _json_objects(text)
    candidates = [(raw, obj) for raw, obj in objects if isinstance(obj, dict)]
    with_score = [(raw, obj) for raw, obj in candidates if "score" in obj]
    if malformed:
        raise ReplyError("not_json", f"reply holds a verdict that is not valid JSON: {clip_text(malformed[0], 80)!r}")
    if not with_score:
        preview = clip_text(text.strip(), 80)
        if candidates:
            raise ReplyError("missing_score", f"reply JSON has no 'score' field: {preview!r}")
        raise ReplyError("not_json", f"reply is not a JSON object: {preview!r}")
    if len({json.dumps(obj["score"]) for _, obj in with_score}) > 1:
        raise ReplyError("ambiguous", f"reply holds {len(with_score)} JSON objects with different scores")
    raw, obj = with_score[-1]
    if data and _squash(raw) in _squash("\n".join(data)):
        raise ReplyError("copied", "reply repeats a score object found in the agent's own text")
    score = _score_value(obj["score"])
    rationale = obj.get("rationale", "")
    rationale = rationale if isinstance(rationale, str) else as_text(rationale)
    return JudgeVerdict(score=score, rationale=clip_text(rationale.strip(), 2000))
