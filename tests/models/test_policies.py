"""AgentPolicies, PolicyChatModel, the per-agent update and export, on the tiny offline model."""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from mappa_graph import (
    AgentPolicies,
    RewardConfig,
    Task,
    TrainConfig,
    Trainer,
    VerifierJudge,
    export_adapters,
    instrument,
)
from mappa_graph.models.chat import parse_tool_calls
from mappa_graph.serving.export import load_manifest

AGENTS = ["planner", "coder", "reporter"]


@pytest.fixture()
def policies(tiny_path) -> AgentPolicies:
    torch.manual_seed(0)
    return AgentPolicies.from_pretrained(str(tiny_path), AGENTS)


def _snapshot(policies: AgentPolicies) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policies.model.named_parameters()}


def _team_graph(policies: AgentPolicies):
    planner = policies.chat_model("planner", max_new_tokens=12)
    coder = policies.chat_model("coder", max_new_tokens=12)

    def plan(state: MessagesState) -> dict:
        return {"messages": [planner.invoke([SystemMessage("You plan."), *state["messages"]])]}

    def code(state: MessagesState) -> dict:
        return {"messages": [coder.invoke([SystemMessage("You code."), *state["messages"]])]}

    g = StateGraph(MessagesState)
    g.add_node("planner", plan)
    g.add_node("coder", code)
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    return g.compile()


def test_unknown_agent_is_named_with_the_known_ones(policies) -> None:
    with pytest.raises(KeyError, match=r"unknown agent 'sovler' \(agents: planner, coder, reporter\)"):
        policies.chat_model("sovler")


def test_generation_records_tokens_and_behaviour_logprobs(policies) -> None:
    reply = policies.chat_model("coder", max_new_tokens=16).invoke([HumanMessage("mean of fare?")])
    record = reply.response_metadata["mappa"]
    assert record["agent"] == "coder" and record["token_source"] == "backend"
    assert 0 < len(record["output_token_ids"]) <= 16
    assert len(record["output_logprobs"]) == len(record["output_token_ids"])
    recomputed = policies.token_logprobs("coder", [record["prompt_token_ids"]], [record["output_token_ids"]])[0]
    assert torch.allclose(recomputed.detach(), torch.tensor(record["output_logprobs"]), atol=1e-4)
    assert reply.content.strip() == policies.tokenizer.decode(record["output_token_ids"], skip_special_tokens=True).strip() \
        or reply.tool_calls


def test_tool_call_blocks_parse_into_tool_calls() -> None:
    content, calls, invalid = parse_tool_calls(
        'run it <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    assert content == "run it"
    assert [(c["name"], c["args"]) for c in calls] == [("python", {"code": "print(1)"})]
    assert len(invalid) == 1 and invalid[0]["args"] == "{not json}"


def test_traced_episode_carries_exact_tokens_per_agent(policies) -> None:
    app = instrument(_team_graph(policies))
    app.invoke({"messages": [HumanMessage("task one")]})
    planner, coder = app.last_episode.actions
    assert (planner.agent, coder.agent) == ("planner", "coder")
    assert planner.trainable and coder.trainable and coder.token_source == "backend"
    # the coder saw the planner's reply: its prompt contains the planner's output tokens' text
    assert planner.output_text in policies.tokenizer.decode(coder.prompt_token_ids)


def test_update_moves_only_the_updated_agents_adapter(policies, tmp_path) -> None:
    """The trainer's own credit + update path: with the planner frozen, one step moves the coder's LoRA only."""
    app = instrument(_team_graph(policies))
    for i in range(3):
        app.invoke({"messages": [HumanMessage(f"task {i}")]})
    # a spread of rewards across episodes, so advantages are nonzero
    spread = {episode.id: score for episode, score in zip(app.episodes, (1.0, 0.0, 0.5))}
    judge = VerifierJudge(lambda action, episode, ref: spread[episode.id])
    config = TrainConfig(output_dir=str(tmp_path), frozen_agents=["planner", "reporter"], lr=1e-2,
                         reward=RewardConfig(filter_zero_signal=False))
    trainer = Trainer(app, policies, judge, [Task(id="t", input={"messages": []})], config)
    rewards = [r for rewards in judge.score_many(app.episodes) for r in rewards]
    samples, _ = trainer.credit(app.episodes, rewards, iteration=1)
    assert sorted(s.agent for s in samples) == ["coder"] * 3
    assert len({round(s.advantage, 6) for s in samples}) == 3
    before = _snapshot(policies)
    stats = trainer.update(samples)
    assert set(stats) == {policies.adapter_of["coder"]}
    after = _snapshot(policies)
    coder_params = set(policies.adapter_parameters("coder"))
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= coder_params
    assert any("lora_B" in n for n in moved)
    for name in before:
        if name not in coder_params:
            assert torch.equal(before[name], after[name]), f"{name} changed but belongs to another agent or the base"


def test_exported_adapters_reload_with_equal_logits(policies, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():  # make the adapters non-trivial, as training would
        for agent_i, agent in enumerate(AGENTS):
            for p in policies.adapter_parameters(agent).values():
                p.add_(0.05 * (agent_i + 1) * torch.randn_like(p))
    manifest = export_adapters(policies, tmp_path / "export", run="r1", iteration=3, metrics={"reward": 0.5})
    loaded = load_manifest(tmp_path / "export")
    assert loaded == manifest and set(loaded.nodes) == set(AGENTS)
    assert loaded.nodes["coder"].adapter_name == "coder-v1"
    ids = torch.tensor([policies.render([{"role": "user", "content": "mean of fare?"}])])
    for agent in AGENTS:
        with policies.active(agent), torch.no_grad():
            trained = policies.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(policies.base_path)
        reloaded = PeftModel.from_pretrained(base, tmp_path / "export" / loaded.nodes[agent].path).eval()
        with torch.no_grad():
            again = reloaded(input_ids=ids).logits
        assert torch.allclose(trained, again, atol=1e-5)
    with policies.base_only(), torch.no_grad():
        plain = policies.model(input_ids=ids).logits
    assert not torch.allclose(plain, trained, atol=1e-3)  # the adapters really change the model


def test_bad_manifest_folder_is_refused(policies, tmp_path) -> None:
    export_adapters(policies, tmp_path / "export")
    import shutil

    shutil.rmtree(tmp_path / "export" / "coder")
    with pytest.raises(FileNotFoundError, match="adapter folder for node 'coder' is missing"):
        load_manifest(tmp_path / "export")


@pytest.mark.parametrize("names", [["model", "planner"], ["layers", "self_attn"], ["lora_A", "weight"]])
def test_each_agent_owns_exactly_its_own_lora_tensors_whatever_its_name(tiny_path, names) -> None:
    """Adapter names that are also components of every parameter path (issue 13 item 7: `model` owned 112 tensors,
    its own and another agent's)."""
    policies = AgentPolicies.from_pretrained(str(tiny_path), names)
    first, second = (set(policies.adapter_parameters(a)) for a in names)
    assert first and second and not first & second
    assert len(first) == len(second)
    every_lora = {n for n, _ in policies.model.named_parameters() if ".lora_" in n}
    assert first | second == every_lora
