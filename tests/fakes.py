"""A scripted chat model for tests: its reply is a pure function of the messages it sees, so concurrent
episodes give reproducible, distinguishable traces (LangGraph's own tests keep a fake of this kind)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

Script = Callable[[list[BaseMessage]], AIMessage]


class ScriptedChatModel(BaseChatModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    script: Any
    delay_s: float = 0.0
    name_: str = "scripted"

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        return ChatResult(generations=[ChatGeneration(message=self.script(messages))])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any):  # type: ignore[override]
        return self


def task_number(messages: Sequence[BaseMessage]) -> int:
    for m in messages:
        match = re.search(r"task-(\d+)", str(m.content))
        if match:
            return int(match.group(1))
    raise AssertionError("no task-N in messages")


class QueuedBuilds:
    """A TraceCollector executor that only queues each episode build, `(build, (events,))`, so a test can look
    at a run's raw events before running the build itself."""

    def __init__(self) -> None:
        self.queued: list[tuple[Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, /, *args: Any) -> QueuedBuilds:
        self.queued.append((fn, args))
        return self

    def result(self, timeout: float | None = None) -> None:
        return None

