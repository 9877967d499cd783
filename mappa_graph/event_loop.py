"""One long-lived event loop in a daemon thread, for sync code that has to run coroutines (a judge's `score()`,
a rollout of an app whose tools only run async).

A fresh `asyncio.run` per call breaks clients that pool connections per loop: langchain-openai caches one async
httpx client per base URL, and its sockets die with the first loop ("Event loop is closed"; an `asyncio.Event`
"bound to a different event loop"). Submitting to this loop from any thread also works from inside a running
event loop (a notebook, an async server), where `asyncio.run` refuses.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """`run(coro)` runs the coroutine on this loop's thread (started on first use) and returns its result."""

    def __init__(self, name: str, *, own_thread_hint: str) -> None:
        self.name, self.own_thread_hint = name, own_thread_hint
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"called from the {self.name} thread itself: {self.own_thread_hint}")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise
