"""The embedded trace store: episodes, actions and rewards in one SQLite file (WAL, one writer).

Each row keeps the full pydantic JSON plus the columns queries filter on, so the schema can grow without
migrations of the payload. Every write is one transaction: an episode lands with all its actions or not at all.
An instrumented graph writing here from its background thread is attached (`attach_writer`): reads wait for the
episodes it still holds, so a call that has returned is always in the store (a read made inside a trace job, a
store write that reads the store, waits for no other thread's job: see InstrumentedGraph._settle).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from ..traces import Action, Episode, Reward
from .courtesy import yield_gil

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    id TEXT PRIMARY KEY, run TEXT NOT NULL, task_id TEXT, outcome REAL, error TEXT,
    started_at REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS episodes_run ON episodes(run, started_at);
CREATE TABLE IF NOT EXISTS actions (
    id TEXT PRIMARY KEY, episode_id TEXT NOT NULL REFERENCES episodes(id), run TEXT NOT NULL,
    agent TEXT NOT NULL, node TEXT NOT NULL, idx INTEGER NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS actions_episode ON actions(episode_id, idx);
CREATE INDEX IF NOT EXISTS actions_run_agent ON actions(run, agent);
CREATE TABLE IF NOT EXISTS rewards (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, action_id TEXT NOT NULL,
    episode_id TEXT NOT NULL, run TEXT NOT NULL, agent TEXT NOT NULL, judge TEXT NOT NULL, score REAL,
    data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS rewards_action ON rewards(action_id);
CREATE INDEX IF NOT EXISTS rewards_run_agent ON rewards(run, agent);
"""


class TraceStore:
    """SQLite trace store. Safe to share between threads (one connection behind a lock); open the same file
    from another process for reading while a run writes (WAL)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # another process writing a long batch holds the write lock for seconds: wait for it, not 5 s only
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=120)
        try:
            self._create()
        except BaseException:
            self._db.close()
            raise
        self._closed = False
        self._writers: list[weakref.WeakMethod[Callable[[], None]]] = []

    def _create(self) -> None:
        """One write transaction makes the schema and its version row: processes opening a new file together
        (rollout workers of one run) each see either nothing or the whole store, never tables without their
        version, which is what another application's database looks like."""
        with self._tx():
            self._refuse_foreign()
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise RuntimeError(
                    f"trace store {self.path} has schema version {row[0]}, newer than this mappa_graph "
                    f"({SCHEMA_VERSION}): upgrade mappa-graph to read it"
                )
        self._set_wal()  # after the check: a foreign file is left as it was
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")

    def _set_wal(self, patience_s: float = 120.0) -> None:
        """Switch the file to WAL, waiting out the others: SQLite answers `database is locked` at once, without
        its busy wait, when another process opening the same new file holds it for its own switch (1 in 240
        openings of 4 processes at once)."""
        deadline = time.monotonic() + patience_s
        delay = 0.001
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _refuse_foreign(self) -> None:
        """Another application's database is refused before anything is written to it (opening it used to add
        this store's tables and switch it to WAL for good, then fail); so is a store whose version is not a
        number."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row is not None else None
        except (sqlite3.Error, ValueError, TypeError):
            version = None
        if version is None:
            raise ValueError(f"{self.path} is an SQLite database but not a mappa_graph trace store (its tables: "
                             f"{', '.join(sorted(tables)[:8])}); nothing was changed: pass the path of a trace "
                             "store, or of a new file")

    # ---- lifecycle --------------------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[None]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def attach_writer(self, flush: Callable[[], None]) -> None:
        """Register the `flush` of something that writes here from a background thread (an instrumented graph):
        every read, and every write that refers to stored episodes (rewards, outcomes), first waits for what it
        still holds, so an episode whose call has returned is always there. Held weakly; the callable decides
        when not to wait (an instrumented graph's, inside a trace job)."""
        self._writers.append(weakref.WeakMethod(flush))  # type: ignore[arg-type]

    def _settle(self) -> None:
        """Wait for the attached background writers (outside the store's lock: they need it to write); a
        write they failed is raised here."""
        for ref in list(self._writers):
            flush = ref()
            if flush is None:
                with suppress(ValueError):  # another thread dropped it first
                    self._writers.remove(ref)
            else:
                flush()

    def close(self) -> None:
        """Close the file once the attached background writers are done (a write they failed is raised after
        closing)."""
        try:
            self._settle()
        finally:
            with self._lock:
                if not self._closed:
                    self._db.close()
                    self._closed = True

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- writes -----------------------------------------------------------------------------------------
    def add_episode(self, episode: Episode) -> None:
        self.add_episodes([episode])

    def add_episodes(self, episodes: Iterable[Episode]) -> None:
        self._write_rows(_episode_rows(episodes))  # serialised before taking the lock: readers wait only for the inserts

    def prepare_write(self, episode: Episode) -> Callable[[], None]:
        """Serialise the episode now and return its write, which needs the episode no more: an instrumented
        graph's writer drops the episode (inside the garbage collector's pause, see courtesy.py) before the
        write waits for the database lock. A subclass with its own `add_episode` or `add_episodes` gets the
        episode through them, as before."""
        own = type(self).add_episode is TraceStore.add_episode and type(self).add_episodes is TraceStore.add_episodes
        return partial(self._write_rows, _episode_rows([episode])) if own else partial(self.add_episode, episode)

    def _write_rows(self, rows: list[tuple[tuple[Any, ...], list[tuple[Any, ...]]]]) -> None:
        with self._tx():
            self._insert_episodes(rows)

    def _insert_episodes(self, rows: list[tuple[tuple[Any, ...], list[tuple[Any, ...]]]]) -> None:
        for head, actions in rows:
            self._db.execute("INSERT OR REPLACE INTO episodes VALUES (?,?,?,?,?,?,?)", head)
            self._db.execute("DELETE FROM actions WHERE episode_id=?", (head[0],))
            self._db.executemany("INSERT INTO actions VALUES (?,?,?,?,?,?,?)", actions)

    def add_rewards(self, rewards: Iterable[Reward]) -> None:
        rewards = list(rewards)
        self._settle()
        with self._tx():
            runs = {}
            for reward in rewards:
                if reward.episode_id not in runs:
                    row = self._db.execute("SELECT run FROM episodes WHERE id=?", (reward.episode_id,)).fetchone()
                    if row is None:
                        raise KeyError(
                            f"reward for unknown episode {reward.episode_id!r}: store the episode before its rewards"
                        )
                    runs[reward.episode_id] = row[0]
                self._db.execute(
                    "INSERT OR REPLACE INTO rewards (id, action_id, episode_id, run, agent, judge, score, data) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (reward.id, reward.action_id, reward.episode_id, runs[reward.episode_id], reward.agent,
                     reward.judge, reward.score, _json(reward)),
                )

    def set_outcome(self, episode_id: str, outcome: float | None) -> None:
        self._settle()
        with self._tx():
            row = self._db.execute("SELECT data FROM episodes WHERE id=?", (episode_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown episode {episode_id!r}")
            data = json.loads(row[0])
            data["outcome"] = outcome
            self._db.execute(
                "UPDATE episodes SET outcome=?, data=? WHERE id=?", (outcome, json.dumps(data), episode_id)
            )

    # ---- reads ------------------------------------------------------------------------------------------
    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        self._settle()
        with self._lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    def episode(self, episode_id: str) -> Episode:
        rows = self._query("SELECT data FROM episodes WHERE id=?", (episode_id,))
        if not rows:
            raise KeyError(f"unknown episode {episode_id!r}")
        return self._assemble(rows[0][0])

    def _assemble(self, head_json: str) -> Episode:
        head = json.loads(head_json)
        rows = self._query("SELECT data FROM actions WHERE episode_id=? ORDER BY idx", (head["id"],))
        head["actions"] = [json.loads(r[0]) for r in rows]
        return Episode.model_validate(head)

    def episodes(
        self,
        *,
        run: str | None = None,
        agent: str | None = None,
        task_id: str | None = None,
        thread_id: str | None = None,
        limit: int | None = None,
    ) -> list[Episode]:
        """Episodes in the order they started; `thread_id` gives the calls of one checkpointed thread (a run that
        paused in interrupt() and its resumes)."""
        sql, params = "SELECT data FROM episodes WHERE 1=1", []
        if run is not None:
            sql, params = sql + " AND run=?", [*params, run]
        if task_id is not None:
            sql, params = sql + " AND task_id=?", [*params, task_id]
        if thread_id is not None:
            sql, params = sql + " AND json_extract(data, '$.metadata.thread_id')=?", [*params, str(thread_id)]
        if agent is not None:
            sql += " AND id IN (SELECT episode_id FROM actions WHERE agent=?)"
            params.append(agent)
        sql += " ORDER BY started_at, rowid"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._assemble(r[0]) for r in self._query(sql, params)]

    def action(self, action_id: str) -> Action:
        rows = self._query("SELECT data, episode_id FROM actions WHERE id=?", (action_id,))
        if not rows:
            raise KeyError(f"unknown action {action_id!r}")
        action = Action.model_validate_json(rows[0][0])
        action.episode_id = action.episode_id or rows[0][1]
        return action

    def actions(self, *, run: str | None = None, agent: str | None = None, episode_id: str | None = None) -> list[Action]:
        sql, params = "SELECT data FROM actions WHERE 1=1", []
        for column, value in (("run", run), ("agent", agent), ("episode_id", episode_id)):
            if value is not None:
                sql, params = sql + f" AND {column}=?", [*params, value]
        sql += " ORDER BY rowid"
        return [Action.model_validate_json(r[0]) for r in self._query(sql, params)]

    def rewards(
        self,
        *,
        run: str | None = None,
        agent: str | None = None,
        episode_id: str | None = None,
        action_id: str | None = None,
        judge: str | None = None,
    ) -> list[Reward]:
        sql, params = "SELECT data FROM rewards WHERE 1=1", []
        for column, value in (("run", run), ("agent", agent), ("episode_id", episode_id), ("action_id", action_id), ("judge", judge)):
            if value is not None:
                sql, params = sql + f" AND {column}=?", [*params, value]
        sql += " ORDER BY seq"
        return [Reward.model_validate_json(r[0]) for r in self._query(sql, params)]

    def runs(self) -> list[str]:
        return [r[0] for r in self._query("SELECT DISTINCT run FROM episodes ORDER BY run")]

    def count(self, table: str = "episodes") -> int:
        if table not in {"episodes", "actions", "rewards"}:
            raise ValueError(f"unknown table {table!r} (tables: episodes, actions, rewards)")
        return int(self._query(f"SELECT COUNT(*) FROM {table}")[0][0])

    def join_thread(self, thread_id: str, *, run: str | None = None,
                    episode_ids: Sequence[str] | None = None) -> Episode:
        """Replace the episodes of a thread (a call that paused in interrupt() and the calls that resumed it) by
        one Episode, `join_episodes` of them, moving their rewards along; returns it. Call it once the thread is
        done and before judging, so the judge sees the whole run and the trainer trains it as one episode.
        `episode_ids` picks the episodes of one branch of a thread that time travel forked (in run order)."""
        parts = self.episodes(thread_id=thread_id, run=run)
        if episode_ids is not None:
            found = {part.id: part for part in parts}
            missing = [i for i in episode_ids if i not in found]
            if missing:
                raise KeyError(f"episodes {missing} are not episodes of thread {thread_id!r}")
            parts = [found[i] for i in episode_ids]
        if not parts:
            raise KeyError(f"no episodes of thread {thread_id!r}" + (f" in run {run!r}" if run else ""))
        joined = join_episodes(parts)
        with self._tx():
            for part in parts[1:]:
                self._db.execute("UPDATE rewards SET episode_id=?, data=json_set(data, '$.episode_id', ?) "
                                 "WHERE episode_id=?", (joined.id, joined.id, part.id))
                self._db.execute("DELETE FROM actions WHERE episode_id=?", (part.id,))
                self._db.execute("DELETE FROM episodes WHERE id=?", (part.id,))
            self._insert_episodes(_episode_rows([joined]))
        return joined

    def delete_episodes_after(self, run: str, iteration: int) -> int:
        """Drop a run's episodes (with their actions and rewards) from iterations after `iteration`: what a
        resumed trainer redoes. Returns how many were dropped."""
        self._settle()
        with self._tx():
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM episodes WHERE run=? AND CAST(json_extract(data, '$.metadata.iteration') AS INTEGER) > ?",
                    (run, iteration),
                ).fetchall()
            ]
            for table, column in (("rewards", "episode_id"), ("actions", "episode_id"), ("episodes", "id")):
                self._db.executemany(f"DELETE FROM {table} WHERE {column}=?", [(i,) for i in ids])
        return len(ids)

    # ---- export -----------------------------------------------------------------------------------------
    def iter_records(self, *, run: str | None = None) -> Iterator[dict[str, Any]]:
        for episode in self.episodes(run=run):
            record = episode.model_dump(mode="json")
            record["rewards"] = [r.model_dump(mode="json") for r in self.rewards(episode_id=episode.id)]
            yield record

    def export_jsonl(self, path: str | Path, *, run: str | None = None) -> int:
        """Write one JSON line per episode (with its actions and rewards); returns the number written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        tmp = path.with_suffix(path.suffix + ".tmp")
        with tmp.open("w") as f:
            for record in self.iter_records(run=run):
                f.write(json.dumps(record) + "\n")
                n += 1
        tmp.replace(path)
        return n


def join_episodes(parts: list[Episode]) -> Episode:
    """One Episode of a thread's calls, in order: the first call's input and id, every call's actions (ids kept,
    re-indexed), the last call's final state, status, interrupts and outcome. A node that paused in interrupt()
    stays in the transcript as paused, before its rerun on resume: that is what happened."""
    if not parts:
        raise ValueError("join_episodes needs at least one episode")
    _refuse_forks(parts)
    first, last = parts[0], parts[-1]
    joined = first.model_copy(deep=True)
    joined.actions = [a.model_copy(deep=True) for part in parts for a in part.actions]
    for i, action in enumerate(joined.actions):
        action.index, action.episode_id = i, joined.id
    _give_resumed_results(joined.actions)
    joined.final_state, joined.outcome, joined.ended_at = last.final_state, last.outcome, last.ended_at
    joined.status, joined.interrupts, joined.error = last.status, list(last.interrupts), last.error
    joined.metadata = {**first.metadata, **{k: v for k, v in last.metadata.items() if k != "start_checkpoint_id"},
                       "joined_episode_ids": [part.id for part in parts]}
    joined.metadata.pop("resumed", None)
    if "paused_before" not in last.metadata:  # the thread went on past its breakpoints
        joined.metadata.pop("paused_before", None)
    return joined


def _refuse_forks(parts: list[Episode]) -> None:
    """Refuse parts of two branches: two calls that started from one checkpoint (a second resume, time travel
    to where a call started), or a call that started where an earlier call, not the one just before it, ended.
    A call that starts from a checkpoint no call started from or ended at follows its predecessor: that is
    what `update_state` between a pause and its resume leaves (a checkpoint of its own). A resume that paused
    again (a second interrupt() in one node, parallel interrupts answered one at a time) wrote no checkpoint: it
    keeps its answers as pending writes on the checkpoint it started from, so the call after it starts there too,
    and goes on from it."""
    started: dict[str, str] = {}  # checkpoint id -> the episode that started from it
    ended: dict[str, str] = {}  # checkpoint id -> the episode that ended at it
    previous_start = previous_end = None
    for part in parts:
        start, end = part.metadata.get("start_checkpoint_id"), part.metadata.get("end_checkpoint_id")
        if start and not start == previous_start == previous_end:
            earlier = started.get(start) or (ended.get(start) if start != previous_end else None)
            if earlier is not None:
                raise ValueError(
                    f"episode {part.id} starts from checkpoint {start}, where episode {earlier} already started "
                    "or ended before another call went on from it: time travel or a second resume from one "
                    "checkpoint forked this thread. Join the episodes of one branch: "
                    "join_thread(thread_id, episode_ids=[...]) or join_episodes([...])")
            started[start] = part.id
        if end:
            ended[end] = part.id
        previous_start, previous_end = start, end


def _give_resumed_results(actions: list[Action]) -> None:
    """A model call whose tool call got its result only after the thread resumed (the tool paused in
    interrupt(), or an approval step paused the run before the tool ran) gets that result, after any paused
    one, from the action of a later call that recorded it: the judge scores a tool call by its result."""
    waiting: dict[str, Action] = {}  # tool call id -> the model call that asked and has no result yet
    for action in actions:
        for result in action.tool_results:
            owner = waiting.pop(result.tool_call_id, None) if not result.paused and result.tool_call_id else None
            if owner is not None and owner is not action:
                owner.tool_results.append(result.model_copy())
        if action.kind == "llm":
            done = {r.tool_call_id for r in action.tool_results if not r.paused}
            waiting.update({c.id: action for c in action.tool_calls if c.id and c.id not in done})


def _json(model: BaseModel, **kwargs: Any) -> str:
    """A model as JSON text. Text that is not Unicode (a lone surrogate: what `os.fsdecode`, `os.listdir` or
    `os.environ` give for bytes that are not UTF-8) cannot be written as UTF-8, and failed the episode's whole
    store write: such text is kept with its bytes spelled out (`report-\\xff.csv`), in this row only."""
    try:
        return model.model_dump_json(**kwargs)
    except PydanticSerializationError:
        return json.dumps(_spelled_out(model.model_dump(mode="json", **kwargs)), ensure_ascii=False)


def _spelled_out(value: Any) -> Any:
    if isinstance(value, str):
        if value.isascii():
            return value
        raw = value.encode("utf-8", "surrogateescape" if _ESCAPED_ONLY.fullmatch(value) else "surrogatepass")
        return raw.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {_spelled_out(k): _spelled_out(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_spelled_out(v) for v in value]
    return value


_ESCAPED_ONLY = re.compile("[^\ud800-\udc7f\udd00-\udfff]*")  # surrogates, if any, are surrogateescape's


def _episode_rows(episodes: Iterable[Episode]) -> list[tuple[tuple[Any, ...], list[tuple[Any, ...]]]]:
    """Each episode's row and its actions' rows, serialised by pydantic-core (the head through
    `model_dump` and `json.dumps` took 15 us of a 3-node episode's 35, now 4); on the trace writer, the GIL goes
    back to the graph after each episode (see courtesy.py), not after each action: a yield that hands the GIL
    to a waiting graph costs the writer a thread switch, some 25 us of CPU, where an action's serialising is 5."""
    rows = []
    for episode in episodes:
        actions = [(action.id, episode.id, episode.run, action.agent, action.node, action.index,
                    _json(action)) for action in episode.actions]
        rows.append(((episode.id, episode.run, episode.task_id, episode.outcome, episode.error, episode.started_at,
                      _json(episode, exclude={"actions"})), actions))
        yield_gil()
    return rows
