"""Capture: record what each agent of a running LangGraph app did, with no change to the app.

`instrument(graph)` wraps a compiled graph; `TraceCollector` is the langchain-core callback that attributes each
model and tool call to its node; `TraceStore` keeps episodes and rewards in SQLite, the only contract between
capture and training. Never imports torch (enforced by tests/test_import_rules.py).
"""

from __future__ import annotations

from .collector import TraceCollector
from .instrument import InstrumentedGraph, instrument
from .store import TraceStore, join_episodes

__all__ = ["InstrumentedGraph", "TraceCollector", "TraceStore", "instrument", "join_episodes"]
