"""Batched vs sequential LLM judging over a real HTTP connection: prints throughput and the ratio.

    .venv/bin/python benchmarks/judge_batching.py [--actions 200] [--delay 0.05] [--concurrency 16]

A loopback OpenAI-compatible server answers every judge request after `delay` seconds (a stand-in for a
model's latency); ChatOpenAI talks to it over TCP. "sequential" is one call per action, one after another
(`LLMJudge.score(episode, [action])` with `max_concurrency=1`, the reference's way); "batched" scores all
actions in one `score_many` call, `concurrency` requests in flight. Caches are off, so both make every call.
The issue's goal is a ratio of at least 5x.
"""

from __future__ import annotations

import argparse
import logging
import time

from langchain_openai import ChatOpenAI

from mappa_graph import Action, Episode, LLMJudge
from mappa_graph.testing import OpenAIServer


def make_episodes(n_actions: int, per_episode: int = 5) -> list[Episode]:
    episodes = []
    for e in range(0, n_actions, per_episode):
        episode = Episode(input=f"task {e}: what is {e} + 2?", reference=str(e + 2))
        for i in range(min(per_episode, n_actions - e)):
            episode.actions.append(Action(
                episode_id=episode.id, node="solver", agent="solver", index=i,
                input_messages=[{"role": "system", "content": "You solve arithmetic."},
                                {"role": "user", "content": episode.input}],
                output_message={"role": "assistant", "content": f"step {i}: the answer is {e + 2}"},
            ))
        episodes.append(episode)
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.05, help="seconds the server takes per reply")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    episodes = make_episodes(args.actions)
    with OpenAIServer('{"score": 7, "rationale": "correct step"}', delay=args.delay) as server:
        chat = ChatOpenAI(base_url=server.base_url, api_key="test", model="judge", max_retries=0, temperature=0)
        LLMJudge(chat, cache=False).score(episodes[0])  # warm up the connection pool and the judge's loop
        server.reset_counts()

        sequential = LLMJudge(chat, cache=False, max_concurrency=1)
        start = time.perf_counter()
        seq_rewards = [r for episode in episodes for action in episode.actions
                       for r in sequential.score(episode, [action])]
        seq_s = time.perf_counter() - start
        seq_calls = server.count()

        server.reset_counts()
        batched = LLMJudge(chat, cache=False, max_concurrency=args.concurrency)
        start = time.perf_counter()
        batch_rewards = [r for rewards in batched.score_many(episodes) for r in rewards]
        batch_s = time.perf_counter() - start
        batch_calls, in_flight = server.count(), server.in_flight_max

    assert len(seq_rewards) == len(batch_rewards) == args.actions
    assert all(r.score is not None for r in seq_rewards + batch_rewards)
    print(f"judge batching: {args.actions} actions, {args.delay * 1000:.0f} ms per reply, loopback HTTP (ChatOpenAI)")
    print(f"  sequential (1 call per action) : {seq_s:7.2f} s  {args.actions / seq_s:8.1f} actions/s  "
          f"({seq_calls} calls)")
    print(f"  batched (max_concurrency={args.concurrency:<3})  : {batch_s:7.2f} s  {args.actions / batch_s:8.1f} "
          f"actions/s  ({batch_calls} calls, {in_flight} in flight at most)")
    print(f"  ratio: {seq_s / batch_s:.1f}x (goal >= 5x)")


if __name__ == "__main__":
    main()
