"""The batched rollout engine against one-call-at-a-time decoding and against HF `generate`.

    .venv/bin/python benchmarks/rollout_engine.py [--model tiny|smollm2-135m] [--concurrency 8 16]
        [--max-new-tokens 32] [--threads 1]

Three tables:
1. episodes/s of the data-analysis team (planner -> coder -> tools -> analyst, three agents, three adapters)
   with N episodes in flight on a thread pool: the serialised path (each call decodes alone, under the
   policies' lock) vs the engine (`AgentPolicies.batched(on_caller=True)`, as the trainer runs it: every call
   joins one continuous batch, decoded in the main thread). The python
   tool is a stub that answers at once, so the model is all that is timed. Issue 16's goal: >= 3x at 8 and 16.
2. generated tokens/s on N identical-length prompts, one adapter: the engine vs `model.generate` on the same
   prompts as one static left-padded batch (temperature-only sampling both). Goal: >= 0.9x.
3. LoRA routing for a mixed batch of three adapters, one prefill forward: peft's per-row `adapter_names` in one
   forward vs one forward per adapter group (`set_adapter` on each sub-batch).
Timings are wall-clock on whatever else the machine runs; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from langchain_core.tools import tool

from agents.data_analysis import AGENTS, build_data_analysis_graph
from mappa_graph import AgentPolicies
from mappa_graph.models.engine import SampleRequest


@tool
def python(code: str) -> str:
    """Run Python code on the table `df` and return what it prints."""
    return "42"


def team_inputs(n: int) -> list[dict[str, Any]]:
    columns = ["age", "fare", "sex", "class", "survived"]
    return [{"question": f"What is the mean {columns[i % 5]} of the passengers in class {1 + i % 3}?",
             "columns": columns, "format": "@mean[value] rounded to two decimals", "table_path": "t.csv"}
            for i in range(n)]


def episodes_per_second(policies: AgentPolicies, n: int, max_new_tokens: int, *, engine: bool) -> float:
    models = {a: policies.chat_model(a, max_new_tokens=max_new_tokens, temperature=1.0) for a in AGENTS}
    graph = build_data_analysis_graph(models, python).compile()

    def run(i: int, x: dict[str, Any]) -> Any:
        return graph.invoke(x, config={"metadata": {"mappa_seed": f"bench:{i}"}})

    inputs = team_inputs(n)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        if engine:  # as the trainer runs it: decoded in this thread while the episodes run on the pool
            with policies.batched(max_batch=n, on_caller=True) as eng:
                futures = [pool.submit(run, i, x) for i, x in enumerate(inputs)]
                eng.drive(futures)
                for future in futures:
                    future.result()
        else:
            list(pool.map(run, range(n), inputs))
    return n / (time.perf_counter() - start)


def tokens_per_second(policies: AgentPolicies, n: int, max_new_tokens: int, *, engine: bool) -> float:
    prompt = policies.render([{"role": "user", "content": "Write a short plan to compute the mean fare."}])
    if engine:
        # decoded in this thread, as HF generate is (and as the trainer drives it): on a CPU, decoding on a
        # second thread makes libgomp stop spin-waiting (see RolloutEngine); one warm-up request first
        with policies.batched(max_batch=n, on_caller=True) as eng:
            eng.drive([eng.submit(SampleRequest(adapter="coder", prompt_ids=prompt, max_new_tokens=2, seed=0))])
            start = time.perf_counter()
            futures = [eng.submit(SampleRequest(adapter="coder", prompt_ids=prompt, max_new_tokens=max_new_tokens,
                                                seed=i)) for i in range(n)]
            eng.drive(futures)
            generated = sum(len(f.result().output_token_ids) for f in futures)
            return generated / (time.perf_counter() - start)
    from transformers import GenerationConfig

    ids = torch.tensor([prompt] * n, device=policies.device)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                              eos_token_id=policies.stop_token_ids, pad_token_id=policies.tokenizer.pad_token_id)
    start = time.perf_counter()
    with torch.no_grad(), policies.active("coder"):
        out = policies.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    elapsed = time.perf_counter() - start
    new = out[:, ids.shape[1]:]
    stop = torch.tensor(policies.stop_token_ids)
    generated = 0
    for row in new.tolist():  # count up to and including the first stop token, as the engine does
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        generated += cut
    return generated / elapsed


def routing_seconds(policies: AgentPolicies, n: int, *, grouped: bool, repeats: int = 3) -> float:
    prompt = policies.render([{"role": "user", "content": "Compute the mean of the fare column, please."}])
    ids = torch.tensor([prompt] * n, device=policies.device)
    names = [AGENTS[i % 3] for i in range(n)]
    best = float("inf")
    with torch.no_grad(), policies.lock:
        for _ in range(repeats):
            start = time.perf_counter()
            if grouped:
                for agent in AGENTS:
                    rows = [i for i, a in enumerate(names) if a == agent]
                    policies.model.set_adapter(agent)
                    policies.model(input_ids=ids[rows], logits_to_keep=1)
            else:
                policies.model(input_ids=ids, adapter_names=names, logits_to_keep=1)
            if ids.is_cuda:  # kernels run asynchronously: time them, not their launch
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: where the model loads, the CPU)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3], help="which tables to print")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per token-rate cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(args.model, list(AGENTS), device=args.device)
    with torch.no_grad():  # distinct adapters, as after some training
        for name, p in policies.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    episodes_per_second(policies, 2, 4, engine=True)  # warm-up (first forward, thread start)

    print(f"model={args.model} max_new_tokens={args.max_new_tokens} threads={args.threads}")
    if 1 in args.tables:
        print("\n| episodes in flight | serialised ep/s | engine ep/s | ratio |\n|---|---|---|---|")
        for n in args.concurrency:
            serial = episodes_per_second(policies, n, args.max_new_tokens, engine=False)
            batched = episodes_per_second(policies, n, args.max_new_tokens, engine=True)
            print(f"| {n} | {serial:.2f} | {batched:.2f} | {batched / serial:.2f}x |", flush=True)
    if 2 in args.tables:
        print("\n| rows | HF generate tok/s | engine tok/s | ratio |\n|---|---|---|---|")
        for n in args.concurrency:  # best of `repeats`: the first run of a shape pays one-off kernel set-up
            hf = max(tokens_per_second(policies, n, args.max_new_tokens, engine=False) for _ in range(args.repeats))
            eng = max(tokens_per_second(policies, n, args.max_new_tokens, engine=True) for _ in range(args.repeats))
            print(f"| {n} | {hf:.1f} | {eng:.1f} | {eng / hf:.2f}x |", flush=True)
    if 3 not in args.tables:
        return
    print("\n| rows (3 adapters) | adapter_names ms | grouped ms | grouped / adapter_names |\n|---|---|---|---|")
    for n in args.concurrency:
        mixed = routing_seconds(policies, n, grouped=False)
        grouped = routing_seconds(policies, n, grouped=True)
        print(f"| {n} | {mixed * 1e3:.1f} | {grouped * 1e3:.1f} | {grouped / mixed:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
