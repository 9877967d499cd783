"""signals_held(): while a trace job runs in a waiter's place on the main thread, a request to stop the process
(Ctrl-C, SIGTERM, SIGHUP) waits for the job to end.

On the writer thread no handler ever runs (Python runs them on the main thread only), so a Ctrl-C or a server's
SIGTERM handler never cut a build or a store write short. Run in flush()'s place on the main thread, the
handler's exception did: the episode was lost, and a store could be left inside an open transaction.

Only these three are held: a SIGALRM timeout, a SIGPROF sampler or a SIGUSR1 dump keeps running as it came.
Holding swaps the signal's Python handler for a recorder and back, so OS-level flags set on it
(`signal.siginterrupt(sig, False)`'s SA_RESTART) are reset, as any `signal.signal` call resets them; Python
itself retries a system call a signal interrupted (PEP 475).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

try:  # the C functions under `signal`'s own: its enum wrapping costs a microsecond or so a call
    from _signal import getsignal
    from _signal import signal as set_handler
except ImportError:  # another interpreter
    from signal import getsignal
    from signal import signal as set_handler

Handler = Callable[[int, FrameType | None], Any]

_STOPS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Hold:
    """The signals held on the main thread, and those that came meanwhile, in order.

    A second of the same signal that comes while the job's own work runs (`forcible()`, not the bookkeeping
    around it) goes to its handler at once, after every signal held so far, as "press Ctrl-C again to force"
    does: a store write that hangs can still be stopped (the job fails with the handler's exception), and a
    handler that counts presses (graceful, then forced) sees both. Later ones go through too."""

    def __init__(self) -> None:
        self.handlers: dict[int, Handler] = {}
        self.came: list[int] = []
        self.forced: set[int] = set()
        self.may_force = False

    def hold(self, signum: int, frame: FrameType | None) -> None:
        self.came.append(signum)
        if self.may_force and (signum in self.forced or self.came.count(signum) > 1):
            self.forced.add(signum)
            came, self.came = self.came, []  # one step, no handler between: a press meanwhile is held anew
            _deliver(came, self, frame)  # all held so far, in the order they came

    def handler(self, signum: int) -> Any:
        """The handler a signal goes to now: the one held from it, or the one installed since (a handler
        that installs another, as "press again to force" often does; or the job's own)."""
        current = getsignal(signum)
        return self.handlers[signum] if current == self.hold else current

    @contextmanager
    def forcible(self, may: bool = True) -> Iterator[None]:
        before, self.may_force = self.may_force, may
        try:
            yield
        finally:
            self.may_force = before


_current: Hold | None = None  # the main thread's, while a hold lasts (only the outermost swaps handlers)


@contextmanager
def signals_held() -> Iterator[Hold | None]:
    """Hold SIGINT, SIGTERM and SIGHUP where a Python handler has them (Ctrl-C's `default_int_handler`, a
    server's, asyncio's), then hand each that came to its handler once the block ends (the one it had, or one
    installed since, see `Hold.handler`): each once, in the order they came, a handler's exception raised
    once the others have run, as the interpreter does. A loop that learns of signals from its wakeup fd
    (asyncio's `add_signal_handler`), which the signal itself already wrote, so sees each once. Signals at
    SIG_DFL or SIG_IGN are left alone, as is everything off the main thread (yields None). Nested, the inner
    block holds with the outer's `Hold`, its bookkeeping not forcible.
    """
    global _current
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    if _current is not None:
        with _current.forcible(False):
            yield _current
        return
    held = _current = Hold()
    try:
        for signum in _STOPS:
            handler = getsignal(signum)
            if callable(handler):
                held.handlers[signum] = handler
                try:
                    set_handler(signum, held.hold)
                except ValueError:  # a subinterpreter's main thread: its handlers are not its own to change
                    del held.handlers[signum]
                    break
        yield held
    finally:
        held.may_force = False
        try:
            _restore(list(held.handlers.items()), held.hold)
        finally:
            _current = None
            _deliver(held.came, held)


def _forget_in_child() -> None:
    """A child forked inside a hold (multiprocessing's fork) gets the handlers back and none of the parent's
    held signals: it may never leave the block that would have restored them."""
    global _current
    held, _current = _current, None
    if held is not None:
        held.came.clear()
        _restore(list(held.handlers.items()), held.hold)
        held.handlers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _restore(handlers: list[tuple[int, Handler]], hold: Handler) -> None:
    """Each handler back, whatever one of them raises (one restored may be called at once), unless the held
    block set one of its own, which stays."""
    if not handlers:
        return
    (signum, handler), rest = handlers[0], handlers[1:]
    try:
        if getsignal(signum) == hold:
            set_handler(signum, handler)
    finally:
        _restore(rest, hold)


def _deliver(signals: list[int], held: Hold, frame: FrameType | None = None) -> None:
    """Each signal to the handler it goes to now (see `Hold.handler`), in turn; one that raises still lets
    the next run, its exception the next's context, as the interpreter runs each signal that came."""
    if not signals:
        return
    signum, rest = signals[0], signals[1:]
    try:
        handler = held.handler(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)  # its default action, as it would have had
    finally:
        _deliver(rest, held, frame)
