"""PolicyChatModel: a langchain-core chat model backed by one agent's adapter in AgentPolicies.

A node uses it like any chat model (`invoke`, `bind_tools`); each reply carries the exact prompt and output
token ids and behaviour log-probs in `response_metadata["mappa"]`, which the tracer copies onto the Action,
so the loss trains on the tokens that were sampled, never on a re-encoding of the text.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

from ..messages import MAPPA_KEY, content_text, message_to_dict

if TYPE_CHECKING:
    from .policies import Generation

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def to_hf_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """langchain messages to the Hugging Face chat-template shape (tool calls as OpenAI function objects)."""
    out = []
    for message in messages:
        d = message_to_dict(message)
        hf: dict[str, Any] = {"role": d["role"], "content": content_text(d["content"])}
        if d.get("tool_calls"):
            hf["tool_calls"] = [
                {"type": "function", "id": c.get("id"), "function": {"name": c["name"], "arguments": c["args"]}}
                for c in d["tool_calls"]
            ]
        if d["role"] == "tool":
            hf["tool_call_id"] = d.get("tool_call_id")
            if d.get("name"):
                hf["name"] = d["name"]
        out.append(hf)
    return out


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Split model text into (content, tool_calls, invalid_tool_calls) from <tool_call>{json}</tool_call> blocks."""
    calls, invalid = [], []
    for match in _TOOL_CALL.finditer(text):
        raw = match.group(1)
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        try:
            data = json.loads(raw)
            name, args = data["name"], data.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})
        except (ValueError, KeyError, TypeError) as exc:
            invalid.append({"name": None, "args": raw, "id": call_id, "error": str(exc), "type": "invalid_tool_call"})
    content = _TOOL_CALL.sub("", text).strip() if calls or invalid else text
    return content, calls, invalid


class PolicyChatModel(BaseChatModel):
    """Chat model for one agent: its calls are generated under that agent's LoRA adapter."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    policies: Any = Field(description="the AgentPolicies that holds the base model and adapters")
    agent: str = Field(description="which agent's adapter answers")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    do_sample: bool = True

    @property
    def _llm_type(self) -> str:
        return "mappa-policy"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.policies.base_name, "agent": self.agent}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt_ids, sampling = self._sampling(messages, run_manager, kwargs)
        gen = self.policies.generate(self.agent, prompt_ids, **sampling)
        return self._reply(gen, sampling, stop)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """With the rollout engine running, a coroutine waits on its batch without holding a thread."""
        engine = self.policies._engine
        if engine is None or not engine.alive or self.policies.lock._is_owned():
            return await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)
        from .engine import SampleRequest

        prompt_ids, sampling = self._sampling(messages, run_manager, kwargs)
        adapter = self.policies.adapter_of[self.agent]
        gen = await engine.asample(SampleRequest(adapter=adapter, prompt_ids=prompt_ids, **sampling))
        return self._reply(gen, sampling, stop)

    def _sampling(
        self, messages: list[BaseMessage], run_manager: Any, kwargs: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any]]:
        """The prompt ids and how to sample them: the model's settings, overridden per call by kwargs, with the
        trainer's greedy flag, temperature and the call's seed from the run metadata (the trainer's win)."""
        prompt_ids = self.policies.render(to_hf_messages(messages), tools=kwargs.get("tools"))
        meta = (run_manager.metadata if run_manager is not None else None) or {}
        sampling = {
            "max_new_tokens": int(kwargs.get("max_new_tokens", self.max_new_tokens)),
            "temperature": float(meta.get("mappa_temperature") or kwargs.get("temperature", self.temperature)),
            "do_sample": bool(kwargs.get("do_sample", self.do_sample)) and not meta.get("mappa_greedy", False),
            "seed": call_seed(meta, self.agent, prompt_ids),
        }
        return prompt_ids, sampling

    def _reply(self, gen: Generation, sampling: dict[str, Any], stop: list[str] | None) -> ChatResult:
        policies = self.policies
        output_ids, logprobs = gen.output_token_ids, gen.output_logprobs
        text = policies.tokenizer.decode(output_ids, skip_special_tokens=True)
        if stop:
            output_ids, logprobs, text = _cut_at_stop(output_ids, logprobs, text, stop, policies.tokenizer.decode)
        content, calls, invalid = parse_tool_calls(text)
        message = AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid)
        record = {
            "agent": self.agent,
            "adapter": policies.adapter_of[self.agent],
            "model": policies.base_name,
            "prompt_token_ids": gen.prompt_token_ids,
            "output_token_ids": output_ids,
            "output_logprobs": logprobs,
            "token_source": "backend",
            "finished": gen.finished,
            # what the log-probs are under (softmax(logits / T)); 0.0: greedy, log-probs recorded at T=1
            "temperature": sampling["temperature"] if sampling["do_sample"] else 0.0,
        }
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={MAPPA_KEY: record})])

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """Tools reach the chat template as OpenAI function schemas (the format HF templates take)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=formatted, **kwargs)


def call_seed(metadata: Mapping[str, Any], agent: str, prompt: Sequence[Any]) -> int | None:
    """A sampling seed for one call, derived from the episode's `mappa_seed` (set by the trainer) and where the
    call sits in the run, so a rerun of the episode draws the same streams whatever order concurrent episodes
    reach the model in, while no two calls of one episode share a stream.

    Where: the task path (the node names of `langgraph_checkpoint_ns`; its task ids are fresh uuids each run, so
    they cannot be used), the `langgraph_path` that tells two `Send` branches of one node apart, the step, the
    prompt's content, and a counter of the calls made so far by the same node task (two calls of one node with
    the same prompt). `prompt` is token ids, or the messages on a remote backend."""
    base = metadata.get("mappa_seed")
    if base is None:
        return None
    ns = str(metadata.get("langgraph_checkpoint_ns") or "")
    tasks = "|".join(part.split(":", 1)[0] for part in ns.split("|")) if ns else ""
    call = _CALLS.next(f"{base}|{ns}") if ns else 0
    key = (f"{base}|{agent}|{tasks}|{metadata.get('langgraph_path')}|{metadata.get('langgraph_step')}|{call}|"
           f"{_fingerprint(prompt)}")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & 0x7FFFFFFF


def _fingerprint(prompt: Sequence[Any]) -> str:
    """A stable digest of a prompt: token ids as they are, messages by role and text (their ids are random)."""
    if all(isinstance(t, int) for t in prompt):
        text = ",".join(map(str, prompt))
    else:
        text = "\x1e".join(f"{getattr(m, 'type', '')}:{content_text(getattr(m, 'content', m))}" for m in prompt)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class _CallCounter:
    """Calls made so far per node task (keyed by the run's seed and full checkpoint namespace, whose task ids
    are unique to one run). Bounded: the oldest tasks are forgotten, long after they finished."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.counts: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def next(self, task: str) -> int:
        with self.lock:
            n = self.counts.pop(task, 0)
            self.counts[task] = n + 1
            if len(self.counts) > self.capacity:
                self.counts.popitem(last=False)
            return n


_CALLS = _CallCounter()


def _cut_at_stop(
    ids: list[int], logprobs: list[float], text: str, stop: list[str], decode: Callable[..., str]
) -> tuple[list[int], list[float], str]:
    """Truncate at the first stop string, keeping tokens and text aligned (shortest token prefix covering it)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut < 0:
        return ids, logprobs, text
    for n in range(1, len(ids) + 1):
        if len(decode(ids[:n], skip_special_tokens=True)) >= cut:
            return ids[:n], logprobs[:n], text[:cut]
    return ids, logprobs, text[:cut]


def assistant_reply(
    ids: list[int], logprobs: list[float], tops: list[Any], finished: bool, stop: Sequence[str] | None,
    decode: Callable[..., str],
) -> tuple[list[int], list[float], list[Any], bool, dict[str, Any]]:
    """What an OpenAI-compatible server answers for sampled tokens: cut at the first stop string (tokens, log-probs
    and text kept aligned; a cut counts as finished) and the text parsed into an assistant message with its tool
    calls. Returns (ids, logprobs, top logprobs, finished, message)."""
    text = decode(ids, skip_special_tokens=True)
    if stop:
        cut_ids, _, cut_text = _cut_at_stop(ids, logprobs, text, list(stop), decode)
        if cut_text != text:
            ids, logprobs, tops, text, finished = cut_ids, logprobs[: len(cut_ids)], tops[: len(cut_ids)], cut_text, True
    content, calls, _ = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                                 for c in calls]
    return ids, logprobs, tops, finished, message
