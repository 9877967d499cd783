"""Pending calls never outlive their episode (serving/routing.py): a call whose reply never comes back, a
completion answered after its client gave up, and a call registered by an app that died are all cleared, so
they hold no memory and cannot answer (or make ambiguous) a later request with the same messages."""

from __future__ import annotations

import threading
import time
import uuid

import openai
import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph

from mappa_graph.models.policies import AgentPolicies
from mappa_graph.serving.endpoint import PolicyEndpoint
from mappa_graph.serving.routing import CallRegistry, PendingCall, RemoteCallRegistry, RouteError, call_key

KEY = "sk-routing-test"
EMPTY = {"pending": 0, "keys": 0, "records": 0, "record_links": 0}


@pytest.fixture(scope="module")
def policies(tiny_path, one_torch_thread) -> AgentPolicies:
    torch.manual_seed(0)
    return AgentPolicies.from_pretrained(str(tiny_path), ["researcher", "writer"])


@pytest.fixture(scope="module")
def endpoint(policies):
    with PolicyEndpoint(policies, max_tokens=4, api_key=KEY) as endpoint:
        yield endpoint


@pytest.fixture(autouse=True)
def clean_registry(endpoint):
    yield
    assert endpoint.registry.counts() == EMPTY, "a test left calls or records behind"


def one_node_app(endpoint: PolicyEndpoint, node: str, **chat_kwargs):
    """An app of one node, named like an agent, that calls the endpoint through a plain ChatOpenAI."""
    chat = ChatOpenAI(model="gpt-4o-mini", base_url=endpoint.base_url, api_key=KEY, max_retries=0, **chat_kwargs)
    graph = StateGraph(MessagesState)
    graph.add_node(node, lambda state: {"messages": [chat.invoke(state["messages"])]})
    graph.add_edge(START, node)
    return endpoint.attach(graph.compile())


def wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_call_whose_reply_never_comes_back_is_dropped_when_its_episode_ends(endpoint):
    """A callback after the router refuses the call (a budget guard): langchain fails the call before its
    request and fires no on_llm_error, so only the end of the episode can tell the router it is over. Left
    pending, it would answer the next request with the same messages under the writer's adapter."""
    seen = {}

    class Budget(BaseCallbackHandler):
        raise_error = True

        def on_chat_model_start(self, serialized, messages, **kwargs):
            seen["pending"] = [c.agent for c in endpoint.registry.pending()]  # the router registered it first
            raise RuntimeError("model-call budget spent")

    app = one_node_app(endpoint, "writer")
    with pytest.raises(RuntimeError, match="budget spent"):
        app.invoke({"messages": [HumanMessage("order A17 arrived damaged")]}, config={"callbacks": [Budget()]})
    assert seen["pending"] == ["writer"]
    assert endpoint.registry.counts() == EMPTY
    assert endpoint.router.open_runs() == 0
    # the same messages from a client that names no agent are refused, not served as the abandoned call
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o-mini",
                                       messages=[{"role": "user", "content": "order A17 arrived damaged"}])


def test_a_completion_answered_after_its_client_gave_up_is_not_linked_to_its_run(endpoint, policies, monkeypatch):
    """The client times out (on_llm_error drops its call) while the endpoint is still sampling: the record of
    the late completion must not wait under a run id no one will finish; it is kept unlinked (a waiting client
    reads records by completion id) and leaves with the bounded queue's oldest."""
    release, started = threading.Event(), threading.Event()
    sample = policies.sample

    def slow_sample(*args, **kwargs):
        started.set()
        release.wait(60)
        return sample(*args, **kwargs)

    monkeypatch.setattr(policies, "sample", slow_sample)
    served = endpoint.requests_served
    app = one_node_app(endpoint, "researcher", timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        app.invoke({"messages": [HumanMessage("where is C99?")]})
    assert started.is_set() and endpoint.registry.counts()["pending"] == 0
    release.set()
    wait_for(lambda: endpoint.requests_served > served, "the late completion")
    assert endpoint.registry.counts() == {**EMPTY, "records": 1}  # unlinked: no run id holds it
    [late_id] = list(endpoint.registry._records)  # a client that did wait would read it by this id
    assert endpoint.registry.finish(uuid.uuid4(), [late_id])[0]["output_token_ids"]


def test_a_call_of_an_app_that_died_expires_and_routes_nothing(endpoint):
    """An app in another process registers a call over HTTP, then dies: no finish ever comes. After
    pending_ttl the call is gone; until then a request with its messages is routed to it."""
    now = [0.0]
    monkey_clock = endpoint.registry.clock
    endpoint.registry.clock = lambda: now[0]
    remote = RemoteCallRegistry(endpoint.base_url, api_key=KEY)
    try:
        messages = [HumanMessage("my parcel B42 never came")]
        remote.register(PendingCall(run_id=uuid.uuid4(), agent="writer", node="writer", key=call_key(messages)))
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY, max_retries=0)
        wire = [{"role": "user", "content": "my parcel B42 never came"}]
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=wire)
        assert raw.headers["x-mappa-agent"] == "writer"  # live: routed to the registered call
        expired = endpoint.registry.expired
        now[0] += endpoint.registry.stale_after + 1  # the app died; nothing will finish its call
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4o-mini", messages=wire)
        assert endpoint.registry.expired == expired + 1
    finally:
        endpoint.registry.clock = monkey_clock
        remote.close()


def test_a_stale_call_makes_no_request_ambiguous():
    now = [0.0]
    registry = CallRegistry(stale_after=10.0, clock=lambda: now[0])
    key = call_key([HumanMessage("same words")])
    registry.register(PendingCall(run_id=uuid.uuid4(), agent="researcher", node="researcher", key=key))
    now[0] = 11.0
    fresh = PendingCall(run_id=uuid.uuid4(), agent="writer", node="writer", key=key)
    registry.register(fresh)
    assert registry.claim(key, model=None, agents=["researcher", "writer"]) is fresh  # not a 409
    assert [c.agent for c in registry.pending()] == ["writer"]
    now[0] = 30.0
    with pytest.raises(RouteError) as refused:
        registry.claim(key, model=None, agents=["researcher", "writer"])
    assert refused.value.status == 404
    assert registry.counts() == EMPTY and registry.expired == 2


def test_records_evicted_or_abandoned_leave_no_run_links():
    registry = CallRegistry(keep_records=2)
    runs = [uuid.uuid4() for _ in range(3)]
    for n, run_id in enumerate(runs):
        registry.register(PendingCall(run_id=run_id, agent="writer", node="writer", key=f"k{n}"))
        assert registry.put_record(f"chatcmpl-{n}", {"n": n}, run_id)
    assert registry.counts() == {"pending": 3, "keys": 3, "records": 2, "record_links": 2}  # the first evicted
    assert registry.finish(runs[0], ["chatcmpl-0"]) == [None]
    registry.drop(runs[1])  # abandoned before its reply was read: its record goes with it
    assert registry.counts() == {"pending": 1, "keys": 1, "records": 1, "record_links": 1}
    assert registry.finish(runs[2], [None]) == [{"n": 2}]  # a client that drops the id: the run's last record
    assert registry.counts() == EMPTY
    assert not registry.put_record("chatcmpl-late", {"n": 9}, runs[2])  # its call is over: kept unlinked
    assert registry.counts() == {**EMPTY, "records": 1}
    for n in range(3):  # bounded: newer records push it out
        registry.put_record(f"chatcmpl-new{n}", {"n": n}, None)
    assert registry.finish(uuid.uuid4(), ["chatcmpl-late"]) == [None] and registry.counts()["records"] == 2


def test_a_record_claimed_under_a_finished_twin_still_reaches_its_requester():
    """G identical calls of one agent are interchangeable: request B may claim call A after A's own reply was
    collected. B's record must still be kept (for B's client, by completion id), linked to a pending twin."""
    registry = CallRegistry()
    key = call_key([HumanMessage("same task, rollout A and B")])
    a, b = (PendingCall(run_id=uuid.uuid4(), agent="writer", node="writer", key=key) for _ in range(2))
    registry.register(a)
    registry.register(b)
    first = registry.claim(key, model=None, agents=["writer"])
    assert registry.put_record("chatcmpl-1", {"n": 1}, first.run_id, key=key)
    other = b if first is a else a
    assert registry.finish(other.run_id, ["chatcmpl-1"]) == [{"n": 1}]  # the twin's client collected it
    # `first`'s own request was matched to `other` (claimed before `other` finished) and is answered now
    assert registry.put_record("chatcmpl-2", {"n": 2}, other.run_id, key=key)
    assert registry.finish(first.run_id, ["chatcmpl-2"]) == [{"n": 2}]
    assert registry.counts() == EMPTY


def test_two_requests_matched_to_one_call_both_keep_their_records():
    """Identical calls race: two requests can be matched to the same pending call. The second must not discard
    the first's record, which the first request's own client reads by completion id."""
    registry = CallRegistry()
    key = call_key([HumanMessage("same task, rollouts A and B")])
    a, b = (PendingCall(run_id=uuid.uuid4(), agent="writer", node="writer", key=key) for _ in range(2))
    registry.register(a)
    registry.register(b)
    assert registry.put_record("chatcmpl-1", {"n": 1}, a.run_id, key=key)  # b's request, matched to a
    assert registry.put_record("chatcmpl-2", {"n": 2}, a.run_id, key=key)  # a's own request, also matched to a
    assert registry.finish(b.run_id, ["chatcmpl-1"]) == [{"n": 1}]
    assert registry.finish(a.run_id, ["chatcmpl-2"]) == [{"n": 2}]
    assert registry.counts() == EMPTY


def test_the_trainers_temperature_reaches_an_apps_own_client_through_the_pending_call(endpoint, policies):
    # the app's ChatOpenAI asks for 1.0; a training rollout's metadata says 0.6: the endpoint samples at 0.6 and
    # the action records 0.6, so the loss divides by the temperature the tokens were drawn at
    from mappa_graph import instrument
    from mappa_graph.training.rollouts import rollout_metadata

    app = instrument(one_node_app(endpoint, "researcher", temperature=1.0))
    app.invoke({"messages": [HumanMessage("find the mean fare")]},
               config={"metadata": rollout_metadata(0, 1, "t", 0, temperature=0.6)})
    app.flush()
    (action,) = [a for a in app.episodes[-1].actions if a.kind == "llm"]
    assert action.temperature == 0.6 and action.output_token_ids
    recomputed = policies.token_logprobs("researcher", [action.prompt_token_ids], [action.output_token_ids],
                                         temperature=0.6)[0]
    assert torch.allclose(recomputed.detach(), torch.tensor(action.output_logprobs), atol=1e-4)


@pytest.mark.parametrize("temperature", [0, -1, 2.5, "NaN", "hot", True])
def test_a_registered_call_with_an_impossible_temperature_is_refused(endpoint, temperature):
    import json

    import httpx

    body = {"run_id": str(uuid.uuid4()), "agent": "researcher", "node": "researcher", "key": "k",
            "temperature": temperature}
    content = json.dumps(body).replace('"NaN"', "NaN")  # a NaN as Python's json writes it
    reply = httpx.post(f"{endpoint.base_url}/mappa/calls", content=content,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert reply.status_code == 400 and "temperature" in reply.text
