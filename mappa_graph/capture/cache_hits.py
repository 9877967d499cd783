"""Node tasks a LangGraph cache answered. A node with a `CachePolicy`, on a graph compiled with a cache, does not
run on a hit: LangGraph applies the writes it stored and sends no callback, so the episode lost the node (the
judge read its output in the next node's input with no action that made it). The instrumented graph runs on a
copy of the graph whose cache is this wrapper: it answers exactly as the user's cache does and reports each hit
to the trace collectors in the task's callbacks, which record it as the node's action, marked `cached`.

LangGraph asks the cache with keys only (`BaseCache.get(keys)`); the tasks they stand for are those of the
graph loop that asks, whose `match_cached_writes` calls it: the loop is found as the caller's `self`. When a
LangGraph version asks from elsewhere, hits are simply not reported, and the graph runs as before. Not
covered: a subgraph compiled with a cache of its own (LangGraph asks that one, which is not wrapped).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from langgraph.cache.base import BaseCache

from .collector import TraceCollector


class RecordingCache(BaseCache):
    """The user's cache, with its hits reported; every answer is the inner cache's, unchanged."""

    def __init__(self, inner: BaseCache) -> None:
        super().__init__(serde=inner.serde)
        self.inner = inner

    def get(self, keys: Sequence[Any]) -> dict[Any, Any]:
        found = self.inner.get(keys)
        if found:
            _report(sys._getframe(1), found)
        return found

    async def aget(self, keys: Sequence[Any]) -> dict[Any, Any]:
        caller = sys._getframe(1)  # the loop's coroutine awaiting this one, before the await below
        found = await self.inner.aget(keys)
        if found:
            _report(caller, found)
        return found

    def set(self, pairs: Mapping[Any, Any]) -> None:
        self.inner.set(pairs)

    async def aset(self, pairs: Mapping[Any, Any]) -> None:
        await self.inner.aset(pairs)

    def clear(self, namespaces: Sequence[Any] | None = None) -> None:
        self.inner.clear(namespaces)

    async def aclear(self, namespaces: Sequence[Any] | None = None) -> None:
        await self.inner.aclear(namespaces)


def _report(caller: Any, found: Mapping[Any, Any]) -> None:
    tasks = getattr(caller.f_locals.get("self"), "tasks", None)
    if not isinstance(tasks, Mapping):
        return
    # the tasks as LangGraph asks for them: of two with one key (two equal Sends), the later gets the writes and
    # the other runs
    asked = {(t.cache_key.ns, t.cache_key.key): t for t in tasks.values()
             if getattr(t, "cache_key", None) is not None and not t.writes}
    at = time.time()
    for key, task in asked.items():
        if key not in found:
            continue
        callbacks = task.config.get("callbacks")
        for handler in getattr(callbacks, "handlers", None) or ():
            if isinstance(handler, TraceCollector):
                handler.on_cached_task(task.name, task.input, task.config.get("metadata") or {},
                                       getattr(callbacks, "parent_run_id", None), _update(found[key]), at)


def _update(writes: Any) -> Any:
    """What the node returned, as far as its stored writes tell: its state update (the channels of its
    graph's state), or a `@task`'s return value."""
    written = {channel: value for channel, value in writes or () if isinstance(channel, str)}
    if set(written) == {"__return__"}:
        return written["__return__"]
    return {channel: value for channel, value in written.items()
            if not channel.startswith(("__", "branch:"))}
