"""Test doubles that behave like the real thing: an OpenAI-compatible HTTP server on loopback that replies
from a script, and a scripted langchain-core chat model for tests that need no connection at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from .openai_server import OpenAIServer, Request, Response, ScriptedReply, error_response

__all__ = ["OpenAIServer", "Request", "Response", "ScriptedChatModel", "ScriptedReply", "error_response"]


class ScriptedChatModel(BaseChatModel):
    """A chat model whose reply is `reply(messages)`: a string, an AIMessage, or an exception to raise.

    `calls` records every message list it was given, so tests can check what a caller sent.
    """

    reply: Callable[[list[BaseMessage]], str | AIMessage | BaseException]
    calls: list[list[BaseMessage]] = []

    def model_post_init(self, context: Any) -> None:
        self.calls = []

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:  # type: ignore[override]
        """Tools change nothing here (the reply function decides any tool calls), so the prebuilt agents that
        bind them (`create_agent`, `create_react_agent`, `create_supervisor`) can drive this model."""
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: Sequence[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.calls.append(list(messages))
        out = self.reply(list(messages))
        if isinstance(out, BaseException):
            raise out
        message = out if isinstance(out, AIMessage) else AIMessage(content=out)
        return ChatResult(generations=[ChatGeneration(message=message)])
