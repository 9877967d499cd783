"""Packed log-prob passes (AgentPolicies.token_logprobs, pack=True) against the padded pass, on the tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from mappa_graph import AgentPolicies
from mappa_graph.models.policies import _first_fit_decreasing

AGENTS = ["planner", "coder"]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def policies(tiny_path) -> AgentPolicies:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), AGENTS)
    with torch.no_grad():  # fresh LoRA B is zero, which would leave every A gradient zero on both paths
        for param in policies.adapter_parameters("planner").values():
            param.normal_(0.0, 0.05)
    return policies


@pytest.fixture(scope="module")
def batch(policies) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    special = set(policies.tokenizer.all_special_ids)
    tokens = [t for t in range(len(policies.tokenizer)) if t not in special]
    prompts = [[rng.choice(tokens) for _ in range(rng.randint(1, 60))] for _ in range(11)]
    outputs = [[rng.choice(tokens) for _ in range(rng.randint(1, 20))] for _ in range(11)]
    outputs[3] = []  # an action that produced no token: an empty tensor, on both paths
    return prompts, outputs


def _logprobs_and_grads(policies, prompts, outputs, **kwargs):
    params = policies.adapter_parameters("planner")
    for p in params.values():
        p.grad = None
    logprobs = policies.token_logprobs("planner", prompts, outputs, **kwargs)
    weights = torch.linspace(-1.0, 1.0, sum(len(o) for o in outputs))  # a loss that weighs every token differently
    (torch.cat(logprobs) * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return [lp.detach() for lp in logprobs], grads


@pytest.mark.parametrize("max_tokens_per_row", [None, 1, 64, 10_000])
def test_packed_logprobs_and_adapter_gradients_match_padded(policies, batch, max_tokens_per_row) -> None:
    prompts, outputs = batch
    padded, padded_grads = _logprobs_and_grads(policies, prompts, outputs, pack=False)
    packed, packed_grads = _logprobs_and_grads(policies, prompts, outputs, max_tokens_per_row=max_tokens_per_row)
    assert [lp.shape for lp in packed] == [(len(o),) for o in outputs] == [lp.shape for lp in padded]
    for want, got in zip(padded, packed):
        assert torch.allclose(got, want, atol=1e-5)
    assert padded_grads.keys() == packed_grads.keys()
    assert any(g.abs().max() > 0 for g in padded_grads.values())
    for name, want in padded_grads.items():
        assert torch.allclose(packed_grads[name], want, atol=1e-5, rtol=1e-5), name


def test_packed_matches_padded_under_eager_attention(policies, batch) -> None:
    prompts, outputs = batch
    base = policies.model.get_base_model()
    original = base.config._attn_implementation
    base.set_attn_implementation("eager")
    try:
        padded = policies.token_logprobs("planner", prompts, outputs, pack=False)
        packed = policies.token_logprobs("planner", prompts, outputs, max_tokens_per_row=200)
    finally:
        base.set_attn_implementation(original)
    lengths = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    assert len(_first_fit_decreasing(lengths, 200)) < len(prompts)  # rows really hold several samples
    for want, got in zip(padded, packed):
        assert torch.allclose(got, want, atol=1e-5)


def test_flash_attention_falls_back_to_padding(policies, monkeypatch) -> None:
    # flash-attention reads packed position ids only in a single-row batch: several rows would mix sequences
    assert policies._can_pack()
    monkeypatch.setattr(policies.model.config, "_attn_implementation", "flash_attention_2", raising=False)
    assert not policies._can_pack()


def test_packing_is_the_default(policies, batch) -> None:
    prompts, outputs = batch
    default = policies.token_logprobs("planner", prompts, outputs)
    packed = policies.token_logprobs("planner", prompts, outputs, pack=True)
    assert all(torch.equal(a, b) for a, b in zip(default, packed))


def test_packed_reference_pass_matches_padded_without_grad(policies, batch) -> None:
    prompts, outputs = batch
    padded = policies.token_logprobs(None, prompts, outputs, pack=False)
    packed = policies.token_logprobs(None, prompts, outputs)
    assert not any(lp.requires_grad for lp in packed)
    for want, got in zip(padded, packed):
        assert torch.allclose(got, want, atol=1e-5)


def test_first_fit_decreasing_fills_rows_within_capacity() -> None:
    lengths = [5, 9, 3, 7, 2, 12, 4]
    rows = _first_fit_decreasing(lengths, 10)
    # longest first, each into the first row with room: 12 (over capacity, alone) | 9 | 7+3 | 5+4 | 2
    assert rows == [[5], [1], [3, 2], [0, 6], [4]]
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows[1:])


def test_bad_inputs_are_named(policies) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        policies.token_logprobs("planner", [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="sample 0 has an empty prompt"):
        policies.token_logprobs("planner", [[]], [[3]])
    with pytest.raises(ValueError, match="max_tokens_per_row must be >= 1"):
        policies.token_logprobs("planner", [[1]], [[3]], max_tokens_per_row=0)
