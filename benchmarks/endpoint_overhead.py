"""What the policy endpoint costs: requests/s through it (HTTP, the real `openai` client) vs calling the
policies in-process, on the same prompts and seeds, with N concurrent clients.

    .venv/bin/python benchmarks/endpoint_overhead.py [--clients 8] [--requests 96] [--max-tokens 16]
        [--rounds 3] [--threads 1] [--no-engine]

Both sides render the same messages with the chat template and sample the same completions (same prompt,
adapter, seed), so they do the same model work: the difference is the HTTP server (starlette on uvicorn), the
client, JSON, the message conversion, the routing and decoding the reply. With the rollout engine on (the
default) concurrent requests share each forward on both sides. The sides run `--rounds` times, interleaved;
medians and bests are compared (the machine is shared: read the ratios, not the absolute numbers). "clients
apart" runs the same clients in a process of their own, as an app beside the server would. Issue 17's goal:
the endpoint costs <= 10% at 8 concurrent clients on the tiny model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from mappa_graph.models.policies import AgentPolicies
from mappa_graph.serving.endpoint import PolicyEndpoint

AGENTS = ["researcher", "writer"]


def prompts(n: int) -> list[tuple[str, list[dict[str, str]], int]]:
    """(agent, messages, seed) for request i: the agents alternate, the prompts differ."""
    return [(AGENTS[i % 2], [{"role": "system", "content": f"You are the {AGENTS[i % 2]}."},
                             {"role": "user", "content": f"order {i}: what is the total value of the table data?"}],
             1000 + i) for i in range(n)]


def in_process(policies: AgentPolicies, work, clients: int, max_tokens: int) -> tuple[float, int]:
    def one(item) -> int:
        agent, messages, seed = item
        ids = policies.render(messages)
        return len(policies.sample(policies.adapter_of[agent], ids, max_new_tokens=max_tokens, seed=seed)
                   .output_token_ids)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        tokens = sum(pool.map(one, work))
    return time.perf_counter() - started, tokens


def through_endpoint(base_url: str, work, clients: int, max_tokens: int) -> tuple[float, int]:
    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)

    def one(item) -> int:
        agent, messages, seed = item
        done = client.chat.completions.create(model=agent, messages=messages, max_tokens=max_tokens, seed=seed)
        return done.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        tokens = sum(pool.map(one, work))
    return time.perf_counter() - started, tokens


def _client_process(base_url: str, work, clients: int, max_tokens: int, queue) -> None:
    """The clients in a process of their own (an app beside the server): their HTTP and JSON work then does
    not hold the server's interpreter lock."""
    through_endpoint(base_url, work[:clients], clients, max_tokens)  # warm-up
    queue.put(through_endpoint(base_url, work, clients, max_tokens))


def clients_apart(base_url: str, work, clients: int, max_tokens: int) -> tuple[float, int]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_client_process, args=(base_url, work, clients, max_tokens, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-engine", action="store_true", help="each call decodes alone (no batching)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained("tiny", AGENTS)
    if not args.no_engine:
        policies.start_engine(max_batch=max(args.clients, 1))
    work = prompts(args.requests)
    results: dict[str, list[tuple[float, int]]] = {"in-process": [], "endpoint": [], "endpoint, clients apart": []}
    with PolicyEndpoint(policies, max_tokens=args.max_tokens) as endpoint:
        in_process(policies, work[: args.clients], args.clients, args.max_tokens)  # warm-up both paths
        through_endpoint(endpoint.base_url, work[: args.clients], args.clients, args.max_tokens)
        for _ in range(args.rounds):  # interleaved, so a change in the machine's load hits every side
            results["in-process"].append(in_process(policies, work, args.clients, args.max_tokens))
            results["endpoint"].append(through_endpoint(endpoint.base_url, work, args.clients, args.max_tokens))
            results["endpoint, clients apart"].append(clients_apart(endpoint.base_url, work, args.clients,
                                                                    args.max_tokens))
    policies.stop_engine()

    print(f"tiny model, {args.requests} requests, {args.clients} concurrent clients, max_tokens={args.max_tokens}, "
          f"engine={'off' if args.no_engine else 'on'}, torch threads={args.threads}, {args.rounds} rounds")
    rate: dict[str, tuple[float, float]] = {}  # side -> (median, best) requests/s
    for side, runs in results.items():
        rates = sorted(args.requests / seconds for seconds, _ in runs)
        rate[side] = (statistics.median(rates), rates[-1])
        print(f"{side:>23}: median {rate[side][0]:6.1f}, best {rate[side][1]:6.1f} requests/s "
              f"({runs[0][1]} tokens a round; rounds: {', '.join(f'{r:.1f}' for r in rates)})")
    for side in ("endpoint", "endpoint, clients apart"):
        median, best = (1 - rate[side][k] / rate["in-process"][k] for k in (0, 1))
        print(f"cost of the {side}: {median:+.1%} (medians), {best:+.1%} (bests) of in-process throughput "
              "(goal <= 10%)")

if __name__ == "__main__":
    main()
