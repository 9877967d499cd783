"""The policy endpoint over real HTTP: an unchanged LangGraph app (agents/support_team.py: create_supervisor over
create_react_agent workers built with plain ChatOpenAI) is routed per worker to that worker's adapter, and
the trace of every worker call holds the exact token ids and behaviour log-probs the endpoint sampled.

The adapters are perturbed apart at the start, so routing is visible in the numbers: a recorded log-prob
equals the routed adapter's recomputed one and not the other adapter's. The supervisor is scripted (the tiny
model cannot write handoff tool calls); its calls reach no endpoint."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
import torch
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

from agents.support_team import WORKERS, build_support_team, lookup_order, refund_policy
from mappa_graph.capture.instrument import instrument
from mappa_graph.messages import dict_to_message
from mappa_graph.models.chat import to_hf_messages
from mappa_graph.models.policies import AgentPolicies, Generation
from mappa_graph.serving.endpoint import PolicyEndpoint
from tests.fakes import ScriptedChatModel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
KEY = "sk-endpoint-test"


def call(name: str, call_id: str) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": {}, "id": call_id}])


def supervisor_script(messages: list[BaseMessage]) -> AIMessage:
    """Researcher first, then writer, then done: the handoffs the tiny model cannot write."""
    seen = {m.name for m in messages if isinstance(m, ToolMessage)}
    n = uuid.uuid4().hex[:8]
    if "transfer_to_researcher" not in seen:
        return call("transfer_to_researcher", f"h-r-{n}")
    if "transfer_to_writer" not in seen:
        return call("transfer_to_writer", f"h-w-{n}")
    return AIMessage("done")


def team(**kwargs):
    return build_support_team(supervisor_model=ScriptedChatModel(script=supervisor_script), max_tokens=4, **kwargs)


def task(n: int) -> dict:
    return {"messages": [HumanMessage(f"order A{n}: my parcel arrived damaged, what now?")]}


@pytest.fixture(scope="module")
def policies(tiny_path, one_torch_thread) -> AgentPolicies:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), list(WORKERS))
    with torch.no_grad():  # a fresh LoRA is a no-op (B = 0): make the two adapters differ
        for worker in WORKERS:
            for param in policies.adapter_parameters(worker).values():
                param.add_(torch.randn_like(param) * 0.3)
    return policies


@pytest.fixture(scope="module")
def endpoint(policies):
    with PolicyEndpoint(policies, max_tokens=4, api_key=KEY) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def lora_server(tiny_path):
    """The loopback multi-LoRA server that stands in for vLLM (its own copy of the base)."""
    from mappa_graph.testing.lora_server import LoRAServer

    with LoRAServer.from_pretrained(str(tiny_path)) as server:
        yield server


@pytest.fixture
def app_env(endpoint, monkeypatch):
    """What a deployment does: point the app's OpenAI client at the endpoint through the environment."""
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return endpoint


@pytest.fixture
def client(endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key=KEY, max_retries=0)


def check_routed(episodes, policies: AgentPolicies) -> None:
    """Each episode: one model call per worker, in order, each on its own adapter, with the exact tokens and
    log-probs the routed adapter produced (and that the other adapter would not have)."""
    decode = policies.tokenizer.decode
    calls = {w: [] for w in WORKERS}
    for episode in episodes:
        llm = [a for a in episode.actions if a.kind == "llm" and a.agent in WORKERS]
        assert [(a.agent, a.adapter, a.token_source) for a in llm] == [(w, w, "backend") for w in WORKERS]
        for action in llm:
            assert action.prompt_token_ids and action.output_token_ids
            assert len(action.output_logprobs) == len(action.output_token_ids)
            # the tokens are the reply the app got, not a re-encoding of it
            assert decode(action.output_token_ids, skip_special_tokens=True) == action.output_message["content"]
            # and the prompt is exactly the messages and tools the node sent, rendered by the chat template
            hf = to_hf_messages([dict_to_message(m) for m in action.input_messages])
            tools = [convert_to_openai_tool(lookup_order if action.agent == "researcher" else refund_policy)]
            assert action.prompt_token_ids == policies.render(hf, tools=tools)
            calls[action.agent].append(action)
    for worker, actions in calls.items():
        other = next(w for w in WORKERS if w != worker)
        prompts = [a.prompt_token_ids for a in actions]
        outputs = [a.output_token_ids for a in actions]
        mine = policies.token_logprobs(worker, prompts, outputs)
        theirs = policies.token_logprobs(other, prompts, outputs)
        for action, m, t in zip(actions, mine, theirs):
            recorded = torch.tensor(action.output_logprobs)
            assert torch.allclose(m.detach().float(), recorded, atol=1e-3), f"{worker}: not its adapter's log-probs"
            assert not torch.allclose(t.detach().float(), recorded, atol=1e-3), f"{worker}: {other}'s log-probs"


def test_batch_of_8_routes_each_worker_to_its_adapter(app_env, policies):
    """`batch` of 8 through the unchanged app; tasks repeat, so identical prompts of one agent are in flight
    together (G rollouts of a task) and each still gets its own completion's tokens."""
    traced = instrument(app_env.attach(team()), background=False)
    traced.batch([task(n % 4) for n in range(8)])
    episodes = traced.episodes
    assert len(episodes) == 8
    check_routed(episodes, policies)
    assert not app_env.registry.pending()  # every registered call was collected


def test_asyncio_gather_with_a_streaming_app(app_env, policies):
    """`ainvoke` under asyncio.gather, the app's ChatOpenAI streaming: the record still reaches the trace (by
    the completion id in the streamed `system_fingerprint`), also with identical prompts in flight."""
    traced = instrument(app_env.attach(team(streaming=True)), background=False)

    async def run():
        return await asyncio.gather(*(traced.ainvoke(task(n % 2)) for n in range(4)))  # pairs of identical prompts

    asyncio.run(run())
    check_routed(traced.episodes, policies)


def test_streaming_chunks_carry_tokens_logprobs_and_usage(client, policies):
    messages = [{"role": "user", "content": "order B42: where is it?"}]
    stream = client.chat.completions.create(model="writer", messages=messages, stream=True, logprobs=True,
                                            max_tokens=6, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == policies.render(messages)
    assert chunks[-1].usage.completion_tokens == len(ids) == len(entries) == 6
    assert content == policies.tokenizer.decode(ids, skip_special_tokens=True)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    recomputed = policies.token_logprobs("writer", [policies.render(messages)], [ids])[0]
    assert torch.allclose(recomputed.detach().float(), torch.tensor([e.logprob for e in entries]), atol=1e-3)


def test_tool_calls_in_the_request_and_in_the_reply(endpoint, policies, monkeypatch):
    """Tools and a tool-call history reach the chat template; a reply that writes a <tool_call> block comes
    back as an OpenAI tool call (the tiny model cannot write one, so its sampler is scripted here)."""
    encode = policies.tokenizer
    reply = '<tool_call>{"name": "lookup_order", "arguments": {"order_id": "C99"}}</tool_call>'

    def scripted_sample(adapter, prompt_ids, **kwargs):
        ids = encode(reply, add_special_tokens=False)["input_ids"]
        return Generation(prompt_token_ids=list(prompt_ids), output_token_ids=ids, output_logprobs=[-0.5] * len(ids),
                          finished=True)

    monkeypatch.setattr(policies, "sample", scripted_sample)
    history = [HumanMessage("what happened to C99?"),
               AIMessage("", tool_calls=[{"name": "lookup_order", "args": {"order_id": "A17"}, "id": "call_1"}]),
               ToolMessage("shipped on May 2", tool_call_id="call_1", name="lookup_order")]
    chat = ChatOpenAI(model="researcher", base_url=endpoint.base_url, api_key=KEY, max_retries=0)
    message = chat.bind_tools([lookup_order]).invoke(history)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("lookup_order", {"order_id": "C99"})]
    assert message.response_metadata["finish_reason"] == "tool_calls"

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY, max_retries=0)
    wire = [{"role": "user", "content": "what happened to C99?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "lookup_order", "arguments": json.dumps({"order_id": "A17"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "shipped on May 2"}]
    tools = [{"type": "function", "function": {"name": "lookup_order", "description": "Look up an order.",
                                               "parameters": {"type": "object", "properties": {
                                                   "order_id": {"type": "string"}}}}}]
    done = client.chat.completions.create(model="researcher", messages=wire, tools=tools,
                                          extra_body={"return_token_ids": True})
    hf = to_hf_messages([dict_to_message(m) for m in [
        {"role": "user", "content": "what happened to C99?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "lookup_order",
                                                              "args": {"order_id": "A17"}}]},
        {"role": "tool", "content": "shipped on May 2", "tool_call_id": "call_1"}]])
    assert done.model_extra["prompt_token_ids"] == policies.render(hf, tools=tools)  # tools and history rendered
    assert done.choices[0].message.tool_calls[0].function.name == "lookup_order"
    chunks = list(client.chat.completions.create(model="researcher", messages=wire, tools=tools, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("lookup_order",
                                                                                       {"order_id": "C99"})]


def test_identical_prompts_of_two_agents_are_refused_unless_the_model_names_one(endpoint, client):
    messages = [HumanMessage("same words from two nodes")]
    runs = {}
    for worker in (*WORKERS, "writer"):  # two writer calls (fine together) and one researcher call
        run_id = uuid.uuid4()
        endpoint.router.on_chat_model_start({}, [messages], run_id=run_id,
                                            metadata={"langgraph_checkpoint_ns": f"{worker}:{uuid.uuid4()}"})
        runs.setdefault(worker, []).append(run_id)
    wire = [{"role": "user", "content": "same words from two nodes"}]
    try:
        with pytest.raises(openai.ConflictError) as refused:
            client.chat.completions.create(model="gpt-4o-mini", messages=wire)
        assert refused.value.status_code == 409
        assert "ambiguous" in refused.value.message and "researcher, writer" in refused.value.message
        assert refused.value.response.headers["x-should-retry"] == "false"
        # naming the agent settles it; both identical writer calls are served, one each
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(model="writer", messages=wire)
            assert raw.headers["x-mappa-agent"] == "writer" and raw.parse().model_extra["agent"] == "writer"
        assert sorted(c.claims for c in endpoint.registry.pending() if c.agent == "writer") == [1, 1]
    finally:
        for ids in runs.values():
            for run_id in ids:
                endpoint.registry.drop(run_id)


def test_a_client_naming_an_agent_gets_that_agents_adapter(client, policies):
    messages = [{"role": "user", "content": "hello"}]
    for worker in WORKERS:
        done = client.chat.completions.create(model=worker, messages=messages, logprobs=True,
                                              extra_body={"return_token_ids": True})
        assert (done.model_extra["agent"], done.model_extra["adapter"]) == (worker, worker)
        ids = done.choices[0].model_extra["token_ids"]
        recomputed = policies.token_logprobs(worker, [done.model_extra["prompt_token_ids"]], [ids])[0]
        logprobs = torch.tensor([e.logprob for e in done.choices[0].logprobs.content])
        assert torch.allclose(recomputed.detach().float(), logprobs, atol=1e-3)
    names = [m.id for m in client.models.list()]
    assert names == [policies.base_name, *WORKERS]


def test_unknown_agent_and_bad_requests_get_openai_style_errors(endpoint, client):
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="sovler", messages=hello)
    assert "'sovler' is not an agent (agents: researcher, writer)" in unknown.value.message
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(model="writer", messages=hello, n=2)
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model="writer", messages=[])
    assert "messages" in empty.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="wrong", max_retries=0).models.list()
    raw = httpx.post(f"{endpoint.base_url}/chat/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(("field", "value", "param"), [
    ("max_tokens", 10**9, "max_tokens"),  # decoded while every other request waited: the server stalled
    ("max_tokens", 0, "max_tokens"),  # fell back to the default
    ("max_completion_tokens", -1, "max_completion_tokens"),
    ("temperature", 1e-300, "temperature"),  # 0 in float32: NaN log-probs, then a bare 500
    ("top_logprobs", True, "top_logprobs"),
    ("seed", True, "seed"),
    ("stop", 5, "stop"),
    ("stop", [1], "stop"),
    ("stream", "yes", "stream"),
    ("stream_options", [1], "stream_options"),  # failed after the 200 headers, mid-stream
])
def test_hostile_sampling_fields_are_refused_up_front_naming_the_field(endpoint, field, value, param):
    body = {"model": "writer", "messages": [{"role": "user", "content": "hello"}], field: value}
    if field == "stream_options":
        body["stream"] = True
    reply = httpx.post(f"{endpoint.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["code"] == "invalid_value"


def test_hostile_bodies_and_registrations_get_4xx_errors_not_500s(endpoint):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = endpoint.base_url
    deep = b"[" * 100_000 + b"]" * 100_000  # RecursionError, not a ValueError
    for path in ("/chat/completions", "/mappa/calls", f"/mappa/calls/{uuid.uuid4()}/finish"):
        reply = httpx.post(url + path, content=deep, headers=auth)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json", (path, reply.text)
    huge = httpx.post(url + "/chat/completions", content=b" " * (17 << 20), headers=auth)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    good = {"run_id": str(uuid.uuid4()), "key": "0" * 32, "node": "writer"}
    for bad in ({"node": ["a"]}, {"key": "k" * (4 << 20)}, {"seed": "x"}, {"greedy": "false"}, {"agent": 5}):
        reply = httpx.post(url + "/mappa/calls", json={**good, **bad}, headers=auth)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_call", (bad, reply.text)
    for ids in (5, [{}]):
        reply = httpx.post(f"{url}/mappa/calls/{uuid.uuid4()}/finish", json={"completion_ids": ids}, headers=auth)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_call", (ids, reply.text)


def test_sampling_other_than_temperature_is_refused_and_never_forwarded(endpoint):
    """The loss assumes temperature sampling from the model itself: top_p, penalties, logit bias or constrained
    decoding would sample from one distribution and train as if from another. Forwarded requests pass on only
    what the local path serves (a chat template, a vLLM-only knob, are not sent)."""
    import socket
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mappa_graph.serving.vllm import VLLMBackend

    hello = {"model": "writer", "messages": [{"role": "user", "content": "hello"}]}
    for field, value in (("top_p", 0.5), ("presence_penalty", 2.0), ("logit_bias", {"5": 100}),
                         ("response_format", {"type": "json_object"}), ("structured_outputs", {"regex": "a+"})):
        reply = httpx.post(f"{endpoint.base_url}/chat/completions", json={**hello, field: value},
                           headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (field, reply.text)
        assert "changes the distribution tokens are sampled from" in reply.json()["error"]["message"]

    seen: list[dict] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "base", "root": "/m", "parent": None},
                                                         {"id": "writer-v1", "root": "/w", "parent": "base"}]})

    async def chat(request):
        seen.append(await request.json())
        return JSONResponse({"id": "x", "model": "writer-v1", "prompt_token_ids": [1], "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
            "token_ids": [5], "logprobs": {"content": [{"token": "hi", "logprob": -0.1}]}}]})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/models", models), Route(
        "/v1/chat/completions", chat, methods=["POST"])]), log_level="error"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    try:
        backend = VLLMBackend.connect(f"http://127.0.0.1:{sock.getsockname()[1]}")
        backend.route("writer", "writer-v1")
        with PolicyEndpoint(upstream=backend) as forwarding:
            reply = httpx.post(f"{forwarding.base_url}/chat/completions", json={
                **hello, "top_p": 1, "chat_template": "{{ 'injected' }}", "echo": True, "priority": -100})
    finally:
        server.should_exit = True
    assert reply.status_code == 200, reply.text
    assert not {"chat_template", "echo", "priority"} & set(seen[-1])
    assert {k: seen[-1][k] for k in ("top_p", "top_k", "min_p", "repetition_penalty", "temperature")} == {
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "temperature": 1.0}


_TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # bind_tools(tool_choice="any")
    ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),  # with_structured_output
    ({"tool_choice": 7}, "tool_choice"),
    ({"tools": [{**_TOOL, "function": {**_TOOL["function"], "strict": True}}]}, "tools"),
    ({"tools": ["lookup"]}, "tools"),
])
def test_forced_or_strict_tool_calls_are_refused_as_constrained_decoding(endpoint, extra, param):
    """vLLM serves a required or named tool_choice, and strict tools, by constrained decoding: the tokens come
    from a masked distribution and would be trained as if sampled from the model; the local path ignored them
    and the app did not get the tool call it forced. Both are refused, naming the field and what to send."""
    body = {"model": "writer", "messages": [{"role": "user", "content": "hello"}], "tools": [_TOOL], **extra}
    reply = httpx.post(f"{endpoint.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
    if param == "tool_choice" and extra["tool_choice"] != 7:
        assert "constrained decoding" in error["message"] and "'auto'" in error["message"], error


def test_tool_choice_none_renders_no_tools_and_auto_renders_them(endpoint):
    """`tool_choice: "none"` says the model is not to call a tool: the local path renders the prompt without
    them (the tokens the model is trained on are the ones it saw), `auto` and no choice with them."""
    hello = {"model": "writer", "messages": [{"role": "user", "content": "hello"}], "return_token_ids": True,
             "max_tokens": 1, "temperature": 0}

    def prompt_ids(**extra):
        reply = httpx.post(f"{endpoint.base_url}/chat/completions", json={**hello, **extra},
                           headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_token_ids"]

    bare = prompt_ids()
    assert prompt_ids(tools=[_TOOL], tool_choice="none") == bare
    assert prompt_ids(tools=[_TOOL], tool_choice="auto") == prompt_ids(tools=[_TOOL]) != bare


def test_an_agent_named_in_any_script_is_served(tiny_path, one_torch_thread):
    policies = AgentPolicies.from_pretrained(str(tiny_path), ["研究员"])
    with PolicyEndpoint(policies, max_tokens=2) as endpoint:
        reply = httpx.post(f"{endpoint.base_url}/chat/completions",
                           json={"model": "研究员", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-mappa-agent"] == "%E7%A0%94%E7%A9%B6%E5%91%98"


def test_the_endpoint_survives_clients_that_disconnect_mid_stream(endpoint, client):
    body = {"model": "researcher", "messages": [{"role": "user", "content": "long answer"}], "stream": True,
            "max_tokens": 16}
    for _ in range(3):
        # leaving the block closes the connection with most of the stream unread
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{endpoint.base_url}/chat/completions", json=body,
                headers={"Authorization": f"Bearer {KEY}"}) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ")
    done = client.chat.completions.create(model="researcher", messages=body["messages"], max_tokens=4)
    assert done.usage.completion_tokens >= 1


def check_forwarded(episodes, policies: AgentPolicies, version: int) -> None:
    for episode in episodes:
        llm = [a for a in episode.actions if a.kind == "llm" and a.agent in WORKERS]
        assert [(a.agent, a.adapter) for a in llm] == [(w, f"{w}-v{version}") for w in WORKERS]
        for action in llm:  # upstream holds the same weights: its log-probs are this adapter's
            recomputed = policies.token_logprobs(action.agent, [action.prompt_token_ids], [action.output_token_ids])[0]
            assert torch.allclose(recomputed.detach().float(), torch.tensor(action.output_logprobs), atol=1e-3)


def test_forwarding_to_an_upstream_vllm_like_server(lora_server, policies, monkeypatch):
    """In front of vLLM (the loopback LoRA server stands in): each routed request goes upstream under the
    agent's versioned adapter name, and the trace holds the tokens and log-probs upstream returned."""
    from mappa_graph.serving.vllm import VLLMBackend

    seen_before = len(lora_server.paths("/v1/chat/completions"))
    backend = VLLMBackend.connect(lora_server.base_url)
    backend.sync(policies, 3)
    with PolicyEndpoint(upstream=backend) as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "unused")
        traced = instrument(endpoint.attach(team()), background=False)
        traced.batch([task(1), task(2)])
        check_forwarded(traced.episodes, policies, 3)
        sent = lora_server.paths("/v1/chat/completions")[seen_before:]
        assert sorted(r["model"] for r in sent) == ["researcher-v3"] * 2 + ["writer-v3"] * 2
        assert all(r["return_token_ids"] and r["logprobs"] and r["temperature"] == 1.0 for r in sent)
        backend.sync(policies, 4)  # a new version: the next request goes to the new name
        with openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0) as client:
            done = client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "hi"}])
        assert done.model_extra["adapter"] == "writer-v4"
    backend.close()


def test_mappa_serve_routes_an_instrumented_app_in_another_process(lora_server, policies, tmp_path, monkeypatch):
    """`mappa serve --manifest DIR --upstream URL`: the app, in its own process, registers its calls with the
    endpoint over HTTP (remote_router), and each worker is served its exported adapter by the upstream."""
    from mappa_graph import cli
    from mappa_graph.serving.export import export_adapters
    from mappa_graph.serving.routing import remote_router

    export_adapters(policies, tmp_path / "export", version=7)
    seen = {}

    def serve_forever(endpoint):  # stands in for blocking on uvicorn: serve, run the app against it, stop
        with endpoint:
            monkeypatch.setenv("OPENAI_BASE_URL", endpoint.base_url)
            monkeypatch.setenv("OPENAI_API_KEY", "k")
            # only the URL and key cross over: the app's process sees no endpoint object
            app = team().with_config(callbacks=[remote_router(endpoint.base_url, api_key="k")])
            traced = instrument(app, background=False)
            traced.batch([task(3), task(3)])
            seen["episodes"], seen["pending"] = traced.episodes, endpoint.registry.pending()

    monkeypatch.setattr(PolicyEndpoint, "serve_forever", serve_forever)
    status = cli.main(["serve", "--manifest", str(tmp_path / "export"), "--upstream", lora_server.base_url,
                       "--port", "0", "--api-key", "k"])
    assert status == 0
    check_forwarded(seen["episodes"], policies, 7)
    assert seen["pending"] == []


def test_the_trainer_trains_the_unchanged_app_through_the_endpoint(app_env, policies, tmp_path):
    """Each worker's adapter moves only on its own actions: the researcher's actions are left unscored, so
    its adapter stays bit-identical while the writer's moves in the same steps."""
    from mappa_graph.judging.verifier import VerifierJudge
    from mappa_graph.traces import Task
    from mappa_graph.training.config import TrainConfig
    from mappa_graph.training.credit import RewardConfig
    from mappa_graph.training.trainer import Trainer

    def writer_only(action, episode, reference):
        return float(len(action.output_text) % 2) if action.agent == "writer" else None

    tasks = [Task(id=f"t{n}", input=task(n)) for n in range(2)]
    config = TrainConfig(run_name="endpoint", output_dir=str(tmp_path), iterations=2, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=4, lr=5e-2,
                         reward=RewardConfig(filter_zero_signal=False))
    trainer = Trainer(team(), policies, VerifierJudge(writer_only, name="parity"), tasks, config, endpoint=app_env)
    before = {w: {n: p.detach().clone() for n, p in policies.adapter_parameters(w).items()} for w in WORKERS}
    records = trainer.train()
    trainer.close()
    episodes = trainer.store.episodes(run="endpoint")
    assert len(episodes) == 2 * 2 * 2
    for episode in episodes:
        llm = [a for a in episode.actions if a.kind == "llm" and a.agent in WORKERS]
        assert [(a.agent, a.adapter) for a in llm] == [(w, w) for w in WORKERS]
        assert all(a.output_token_ids and len(a.output_logprobs) == len(a.output_token_ids) for a in llm)
    assert [r["agents"]["writer"]["samples"] for r in records] == [4, 4]
    moved = {w: any(not torch.equal(before[w][n], p) for n, p in policies.adapter_parameters(w).items())
             for w in WORKERS}
    assert moved == {"researcher": False, "writer": True}


def test_a_failure_while_sampling_is_an_openai_style_error_and_the_server_goes_on(endpoint, policies, monkeypatch):
    hello = [{"role": "user", "content": "hello"}]

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY, max_retries=0)
    with monkeypatch.context() as patch:
        patch.setattr(policies, "sample", broken)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="writer", messages=hello)
    assert "RuntimeError: CUDA out of memory (simulated)" in failed.value.message
    assert failed.value.code == "internal_error"
    assert client.chat.completions.create(model="writer", messages=hello, max_tokens=2).usage.completion_tokens >= 1
