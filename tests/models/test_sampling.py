"""The behaviour distribution (issue 13 item 3) and per-call seeds (issue 13 item 6) on the tiny model.

Sampling uses temperature only, whatever the model's generation_config carries, and the training path divides
the logits by the same temperature, so the first on-policy epoch has an importance ratio of exactly 1.
"""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import START, StateGraph
from langgraph.types import Send

from mappa_graph import AgentPolicies

AGENTS = ["planner", "coder"]


@pytest.fixture(scope="module")
def policies(tiny_path, one_torch_thread) -> AgentPolicies:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), AGENTS)
    # What a hub model's generation_config often carries: processors that are not the behaviour policy.
    config = policies.model.get_base_model().generation_config
    config.repetition_penalty, config.top_k, config.top_p, config.do_sample = 1.1, 20, 0.8, True
    with torch.no_grad():  # adapters away from zero, so "coder" and "planner" really differ from the base
        for name, p in policies.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policies


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("pack", [True, False])
def test_recorded_logprobs_are_the_training_logprobs_at_any_temperature(policies, temperature, pack) -> None:
    model = policies.chat_model("coder", max_new_tokens=32, temperature=temperature)
    record = model.invoke([HumanMessage("mean of fare? print(df['fare'].mean())")],
                          config={"metadata": {"mappa_seed": "7"}}).response_metadata["mappa"]
    assert record["temperature"] == temperature
    recorded = torch.tensor(record["output_logprobs"])
    new = policies.token_logprobs("coder", [record["prompt_token_ids"]], [record["output_token_ids"]],
                                  temperature=temperature, pack=pack)[0].detach()
    assert len(record["output_token_ids"]) >= 8
    ratio = torch.exp(new - recorded)  # the first, on-policy epoch's importance ratio, per token
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), (ratio - 1).abs().max()
    assert not ((ratio - 1).abs() > 0.2).any()  # nothing clipped at PPO's epsilon


def test_temperature_per_sequence_in_one_packed_pass(policies) -> None:
    records = []
    for t in (0.7, 1.3):
        records.append(policies.chat_model("coder", max_new_tokens=16, temperature=t)
                       .invoke([HumanMessage("sum of age")], config={"metadata": {"mappa_seed": "1"}})
                       .response_metadata["mappa"])
    got = policies.token_logprobs("coder", [r["prompt_token_ids"] for r in records],
                                  [r["output_token_ids"] for r in records], temperature=[0.7, 1.3])
    for record, logp in zip(records, got):
        assert torch.allclose(logp.detach(), torch.tensor(record["output_logprobs"]), atol=1e-5)


def test_temperature_must_be_positive(policies) -> None:
    with pytest.raises(ValueError, match="temperature"):
        policies.token_logprobs("coder", [[1, 2]], [[3]], temperature=0.0)
    with pytest.raises(ValueError, match="2 temperatures for 1 samples"):
        policies.token_logprobs("coder", [[1, 2]], [[3]], temperature=[1.0, 1.0])


# ---- seeds (issue 13 item 6) ------------------------------------------------------------------------------
class FanState(TypedDict):
    topics: list[str]
    replies: Annotated[list[tuple[str, str]], operator.add]


def _fan_out_graph(policies: AgentPolicies):
    """A Send fan-out whose branches get prompts of the same length (same text), each node calling twice."""
    coder = policies.chat_model("coder", max_new_tokens=12)

    def branch(state: dict) -> dict:
        prompt = [SystemMessage("You code."), HumanMessage(state["topic"])]
        first, second = coder.invoke(prompt), coder.invoke(prompt)  # one node, same prompt, two calls
        return {"replies": [(first.response_metadata["mappa"]["output_token_ids"],
                             second.response_metadata["mappa"]["output_token_ids"])]}

    g = StateGraph(FanState)
    g.add_node("branch", branch)
    g.add_conditional_edges(START, lambda s: [Send("branch", {"topic": t}) for t in s["topics"]])
    return g.compile()


def test_seeds_differ_per_branch_and_per_call_and_reruns_reproduce(policies) -> None:
    graph = _fan_out_graph(policies)
    config = {"metadata": {"mappa_seed": "3:0:task"}}
    run = graph.invoke({"topics": ["mean of age"] * 3, "replies": []}, config=config)["replies"]
    streams = [tuple(ids) for pair in run for ids in pair]
    assert len(set(streams)) == len(streams), "two calls drew the same random stream"
    again = graph.invoke({"topics": ["mean of age"] * 3, "replies": []}, config=config)["replies"]
    assert sorted(again) == sorted(run)  # the same episode seed reproduces every call (branch order aside)
    other = graph.invoke({"topics": ["mean of age"] * 3, "replies": []},
                         config={"metadata": {"mappa_seed": "3:0:other"}})["replies"]
    assert sorted(other) != sorted(run)
