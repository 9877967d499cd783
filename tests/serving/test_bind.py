"""Export -> manifest -> production graph: bind_adapters through the local backend and through a vLLM-style
loopback server, bad manifests refused, merged full weights, and the `mappa export` / `mappa serve` commands."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from agents.arithmetic import build_arithmetic_graph
from mappa_graph import AgentPolicies, export_adapters, instrument
from mappa_graph.cli import main
from mappa_graph.errors import BaseMismatchError
from mappa_graph.serving.bind import bind_adapters, merge_adapter
from mappa_graph.serving.export import AdapterManifest, load_manifest
from mappa_graph.serving.local import LocalBackend
from mappa_graph.serving.vllm import VLLMBackend
from mappa_graph.testing import ScriptedChatModel
from mappa_graph.testing.lora_server import LoRAServer

AGENTS = ["planner", "calculator"]
TASK = {"question": "3 plus 5"}


def _perturb(policies: AgentPolicies, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in policies.adapters:
            for p in policies.adapter_parameters(adapter).values():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


@pytest.fixture()
def trained(tiny_path) -> AgentPolicies:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), AGENTS)
    _perturb(policies, seed=1)
    return policies


@pytest.fixture()
def export(trained, tmp_path) -> Path:
    export_adapters(trained, tmp_path / "export", run="arith", iteration=3, version=3,
                    metrics={"success_rate": 0.5})
    return tmp_path / "export"


def _run(graph) -> tuple[dict, list]:
    """The graph's answer and its model calls' token records."""
    state, episode = instrument(graph).run_episode(TASK)
    return ({"expression": state["expression"], "answer": state["answer"]},
            [(a.agent, a.adapter, a.prompt_token_ids, a.output_token_ids, a.token_source) for a in episode.actions])


def _trainer_graph(policies: AgentPolicies):
    return build_arithmetic_graph({a: policies.chat_model(a, do_sample=False, max_new_tokens=8) for a in AGENTS}).compile()


def _edit(folder: Path, change) -> None:
    file = folder / "manifest.json"
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def test_manifest_round_trips_and_old_manifests_still_load(trained, export) -> None:
    manifest = load_manifest(export)
    assert manifest.root == export and manifest.schema_version == 1
    assert (manifest.run, manifest.iteration, manifest.metrics) == ("arith", 3, {"success_rate": 0.5})
    assert {n: (e.agent, e.adapter_name, e.path) for n, e in manifest.nodes.items()} == {
        "planner": ("planner", "planner-v3", "planner"), "calculator": ("calculator", "calculator-v3", "calculator")}
    assert manifest.base_model == trained.base_name and manifest.base_fingerprint
    again = AdapterManifest.model_validate_json(manifest.model_dump_json())
    assert again.model_dump() == manifest.model_dump()  # the folder (private) is not part of the record
    assert manifest.adapter_names() == {"planner-v3": (export / "planner").resolve(),
                                        "calculator-v3": (export / "calculator").resolve()}
    _edit(export, lambda d: [d.pop(k) for k in ("base_fingerprint", "base_model_path", "created_at", "metrics",
                                                "run", "iteration", "version")])
    old = load_manifest(export)  # an early manifest: only the required fields
    assert old.base_fingerprint is None and old.metrics == {} and old.version == 1


def test_bound_graph_answers_like_the_trainers_policy_through_both_backends(trained, export, tiny_path) -> None:
    want, want_calls = _run(_trainer_graph(trained))
    torch.manual_seed(0)
    base, _ = _run(_trainer_graph(AgentPolicies.from_pretrained(str(tiny_path), AGENTS)))  # fresh LoRA == base
    assert want != base  # the adapters really change the answers

    local = bind_adapters(build_arithmetic_graph, export, backend="local", greedy=True, max_new_tokens=8)
    got, calls = _run(local)
    assert got == want
    assert [c[2:] for c in calls] == [c[2:] for c in want_calls]  # same prompt and output token ids

    with LoRAServer.from_pretrained(str(tiny_path)) as server, VLLMBackend.connect(server.base_url) as vllm:
        remote = bind_adapters(build_arithmetic_graph, export, backend=vllm, greedy=True, max_new_tokens=8)
        got, calls = _run(remote)
        assert got == want
        assert [c[2:] for c in calls] == [c[2:] for c in want_calls]
        assert [(c[0], c[1]) for c in calls] == [("planner", "planner-v3"), ("calculator", "calculator-v3")]
        assert [b["model"] for b in server.paths("/v1/chat/completions")] == ["planner-v3", "calculator-v3"]
        assert all(b["temperature"] == 0 and b["logprobs"] and b["return_token_ids"]
                   for b in server.paths("/v1/chat/completions"))


def test_nodes_without_adapters_keep_the_callers_model(trained, export) -> None:
    want, _ = _run(_trainer_graph(trained))
    scripted = ScriptedChatModel(reply=lambda messages: "42")
    graph = bind_adapters(build_arithmetic_graph, export, nodes=["planner"], defaults={"calculator": scripted},
                          greedy=True, max_new_tokens=8)
    got, _ = _run(graph)
    assert got == {"expression": want["expression"], "answer": "42"}
    assert scripted.calls[0][-1].content == want["expression"]
    unbound = bind_adapters(build_arithmetic_graph, export, nodes=["planner"], max_new_tokens=8)
    with pytest.raises(KeyError, match=r"no chat model for node 'calculator'.*defaults=\{'calculator': model\}"):
        unbound.invoke(TASK)  # the factory looks its models up when a node runs


def test_a_missing_adapter_folder_is_refused(export) -> None:
    shutil.rmtree(export / "calculator")
    with pytest.raises(FileNotFoundError, match=r"adapter folder for node 'calculator' is missing"):
        bind_adapters(build_arithmetic_graph, export)


def test_a_different_base_is_refused(export, tiny_path, tmp_path) -> None:
    _edit(export, lambda d: d.update(base_fingerprint="0123456789abcdef"))
    with pytest.raises(BaseMismatchError, match=r"base model mismatch.*fingerprint 0123456789abcdef"):
        bind_adapters(build_arithmetic_graph, export)
    with LoRAServer.from_pretrained(str(tiny_path), served_name="someone/other-model") as server:
        server.root = "/models/other-model"
        with VLLMBackend.connect(server.base_url) as vllm, \
                pytest.raises(ValueError, match=r"base model mismatch.*serves 'someone/other-model'"):
            bind_adapters(build_arithmetic_graph, export, backend=vllm)


def test_unknown_nodes_are_refused_with_the_known_ones(export) -> None:
    with pytest.raises(ValueError, match=r"unknown node 'solver' \(manifest nodes: planner, calculator\)"):
        bind_adapters(build_arithmetic_graph, export, nodes=["solver"])
    _edit(export, lambda d: d["nodes"].update(plannr=d["nodes"].pop("planner")))
    with pytest.raises(ValueError, match=r"unknown node 'plannr'.*graph nodes: planner, calculator"):
        bind_adapters(build_arithmetic_graph, export, defaults={"planner": ScriptedChatModel(reply=lambda m: "1+1")})


def test_a_newer_schema_is_refused(export) -> None:
    _edit(export, lambda d: d.update(schema_version=99))
    with pytest.raises(ValueError, match="manifest schema 99 is newer"):
        bind_adapters(build_arithmetic_graph, export)


def test_merge_writes_full_weights_with_the_adapters_logits(trained, export, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = merge_adapter(export, "planner", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([trained.render([{"role": "user", "content": "3 plus 5"}])])
    with torch.no_grad(), trained.active("planner"):
        want = trained.model(input_ids=ids).logits
    with torch.no_grad(), trained.base_only():
        base = trained.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(got, base, atol=1e-2)
    assert json.loads((out / "mappa_merged.json").read_text())["adapter_name"] == "planner-v3"
    with pytest.raises(KeyError, match="unknown node 'coder'"):
        merge_adapter(export, "coder", tmp_path / "nope")


def test_cli_serve_prints_the_vllm_command(export, capsys) -> None:
    assert main(["serve", "--manifest", str(export), "--port", "8100", "--", "--max-model-len", "2048"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server")
    assert "--enable-lora" in line and "--port 8100" in line and line.endswith("--max-model-len 2048")
    assert f"planner-v3={(export / 'planner').resolve()}" in line and "--served-model-name" in line
    assert main(["serve", "--manifest", str(export.parent / "nowhere")]) == 2
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert main(["serve", "--manifest", str(export), "--run"]) == 2
        assert 'pip install "mappa-graph[vllm]"' in capsys.readouterr().err


def test_cli_export_writes_the_checkpoints_adapters(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "recipe_for_export.py").write_text(textwrap.dedent('''
        import torch
        from agents.arithmetic import build_arithmetic_graph, make_tasks, process_judge
        from mappa_graph import AgentPolicies
        from mappa_graph.training.trainer import Trainer

        def build(config):
            torch.manual_seed(0)
            policies = AgentPolicies.from_pretrained("tiny", ["planner", "calculator"])
            graph = build_arithmetic_graph({a: policies.chat_model(a) for a in policies.agents}).compile()
            return Trainer(graph, policies, process_judge(), make_tasks(2, seed=0), config)
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import recipe_for_export

    from mappa_graph.training.config import TrainConfig

    run = tmp_path / "run"
    trainer = recipe_for_export.build(TrainConfig(run_name="exp", output_dir=str(run)))
    _perturb(trainer.policies, seed=5)
    trainer.iteration = 2
    trainer.checkpoint()
    trained = {n: p.detach().clone() for n, p in trainer.policies.adapter_parameters("calculator").items()}

    assert main(["export", "recipe_for_export:build", "--output-dir", str(run), "--run-name", "exp",
                 "--out", str(tmp_path / "out")]) == 0
    assert "iteration 2" in capsys.readouterr().out
    manifest = load_manifest(tmp_path / "out")
    assert (manifest.run, manifest.iteration, manifest.nodes["calculator"].adapter_name) == ("exp", 2, "calculator-v2")
    served = LocalBackend.from_manifest(manifest).policies.adapter_parameters("calculator")
    assert all(torch.equal(served[n], t) for n, t in trained.items())
    assert main(["export", "recipe_for_export:build", "--output-dir", str(tmp_path / "empty"),
                 "--out", str(tmp_path / "o2")]) == 2
