"""LLMJudge: MAPPA's coach, an LLM that scores every action of an episode in context, over any chat model.

For each action the judge sees what the reference coach sees (the task, the agent's role and instructions, what
it saw, what it produced, its tool calls with their output and errors, optionally the reference answer and the
final outcome) plus the team's transcript up to that action, and answers JSON `{"score": 0-10, "rationale"}`;
scores are divided by 10. All agent and tool text reaches the judge only inside data blocks whose markers carry
a random per-prompt code and cannot be forged (any `<<<` or `>>>` inside the data is escaped).

Robustness, where the reference falls back to 5/10 on any failure:
- transport errors (connection, timeout, 429, 5xx) are retried with exponential back-off and jitter;
- a reply that is empty, truncated, not JSON, ambiguous, out of range or that copies a score object from the
  agent's own text gets one follow-up (after the same back-off) asking for the exact format (`repaired=True`
  when that works), then is marked unscored with the reason. Nothing is clamped: a score of 11 is re-asked, never turned into 10;
- unscored actions carry `score=None` and are masked out of the loss.

Scored verdicts are cached by a hash of everything the judge was shown (not the random marker code), in memory
and optionally in an SQLite file, so re-scoring the same actions makes no calls. Calls run concurrently on the
model's `ainvoke`, at most `max_concurrency` at a time. This module never imports torch, transformers or langgraph.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain_core.exceptions import ModelError
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig

from ..errors import JudgeError, ReplyError
from ..event_loop import BackgroundLoop
from ..traces import Action, Episode, Reward
from .llm_cache import JudgeCache
from .llm_prompt import DEFAULT_RUBRIC, JudgePrompt, build_prompt, clip_text, repair_request
from .llm_reply import parse_reply, reply_text

log = logging.getLogger(__name__)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed: connection trouble, timeouts, 408/409/429 and 5xx."""
    if isinstance(exc, ModelError):  # langchain-core's provider-neutral errors say so themselves
        return bool(exc.is_retryable)
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    status = getattr(exc, "status_code", None) or getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return status in (408, 409, 429) or status >= 500
    return type(exc).__name__ in {"APIConnectionError", "APITimeoutError", "ConnectError", "ReadTimeout",
                                  "RemoteProtocolError", "ServiceUnavailable", "ResourceExhausted"}


@dataclass
class JudgeStats:
    """Counters over a judge's life. Each returned Reward counts once in `scored` or in `unscored[kind]`;
    `calls` counts model requests (retries and repairs included), `repaired` fresh verdicts that needed a
    follow-up, `cache_hits` rewards served without a call."""

    calls: int = 0
    retries: int = 0
    cache_hits: int = 0
    scored: int = 0
    repaired: int = 0
    unscored: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def add_unscored(self, kind: str) -> None:
        with self._lock:
            self.unscored[kind] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"calls": self.calls, "retries": self.retries, "cache_hits": self.cache_hits,
                    "scored": self.scored, "repaired": self.repaired, "unscored": dict(self.unscored)}


@dataclass
class _Verdict:
    score: float | None
    rationale: str = ""
    repaired: bool = False
    reason: str | None = None
    kind: str | None = None


class _CallFailed(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


# ---- the sync bridge ----------------------------------------------------------------------------------
_JUDGE_LOOP = BackgroundLoop("mappa-judge-loop", own_thread_hint="await ascore() there, not score()")


# ---- the judge ----------------------------------------------------------------------------------------
EpisodeItem = Episode | tuple[Episode, Sequence[Action] | None]


def _model_namespace(chat_model: Any) -> str:
    model = getattr(chat_model, "model_name", None) or getattr(chat_model, "model", None)
    name = f"{type(chat_model).__name__}:{model or ''}"
    temperature = getattr(chat_model, "temperature", None)
    return name + (f":t={temperature}" if temperature is not None else "")


class LLMJudge:
    """A process judge over any langchain-core chat model (local PolicyChatModel, ChatOpenAI on vLLM or any
    OpenAI-compatible endpoint, any provider). Set temperature 0 on the model, as the reference does.

    `roles` maps agent names to a role description (default: the system prompt the agent saw). Only actions of
    `kinds` (default "llm": model calls, the trainable ones) and of `agents` (default all) are judged.
    `max_concurrency` bounds the requests in flight in one `score`/`score_many` call.
    """

    def __init__(
        self,
        chat_model: BaseChatModel,
        *,
        rubric: str = DEFAULT_RUBRIC,
        roles: Mapping[str, str] | None = None,
        name: str | None = None,
        agents: Sequence[str] | None = None,
        kinds: Sequence[str] = ("llm",),
        include_reference: bool = True,
        include_outcome: bool = False,
        include_transcript: bool = True,
        max_chars: int = 6000,
        max_concurrency: int = 16,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        timeout_s: float | None = None,
        repair_attempts: int = 1,
        cache: bool | JudgeCache = True,
        cache_path: str | Path | None = None,
        cache_namespace: str | None = None,
        config: RunnableConfig | None = None,
        strict: bool = False,
    ) -> None:
        if not hasattr(chat_model, "ainvoke"):
            raise TypeError(f"LLMJudge needs a langchain-core chat model (with ainvoke), got {type(chat_model).__name__}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be at least 1")
        if max_retries < 0 or repair_attempts < 0:
            raise ValueError(f"max_retries={max_retries} and repair_attempts={repair_attempts} must be >= 0")
        self.chat_model = chat_model
        self.rubric = rubric
        self.roles = dict(roles or {})
        self.namespace = cache_namespace or _model_namespace(chat_model)
        self.name = name or f"llm:{getattr(chat_model, 'model_name', None) or type(chat_model).__name__}"
        self.agents = set(agents) if agents is not None else None
        self.kinds = set(kinds)
        self.section_options = {"roles": self.roles, "include_reference": include_reference,
                                "include_outcome": include_outcome, "include_transcript": include_transcript,
                                "max_chars": max_chars}
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.repair_attempts = repair_attempts
        if isinstance(cache, JudgeCache):
            self.cache: JudgeCache | None = cache
        else:
            self.cache = JudgeCache(cache_path) if cache or cache_path is not None else None
        self.config: RunnableConfig = {"run_name": "mappa-judge", **(config or {})}
        self.config["tags"] = [*self.config.get("tags", []), "mappa-judge"]
        self.strict = strict
        self.stats = JudgeStats()

    def prompt(self, episode: Episode, action: Action) -> JudgePrompt:
        return build_prompt(episode, action, rubric=self.rubric, namespace=self.namespace, **self.section_options)

    # ---- public scoring ---------------------------------------------------------------------------------
    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        """Score the episode's actions (all by default), concurrently; blocks, even inside a running loop."""
        return _JUDGE_LOOP.run(self.ascore(episode, actions))

    def score_many(self, items: Iterable[EpisodeItem]) -> list[list[Reward]]:
        """Score many episodes (or `(episode, actions)` pairs) in one concurrent batch; one list per item."""
        return _JUDGE_LOOP.run(self.ascore_many(list(items)))

    async def ascore(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        return (await self.ascore_many([(episode, actions)]))[0]

    async def ascore_many(self, items: Iterable[EpisodeItem]) -> list[list[Reward]]:
        jobs: list[list[tuple[Episode, Action, JudgePrompt]]] = []
        for item in items:
            episode, chosen = item if isinstance(item, tuple) else (item, None)
            chosen = episode.actions if chosen is None else chosen
            jobs.append([(episode, a, self.prompt(episode, a)) for a in chosen if self._wanted(a)])
        semaphore = asyncio.Semaphore(self.max_concurrency)
        tasks: dict[str, asyncio.Future[_Verdict]] = {}
        for _, _, prompt in (job for episode_jobs in jobs for job in episode_jobs):
            if prompt.key not in tasks and (self.cache is None or self.cache.get(prompt.key) is None):
                tasks[prompt.key] = asyncio.ensure_future(self._verdict(prompt, semaphore))
        try:
            fresh = dict(zip(tasks, await asyncio.gather(*tasks.values()))) if tasks else {}
        except BaseException:
            for task in tasks.values():
                task.cancel()
            raise
        results, firsts, missed = [], set(), Counter()
        for episode_jobs in jobs:
            rewards = []
            for episode, action, prompt in episode_jobs:
                if prompt.key in fresh and prompt.key not in firsts:
                    firsts.add(prompt.key)
                    verdict = fresh[prompt.key]
                    self._remember(prompt.key, verdict)
                    self.stats.add(repaired=int(verdict.repaired and verdict.score is not None))
                else:  # from the cache, or a duplicate of an action judged in this same batch
                    verdict = fresh.get(prompt.key) or _Verdict(**self.cache.get(prompt.key))  # type: ignore[union-attr]
                    self.stats.add(cache_hits=1)
                if verdict.score is None:
                    missed[verdict.kind or "unknown"] += 1
                rewards.append(self._reward(episode, action, verdict))
            results.append(rewards)
        if missed:
            total = sum(len(episode_jobs) for episode_jobs in jobs)
            log.warning("judge '%s' left %d of %d actions unscored (%s); they are excluded from the loss",
                        self.name, sum(missed.values()), total, ", ".join(f"{k}: {n}" for k, n in missed.items()))
        return results

    # ---- internals --------------------------------------------------------------------------------------
    def _wanted(self, action: Action) -> bool:
        return action.kind in self.kinds and (self.agents is None or action.agent in self.agents)

    def _remember(self, key: str, verdict: _Verdict) -> None:
        if self.cache is not None and verdict.score is not None:
            self.cache.put(key, {"score": verdict.score, "rationale": verdict.rationale, "repaired": verdict.repaired})

    def _reward(self, episode: Episode, action: Action, verdict: _Verdict) -> Reward:
        where = f"action {action.id[:8]} (node '{action.node}', agent '{action.agent}')"
        if verdict.score is None:
            self.stats.add_unscored(verdict.kind or "unknown")
            reason = f"judge '{self.name}' could not score {where}: {verdict.reason}"
            if self.strict:
                raise JudgeError(reason)
            log.debug(reason)
        else:
            self.stats.add(scored=1)
            reason = None
        return Reward(
            action_id=action.id,
            episode_id=action.episode_id or episode.id,
            agent=action.agent,
            judge=self.name,
            score=None if verdict.score is None else verdict.score / 10,
            raw_score=verdict.score,
            rationale=verdict.rationale,
            unscored_reason=reason,
            repaired=verdict.repaired,
        )

    async def _verdict(self, prompt: JudgePrompt, semaphore: asyncio.Semaphore) -> _Verdict:
        messages = list(prompt.messages)
        problem: ReplyError | None = None
        for attempt in range(self.repair_attempts + 1):
            try:
                reply = await self._call(messages, semaphore)
            except _CallFailed as exc:
                earlier = f" (after an unusable reply: {problem})" if problem else ""
                return _Verdict(None, reason=f"{exc}{earlier}", kind=exc.kind)
            try:
                verdict = parse_reply(reply, nonce=prompt.nonce, data=prompt.data)
            except ReplyError as exc:
                problem = exc
                messages += [AIMessage(content=reply_text(reply) or "(empty reply)"),
                             HumanMessage(content=repair_request(exc))]
                if attempt < self.repair_attempts:  # an empty or garbled reply is often an overloaded server
                    await asyncio.sleep(self._backoff(attempt))
                continue
            return _Verdict(verdict.score, verdict.rationale, repaired=attempt > 0)
        assert problem is not None
        asked = f"still unusable after {self.repair_attempts} repair request(s)" if self.repair_attempts else "no repair"
        return _Verdict(None, reason=f"{problem} ({asked})", kind=problem.kind)

    async def _call(self, messages: list[BaseMessage], semaphore: asyncio.Semaphore) -> Any:
        attempt = 0
        while True:
            try:
                async with semaphore:  # back-off sleeps happen outside, so a waiting retry frees its slot
                    self.stats.add(calls=1)
                    call = self.chat_model.ainvoke(messages, config=self.config)
                    return await (asyncio.wait_for(call, self.timeout_s) if self.timeout_s else call)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any provider's error: classify, retry the transient ones, record the rest
                transient = is_transient(exc)
                detail = f"{type(exc).__name__}: {clip_text(str(exc), 300)}"
                if not transient:
                    raise _CallFailed("call_error", f"judge call failed: {detail}") from exc
                if attempt >= self.max_retries:
                    raise _CallFailed("transport", f"judge call failed after {attempt + 1} attempt(s): {detail}") from exc
                self.stats.add(retries=1)
                log.debug("judge '%s' retries after %s (attempt %d)", self.name, detail, attempt + 1)
                await asyncio.sleep(self._backoff(attempt))
                attempt += 1

    def _backoff(self, attempt: int) -> float:
        """Exponential back-off with jitter: backoff_s * 2**attempt, capped, times a random 0.5-1."""
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
