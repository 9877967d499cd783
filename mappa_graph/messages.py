"""Conversions between langchain-core messages and the plain dicts that traces store.

One compact shape everywhere ({"role", "content", "tool_calls", "tool_call_id", "name"}), close to what
Hugging Face chat templates take, so a stored prompt can be re-rendered without langchain.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from pydantic import BaseModel, RootModel

# By message type; a streamed reply's chunks have types of their own (`AIMessageChunk`), and a ChatMessage says its
# role itself (an `assistant` one taken for a user turn would train the model on its own reply as a prompt).
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "AIMessageChunk": "assistant",
          "HumanMessageChunk": "user", "SystemMessageChunk": "system", "ToolMessageChunk": "tool"}
_CHAT_ROLES = {"assistant": "assistant", "ai": "assistant", "system": "system", "developer": "system", "tool": "tool"}
# Keys the local policy puts in response_metadata; traces keep them as Action fields, not in the message.
MAPPA_KEY = "mappa"


def message_to_dict(message: BaseMessage) -> dict[str, Any]:
    role = _ROLES.get(message.type)
    if role is None:  # a ChatMessage (or its chunk) says its own role; any other type keeps its name
        role = _CHAT_ROLES.get(message.role, "user") if isinstance(message, ChatMessage) else message.type
    out: dict[str, Any] = {"role": role, "content": message.content}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {"id": call.get("id"), "name": call["name"], "args": call.get("args", {})} for call in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        if message.status == "error":
            out["status"] = "error"
    if message.name:
        out["name"] = message.name
    if message.type == "remove":  # a RemoveMessage is only the id of what it removes (or REMOVE_ALL_MESSAGES)
        out["id"] = message.id
    return out


def dict_to_message(data: dict[str, Any]) -> BaseMessage:
    role = data.get("role", "user")
    content = data.get("content", "")
    if role == "assistant":
        calls = [
            {"id": c.get("id"), "name": c["name"], "args": c.get("args", {}), "type": "tool_call"}
            for c in data.get("tool_calls", [])
        ]
        return AIMessage(content=content, tool_calls=calls, name=data.get("name"))
    if role == "system":
        return SystemMessage(content=content)
    if role == "tool":
        return ToolMessage(content=content, tool_call_id=data.get("tool_call_id") or "", name=data.get("name"))
    return HumanMessage(content=content, name=data.get("name"))


def content_text(content: Any) -> str:
    """Flatten message content (a string, or a list of content blocks) to text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and "text" in block:
                parts.append(str(block["text"]))
        return "".join(parts)
    return str(content)


def to_jsonable(value: Any, _depth: int = 0, *, message: Callable[[BaseMessage], Any] = message_to_dict,
                memo: Mapping[int, tuple[Any, Any]] | None = None) -> Any:
    """Make graph state (messages, pydantic models, dataclasses...) storable as JSON without losing meaning;
    what JSON cannot hold becomes its repr, so no state, however odd, loses an episode. `message` converts each
    message (the trace builder passes one that converts each message once). `memo` maps `id(obj)` to
    `(obj, its JSON taken earlier)`: such an object gives a copy of that JSON instead of what it holds now."""
    if _depth > 32:
        return _repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if memo:
        found = memo.get(id(value))
        if found is not None and found[0] is value:
            return copy_json(found[1])
    if isinstance(value, BaseMessage):
        return message(value)
    if isinstance(value, BaseModel):
        try:
            dumped = value.model_dump(mode="json")
        except Exception:  # noqa: BLE001 - a field pydantic cannot write as JSON (an arbitrary type, raw bytes)
            dumped = _model_fields(value)  # each field on its own
        return to_jsonable(dumped, _depth + 1, message=message, memo=memo)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, _depth + 1, message=message, memo=memo) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v, _depth + 1, message=message, memo=memo) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an instance; its class is just a name
        return {f.name: to_jsonable(getattr(value, f.name, None), _depth + 1, message=message, memo=memo)
                for f in dataclasses.fields(value)}  # fields(): no InitVar (not kept), no ClassVar (not data)
    try:
        json.dumps(value)
        return value
    except Exception:  # noqa: BLE001 - not JSON: kept as its repr
        return _repr(value)


JSON_SCALARS = frozenset({str, int, float, bool, type(None)})  # immutable: a copy may share them


def copy_json(value: Any) -> Any:
    """A copy of a converted message or state, nested dicts and lists included. Their parts are JSON-like
    (strings, numbers, dicts and lists from a model's parsed reply), so this walks them directly:
    `copy.deepcopy`'s memo and dispatch made it the trace builder's largest cost (a third of a supervisor
    episode's build). Anything else still goes through deepcopy."""
    kind = type(value)
    if kind is dict:
        return {k: copy_json(v) for k, v in value.items()}
    if kind is list:
        return [copy_json(v) for v in value]
    if kind in JSON_SCALARS:
        return value
    return copy.deepcopy(value)


def _model_fields(model: BaseModel) -> Any:
    """What `model_dump` gives, field by field, unconverted: a RootModel's root, or the fields, the extra
    fields and the computed ones."""
    if isinstance(model, RootModel):
        return model.root
    kind = type(model)
    names = [*kind.model_fields, *(model.model_extra or {}), *kind.model_computed_fields]
    return {name: getattr(model, name, None) for name in names}


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - the app's own __repr__ may fail; the episode must not
        return f"<{type(value).__name__} whose repr() raised>"
