"""Trace types: the only contract between capture (tracing, store) and training (judge, trainer).

Everything here is plain pydantic so an Episode can leave the process as JSON (store, JSONL export, Ray) and
come back unchanged. Messages are kept as plain dicts (role, content, tool_calls...) rather than langchain
objects, so the trainer never needs langchain to read a trace.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def new_id() -> str:
    """128 random bits as 32 hex digits, the shape of `uuid4().hex`, without building a UUID object: the trace
    writer makes one per action and episode (2.0 us each via uuid4, 0.5 us this way)."""
    return os.urandom(16).hex()


class ToolCall(BaseModel):
    """A tool call an LLM asked for (OpenAI shape: id, name, arguments)."""

    id: str | None = None
    name: str
    args: dict[str, Any] = Field(default_factory=dict)


class ToolResult(BaseModel):
    """What a tool gave back; `error` is set when the tool raised or refused (sandbox limits, network).
    `paused` marks a tool that paused in `interrupt()` (an approval step), `interrupt` holding what it asked:
    control flow, not an error; the call's result comes when the thread resumes (`TraceStore.join_thread`
    adds it after this one).

    The judge scores the model's call by this result, so a result that is not simply "the call ran" says so:
    `ran_call` is the call that ran where it differs from the one the model asked for (a human reviewer's edit,
    a middleware that rewrote the arguments), and `given_by` is set when no tool ran and the model was told
    this instead: `<lc_source>:<decision>` for a message langchain's agent harness marked
    (`hitl_interrupt_decision:respond`, `...:reject`), else "node" (a middleware that answered, a refused or
    limited call, a structured-output reply)."""

    tool_call_id: str | None = None
    name: str
    output: str = ""
    error: str | None = None
    paused: bool = False
    interrupt: Any = None
    latency_s: float | None = None
    ran_call: ToolCall | None = None
    given_by: str | None = None


class Action(BaseModel):
    """One agent's turn inside one node: the unit the judge scores and the loss trains on.

    `kind` is "llm" for a chat-model call (trainable when it has token ids) and "node" for a node turn that
    made no model call (a ToolNode, a router): it still shows in the trace so the judge sees the whole team.

    `agent` is the agent boundary (by default the outermost node below the instrumented graph, e.g. a
    supervisor's worker); `path` is the full node path inside it (`researcher/agent`). LangGraph control flow is
    not failure: `handoff` lists where a Command sent control (a handoff tool, `Command(graph=Command.PARENT)`),
    and `status` is "interrupted" for a node paused by `interrupt()`. A node retried by its RetryPolicy gives one
    action per `attempt`; a failed attempt has status "error" and trains only when `train_failed` is set, and
    so does a model call whose node paused in `interrupt()` (the node reruns from its start on resume, so the
    call's reply was thrown away like a failed attempt's). A model call that asks again what the model call just
    before it in the same node task asked and failed on (ModelRetryMiddleware, ModelFallbackMiddleware,
    `with_fallbacks`, a node's own retry loop) has `retry_of`, the failed call's id: the failed call stays failed, and the judge reads the two as a retry. A node a LangGraph
    cache answered (a `CachePolicy` hit) did not run: it is a node action marked `cached`, with the stored update
    as its output.
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=new_id)
    episode_id: str = ""
    kind: Literal["llm", "node"] = "llm"
    node: str
    agent: str
    path: str | None = None
    attempt: int = 1
    retry_of: str | None = None
    cached: bool = False
    status: Literal["ok", "error", "interrupted"] = "ok"
    handoff: list[str] | None = None
    train_failed: bool = False
    step: int | None = None
    checkpoint_ns: str | None = None
    parent_id: str | None = None
    index: int = 0
    input_messages: list[dict[str, Any]] = Field(default_factory=list)
    output_message: dict[str, Any] | None = None
    node_input: Any = None
    node_output: Any = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_results: list[ToolResult] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    output_logprobs: list[float] | None = None
    # the temperature the output was sampled at (0: greedy): the behaviour distribution the log-probs are under,
    # which training must recompute at the same temperature for the importance ratio to be 1 on-policy
    temperature: float | None = None
    token_source: Literal["backend", "retokenized"] | None = None
    model: str | None = None
    adapter: str | None = None
    latency_s: float | None = None
    started_at: float = Field(default_factory=time.time)
    error: str | None = None

    @property
    def output_text(self) -> str:
        if self.output_message is None:
            return ""
        content = self.output_message.get("content", "")
        return content if isinstance(content, str) else str(content)

    @property
    def trainable(self) -> bool:
        # A model call inside a failed attempt is what the retry threw away: not a normal sample to learn from
        # unless the user asked for it (instrument(..., train_failed_attempts=True)).
        ok = self.status == "ok" or self.train_failed
        return ok and self.kind == "llm" and bool(self.output_token_ids) and self.prompt_token_ids is not None


class Task(BaseModel):
    """One task: the graph's input, and the reference the judge and outcome may check against."""

    id: str
    input: Any
    reference: Any = None


class Episode(BaseModel):
    """One run of the graph on one task: its input, every Action in order, the final state and outcome.

    One call of the graph is one Episode. A call that paused in `interrupt()` has status "interrupted" and the
    interrupts' values (one stopped at a static breakpoint, `interrupt_before`/`interrupt_after`, has it too,
    with no values and `metadata["paused_before"]`: the nodes it goes on with); its resume is the next call,
    another Episode of the same `metadata["thread_id"]` (TraceStore.join_thread makes one Episode of a thread
    when it should be judged and trained as one).
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=new_id)
    run: str = "default"
    task_id: str | None = None
    input: Any = None
    final_state: Any = None
    reference: Any = None
    outcome: float | None = None
    actions: list[Action] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    error: str | None = None
    status: Literal["ok", "error", "interrupted"] = "ok"
    interrupts: list[Any] = Field(default_factory=list)

    def actions_of(self, agent: str) -> list[Action]:
        return [a for a in self.actions if a.agent == agent]

    @property
    def agents(self) -> list[str]:
        return list(dict.fromkeys(a.agent for a in self.actions))


class Reward(BaseModel):
    """A judge's verdict on one Action. `score is None` means unscored: masked out of the loss, never zero."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=new_id)
    action_id: str
    episode_id: str
    agent: str
    judge: str
    score: float | None = None
    raw_score: float | None = None
    rationale: str = ""
    unscored_reason: str | None = None
    repaired: bool = False
    override_by: str | None = None
    override_reason: str | None = None
    created_at: float = Field(default_factory=time.time)

    @property
    def scored(self) -> bool:
        return self.score is not None
