import json

import pytest

from mappa_graph import Action, Episode, Reward, TraceStore


def _episode(run: str, agents: list[str], task: str = "t") -> Episode:
    ep = Episode(run=run, task_id=task, input={"task": task})
    ep.actions = [Action(episode_id=ep.id, node=a, agent=a, index=i, output_message={"role": "assistant", "content": a})
                  for i, a in enumerate(agents)]
    return ep


def test_episodes_survive_close_and_reopen(tmp_path) -> None:
    path = tmp_path / "traces.db"
    with TraceStore(path) as store:
        e1, e2 = _episode("r1", ["planner", "coder"]), _episode("r2", ["coder"])
        store.add_episodes([e1, e2])
        store.add_rewards([Reward(action_id=e1.actions[1].id, episode_id=e1.id, agent="coder", judge="v", score=0.5)])
    with TraceStore(path) as store:
        assert store.episode(e1.id) == e1
        assert [e.id for e in store.episodes()] == [e1.id, e2.id]
        assert [e.id for e in store.episodes(run="r2")] == [e2.id]
        assert [e.id for e in store.episodes(agent="planner")] == [e1.id]
        assert [a.agent for a in store.actions(run="r1")] == ["planner", "coder"]
        assert [a.id for a in store.actions(agent="coder")] == [e1.actions[1].id, e2.actions[0].id]
        (r,) = store.rewards(run="r1", agent="coder")
        assert r.score == 0.5 and r.action_id == e1.actions[1].id
        assert store.runs() == ["r1", "r2"]
        assert (store.count("episodes"), store.count("actions"), store.count("rewards")) == (2, 3, 1)


def test_export_jsonl_has_one_line_per_episode_with_rewards(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    ep = _episode("r", ["coder"])
    store.add_episode(ep)
    store.add_rewards([Reward(action_id=ep.actions[0].id, episode_id=ep.id, agent="coder", judge="v", score=None,
                              unscored_reason="abstained")])
    n = store.export_jsonl(tmp_path / "out" / "traces.jsonl")
    lines = (tmp_path / "out" / "traces.jsonl").read_text().splitlines()
    assert n == 1 and len(lines) == 1
    record = json.loads(lines[0])
    assert record["actions"][0]["agent"] == "coder"
    assert record["rewards"][0]["unscored_reason"] == "abstained"


def test_reward_for_unknown_episode_is_refused_and_nothing_is_written(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    ep = _episode("r", ["coder"])
    store.add_episode(ep)
    good = Reward(action_id=ep.actions[0].id, episode_id=ep.id, agent="coder", judge="v", score=1.0)
    bad = Reward(action_id="x", episode_id="nope", agent="coder", judge="v", score=1.0)
    with pytest.raises(KeyError, match="store the episode before its rewards"):
        store.add_rewards([good, bad])
    assert store.count("rewards") == 0  # the transaction rolled back as a whole
    store.set_outcome(ep.id, 1.0)
    assert store.episode(ep.id).outcome == 1.0


def test_a_threads_episodes_are_listed_and_joined_with_their_rewards(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    paused, resumed, other = _episode("r", ["writer", "reviewer"]), _episode("r", ["reviewer"]), _episode("r", ["x"])
    paused.metadata, paused.status, paused.interrupts = {"thread_id": "th"}, "interrupted", [{"approve": "?"}]
    resumed.metadata = {"thread_id": "th", "resumed": True}
    resumed.started_at = paused.started_at + 1
    store.add_episodes([paused, resumed, other])
    store.add_rewards([Reward(action_id=resumed.actions[0].id, episode_id=resumed.id, agent="reviewer", judge="v",
                              score=1.0)])
    assert [e.id for e in store.episodes(thread_id="th")] == [paused.id, resumed.id]
    joined = store.join_thread("th")
    assert [e.id for e in store.episodes(thread_id="th")] == [joined.id] == [paused.id]
    assert [(a.agent, a.index, a.episode_id) for a in store.episode(joined.id).actions] == [
        ("writer", 0, joined.id), ("reviewer", 1, joined.id), ("reviewer", 2, joined.id)]
    assert (joined.status, joined.interrupts) == ("ok", [])
    (reward,) = store.rewards(episode_id=joined.id)
    assert reward.action_id == resumed.actions[0].id and reward.episode_id == joined.id
    assert store.count("episodes") == 2 and store.count("actions") == 4
    with pytest.raises(KeyError, match="no episodes of thread 'nope'"):
        store.join_thread("nope")


def test_text_that_is_not_unicode_is_stored_with_its_bytes_spelled_out(tmp_path) -> None:
    """A lone surrogate (a file name that is not UTF-8, through os.fsdecode) failed the whole store write."""
    import os
    from typing import TypedDict

    from langgraph.graph import START, StateGraph

    from mappa_graph import instrument

    class State(TypedDict):
        name: str

    graph = StateGraph(State)
    graph.add_node("lister", lambda state: {"name": os.fsdecode(b"report-\xff.csv")})
    graph.add_edge(START, "lister")
    store = TraceStore(tmp_path / "t.db")
    app = instrument(graph.compile(), store=store)
    assert app.invoke({"name": "go"}) == {"name": "report-\udcff.csv"}
    (stored,) = store.episodes()
    assert stored.final_state == {"name": "report-\\xff.csv"}
    assert store.actions()[0].node_output == {"name": "report-\\xff.csv"}
    assert app.last_episode.final_state == {"name": "report-\udcff.csv"}  # the episode in memory is as it was


def test_another_applications_database_is_refused_unchanged(tmp_path) -> None:
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE episodes (name TEXT)")
        db.execute("INSERT INTO episodes VALUES ('theirs')")
    db.close()
    before = path.read_bytes()
    with pytest.raises(ValueError, match="is an SQLite database but not a mappa_graph trace store .*nothing was changed"):
        TraceStore(path)
    assert path.read_bytes() == before and not (tmp_path / "other.db-wal").exists()


def _open_store(path: str, barrier, results) -> None:
    barrier.wait()
    try:
        TraceStore(path).close()
        results.put("ok")
    except Exception as e:  # reported to the parent, which asserts on it
        results.put(f"{type(e).__name__}: {e}")


def test_processes_that_open_one_new_store_at_once_all_get_it(tmp_path) -> None:
    """Rollout workers of one run open the same fresh file together: each used to see the others' half-made
    schema (tables without their version row) and refuse it as another application's database."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    failures: list[str] = []
    for trial in range(6):
        path = str(tmp_path / f"s{trial}.db")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_store, args=(path, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join()
        failures += [o for o in outcomes if o != "ok"]
        store = TraceStore(path)
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        store.close()
    assert failures == []
