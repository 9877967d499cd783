"""The batched rollout engine (issue 16 item 2) on the tiny model: rows of different adapters in one batch,
joining and leaving at different steps, record the log-probs the training pass recomputes; reruns repeat."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from langchain_core.messages import HumanMessage

from mappa_graph import AgentPolicies
from mappa_graph.models.engine import SampleRequest

AGENTS = ["planner", "coder", "reporter"]


@pytest.fixture(scope="module")
def policies(tiny_path, one_torch_thread) -> AgentPolicies:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), AGENTS)
    with torch.no_grad():  # distinct adapters: a row routed to the wrong one would change its log-probs
        for name, p in policies.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policies


def _requests(policies: AgentPolicies) -> list[SampleRequest]:
    prompts = ["mean of fare?", "How many rows have age greater than 30 in the table?", "sum", "plan: step one"]
    requests = []
    for i in range(8):
        text = prompts[i % len(prompts)] * (1 + i % 3)  # prompt lengths differ: the batch is left-padded
        adapter = [*AGENTS, None][i % 4]  # None: the base with adapters off, in the same batch
        requests.append(SampleRequest(adapter=adapter, prompt_ids=policies.render([{"role": "user", "content": text}]),
                                      max_new_tokens=6 + 5 * (i % 3), temperature=(0.7, 1.0, 1.3)[i % 3], seed=100 + i))
    return requests


def _run_staggered(policies: AgentPolicies, requests: list[SampleRequest]):
    """Submit from threads, half of them after the batch is already decoding (they join mid-flight)."""
    engine = policies.start_engine(max_batch=8)
    results: dict[int, object] = {}

    def call(i: int) -> None:
        results[i] = engine.sample(requests[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    steps_before, rows_before = engine.steps, engine.rows_per_step
    for i, t in enumerate(threads):
        if i == len(threads) // 2:
            while engine.steps < steps_before + 2:
                time.sleep(0.001)
        t.start()
    for t in threads:
        t.join()
    mean_batch = (engine.rows_per_step - rows_before) / (engine.steps - steps_before)
    return [results[i] for i in range(len(requests))], mean_batch


def test_batched_rows_of_different_adapters_record_the_training_logprobs(policies) -> None:
    requests = _requests(policies)
    try:
        gens, mean_batch = _run_staggered(policies, requests)
    finally:
        policies.stop_engine()
    assert mean_batch > 2, "the requests were not decoded together"
    for request, gen in zip(requests, gens):
        agent = next((a for a in AGENTS if a == request.adapter), None)
        recomputed = policies.token_logprobs(agent, [request.prompt_ids], [gen.output_token_ids],
                                             temperature=request.temperature)[0].detach()
        assert torch.allclose(recomputed, torch.tensor(gen.output_logprobs), atol=1e-4), \
            (request.adapter, (recomputed - torch.tensor(gen.output_logprobs)).abs().max())
        assert len(gen.output_token_ids) == request.max_new_tokens or gen.finished


def test_rerun_with_the_same_seeds_and_concurrency_gives_the_same_tokens(policies) -> None:
    try:
        first, _ = _run_staggered(policies, _requests(policies))
        second, _ = _run_staggered(policies, _requests(policies))
    finally:
        policies.stop_engine()
    assert [g.output_token_ids for g in first] == [g.output_token_ids for g in second]
    # and a row draws the same stream alone as in a batch: its seed, not its neighbours, decides
    alone = policies.sample(_requests(policies)[1].adapter, _requests(policies)[1].prompt_ids,
                            max_new_tokens=11, temperature=1.0, seed=101)
    assert alone.output_token_ids == first[1].output_token_ids


def test_asyncio_episodes_share_the_engine(policies) -> None:
    models = [policies.chat_model(a, max_new_tokens=10, temperature=0.7) for a in AGENTS]

    async def episode(i: int):
        return await models[i % 3].ainvoke([HumanMessage(f"question {i}")],
                                           config={"metadata": {"mappa_seed": str(i)}})

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(6)))

    engine = policies.start_engine()
    try:
        replies = asyncio.run(main())
        assert engine.rows_per_step > engine.steps  # some steps decoded several episodes at once
    finally:
        policies.stop_engine()
    for reply in replies:
        record = reply.response_metadata["mappa"]
        recomputed = policies.token_logprobs(record["agent"], [record["prompt_token_ids"]],
                                             [record["output_token_ids"]], temperature=record["temperature"])[0]
        assert torch.allclose(recomputed.detach(), torch.tensor(record["output_logprobs"]), atol=1e-4)


def test_a_failing_request_fails_alone_and_the_engine_goes_on(policies) -> None:
    engine = policies.start_engine()
    try:
        with pytest.raises(ValueError, match="non-existing adapter"):
            engine.sample(SampleRequest(adapter="nobody", prompt_ids=[1, 2, 3], max_new_tokens=3, seed=1))
        ok = engine.sample(SampleRequest(adapter="coder", prompt_ids=[1, 2, 3], max_new_tokens=3, seed=1))
        assert len(ok.output_token_ids) >= 1
    finally:
        policies.stop_engine()


def test_a_call_made_while_holding_the_policies_lock_does_not_wait_on_the_engine(policies) -> None:
    engine_result: list[object] = []

    def call() -> None:
        with policies.active("coder"):  # e.g. a user's own pass around a generation: the engine needs this lock
            engine_result.append(policies.generate("coder", [1, 2, 3], max_new_tokens=3, seed=1))

    policies.start_engine()
    try:
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "deadlock: the call waited on an engine that waited on its lock"
    finally:
        policies.stop_engine()
    assert len(engine_result) == 1


def test_the_cache_goes_in_under_the_name_the_installed_transformers_takes(policies) -> None:
    # transformers renamed forward(past_key_values=) to forward(cache=); under the other name the cache is
    # dropped silently and every decoding step sees only its last token, so the name comes from the signature
    from mappa_graph.models.engine import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    class NoCache(torch.nn.Module):
        def forward(self, input_ids=None): ...

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    with pytest.raises(TypeError, match="takes no KV cache"):
        cache_kwarg(NoCache())
    base = policies.model.get_base_model()
    assert cache_kwarg(policies.model) in inspect.signature(base.forward).parameters


def test_rows_that_all_finish_at_their_first_token_leave_no_batch_behind(policies) -> None:
    # a join where every row stops at once (max_new_tokens=1, or a stop token first) drops them all; an empty
    # index tensor is float and used to fail the whole rollout with "tensors used as indices must be long"
    from mappa_graph.models.engine import decode

    prompt = policies.render([{"role": "user", "content": "mean of fare?"}])
    requests = [SampleRequest(adapter=a, prompt_ids=prompt, max_new_tokens=1, seed=i) for i, a in enumerate(AGENTS)]
    out = decode(policies, requests)
    assert [len(g.output_token_ids) for g in out] == [1] * len(AGENTS)
    engine = policies.start_engine(max_batch=8)
    assert len(engine.sample(SampleRequest(adapter=AGENTS[0], prompt_ids=prompt, max_new_tokens=1, seed=0))
               .output_token_ids) == 1
    assert len(engine.sample(SampleRequest(adapter=AGENTS[1], prompt_ids=prompt, max_new_tokens=3, seed=1))
               .output_token_ids) <= 3  # and the engine goes on afterwards


def test_each_row_draws_from_its_behaviour_distribution_and_greedy_rows_take_the_argmax(policies) -> None:
    """The batched draw (inverse-CDF, one uniform per row) samples softmax(logits / T), the distribution whose
    log-probs are recorded: 6000 rows, each its own generator, against the exact probabilities."""
    from concurrent.futures import Future

    from mappa_graph.models.engine import _Batch, _Row

    batch = _Batch(policies)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    for temperature in (0.6, 1.4):
        rows = []
        for i in range(6000):
            greedy = i % 10 == 0
            row = _Row(request=SampleRequest(adapter=None, prompt_ids=[1], temperature=temperature,
                                             do_sample=not greedy, seed=i), future=Future())
            row.generator = torch.Generator().manual_seed(i)
            rows.append(row)
        tokens = batch._pick(rows, logits.expand(len(rows), -1)).tolist()
        sampled = [t for i, t in enumerate(tokens) if i % 10]
        assert all(t == 0 for i, t in enumerate(tokens) if i % 10 == 0)
        p = torch.softmax(logits / temperature, dim=-1).tolist()
        n = len(sampled)
        for k, pk in enumerate(p):
            share = sampled.count(k) / n
            assert abs(share - pk) < 4 * (pk * (1 - pk) / n) ** 0.5 + 1e-3, (temperature, k, share, pk)
        recorded = [r.logprobs[-1] for r in rows if r.request.do_sample]
        assert recorded[0] == pytest.approx(torch.log_softmax(logits / temperature, -1)[sampled[0]].item(), abs=1e-6)


def test_a_mask_goes_to_the_model_only_while_some_row_has_padding(policies, monkeypatch) -> None:
    """Without padding the engine passes no attention mask (on CUDA a masked SDPA over grouped KV heads takes
    the math kernel); with rows of different lengths it passes one, and the tokens are the same either way."""
    seen: list[bool] = []
    forward = type(policies.model).forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("attention_mask") is not None)
        return forward(self, *args, **kwargs)

    from mappa_graph.models.engine import decode

    prompt = policies.render([{"role": "user", "content": "mean of fare?"}])
    longer = policies.render([{"role": "user", "content": "mean of fare? and of age, please"}])
    same = [SampleRequest(adapter="planner", prompt_ids=prompt, max_new_tokens=5, seed=s) for s in (1, 2)]
    reference = [g.output_token_ids for g in decode(policies, same)]
    monkeypatch.setattr(type(policies.model), "forward", spy)
    assert [g.output_token_ids for g in decode(policies, same)] == reference
    assert seen and not any(seen)
    seen.clear()
    mixed = [SampleRequest(adapter="planner", prompt_ids=p, max_new_tokens=5, seed=1) for p in (prompt, longer)]
    out = decode(policies, mixed)
    assert seen[0] and all(seen)  # the shorter row is padded for the whole decode
    alone = decode(policies, [mixed[0]])[0]
    assert out[0].output_token_ids == alone.output_token_ids


def test_an_engine_on_the_callers_thread_decodes_there_and_draws_what_its_own_thread_draws(policies, monkeypatch) -> None:
    """The trainer drives the engine from the thread that trains (on a CPU a second torch thread slows both):
    every forward runs in that thread, rows still batch, and the tokens are the threaded engine's."""
    requests = _requests(policies)
    try:
        threaded, _ = _run_staggered(policies, _requests(policies))
    finally:
        policies.stop_engine()
    forward_threads: set[int] = set()
    forward = policies.model.forward

    def spy(*args, **kwargs):
        forward_threads.add(threading.get_ident())
        return forward(*args, **kwargs)

    monkeypatch.setattr(policies.model, "forward", spy)
    with policies.batched(max_batch=8, on_caller=True) as engine, \
            ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(engine.sample, r) for r in requests]
        engine.drive(futures)
        driven = [f.result() for f in futures]
    assert forward_threads == {threading.get_ident()}
    assert engine.rows_per_step > 2 * engine.steps, "the requests were not decoded together"
    assert [g.output_token_ids for g in driven] == [g.output_token_ids for g in threaded]
    assert policies._engine is None  # the block stopped the engine it started


def test_an_interrupted_drive_fails_the_waiting_requests_instead_of_hanging_them(policies, monkeypatch) -> None:
    from mappa_graph.models import engine as engine_module

    def request() -> SampleRequest:
        return SampleRequest(adapter="coder", prompt_ids=[1, 2, 3], max_new_tokens=50, seed=1)

    engine = policies.start_engine(max_batch=1, on_caller=True)
    try:
        class SubmitsFromTheDriver:  # the driving thread waiting on its own request would hang for ever
            def done(self) -> bool:
                engine.submit(request())
                return True

        with pytest.raises(RuntimeError, match="would never be decoded"):
            engine.drive([SubmitsFromTheDriver()])
        assert not engine.alive  # a drive that raised leaves an engine nothing decodes for: it is closed
        policies.stop_engine()
        engine = policies.start_engine(max_batch=1, on_caller=True)
        decoding, queued = engine.submit(request()), engine.submit(request())  # max_batch=1: one waits its turn

        def interrupted(self) -> None:
            raise KeyboardInterrupt  # Ctrl-C lands in the middle of a step

        monkeypatch.setattr(engine_module._Batch, "step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.drive([decoding, queued])
        assert isinstance(decoding.exception(timeout=1), KeyboardInterrupt)
        assert isinstance(queued.exception(timeout=1), KeyboardInterrupt)
        assert not engine.alive  # nothing drives it any more: a later call must not queue and wait
        with pytest.raises(RuntimeError, match="closed"):
            engine.submit(request())
    finally:
        policies.stop_engine()
