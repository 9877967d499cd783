"""Serving backends: VLLMBackend against a real loopback server with the vLLM LoRA endpoints (backed by the tiny
model), LocalBackend, and the vLLM command line. No vLLM here: the GPU check runs vLLM itself."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from agents import arithmetic
from mappa_graph import AgentPolicies, VerifierJudge, export_adapters, instrument
from mappa_graph.errors import VLLMError
from mappa_graph.serving.adapter_files import save_adapter
from mappa_graph.serving.local import LocalBackend
from mappa_graph.serving.vllm import VLLMBackend, _retokenize_output, vllm_command
from mappa_graph.testing.lora_server import LoRAServer
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig
from mappa_graph.training.trainer import Trainer

AGENTS = ["planner", "calculator"]
PROMPT = [SystemMessage("Write the expression."), HumanMessage("3 plus 5")]


def perturb(policies: AgentPolicies, seed: int, scale: float = 0.3) -> None:
    """Move every adapter off zero (peft starts lora_B at 0, i.e. at the base) with a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in policies.adapters:
            for p in policies.adapter_parameters(adapter).values():
                p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


@pytest.fixture()
def policies(tiny_path) -> AgentPolicies:
    torch.manual_seed(0)
    pol = AgentPolicies.from_pretrained(str(tiny_path), AGENTS)
    perturb(pol, seed=1)
    return pol


@pytest.fixture()
def server(tiny_path):
    with LoRAServer.from_pretrained(str(tiny_path)) as srv:
        yield srv


@pytest.fixture()
def backend(server, tmp_path):
    with VLLMBackend.connect(server.base_url, adapter_dir=tmp_path / "served") as b:
        yield b


def _local(policies: AgentPolicies, agent: str, messages=PROMPT, n: int = 8):
    return policies.chat_model(agent, do_sample=False, max_new_tokens=n).invoke(messages)


def test_vllm_command_enables_lora_and_names_every_adapter(policies, tmp_path) -> None:
    a = save_adapter(policies, "planner", tmp_path / "planner-v3")
    b = save_adapter(policies, "calculator", tmp_path / "calculator-v3")
    cmd = vllm_command("some/base", adapters={"planner-v3": a, "calculator-v3": b}, served_model_name="base",
                       port=8123, extra_args=["--gpu-memory-utilization", "0.5"], python="python")
    assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    assert "--model some/base" in joined and "--port 8123" in joined and "--served-model-name base" in joined
    assert "--enable-lora" in cmd and "--max-lora-rank 8" in joined and "--max-loras 2" in joined
    i = cmd.index("--lora-modules")
    assert cmd[i + 1 : i + 3] == [f"planner-v3={a.resolve()}", f"calculator-v3={b.resolve()}"]
    assert "--logprobs-mode processed_logprobs" in joined and cmd[-2:] == ["--gpu-memory-utilization", "0.5"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_start_without_vllm_names_the_install_command() -> None:
    with pytest.raises(ImportError, match=r'pip install "mappa-graph\[vllm\]"'):
        VLLMBackend.start("tiny")


def test_start_launches_the_command_serves_the_manifest_and_stops(policies, tmp_path, monkeypatch) -> None:
    """start() end to end, with the loopback server standing in for vLLM's module on the same command line."""
    from mappa_graph.serving import vllm as vllm_module

    real = vllm_module.vllm_command

    def stand_in(*args, **kwargs):
        cmd = real(*args, **kwargs)
        return [("mappa_graph.testing.lora_server" if c == "vllm.entrypoints.openai.api_server" else c) for c in cmd]

    monkeypatch.setattr(vllm_module, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_module, "vllm_command", stand_in)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the child process: see one_torch_thread in conftest
    export_adapters(policies, tmp_path / "export", version=4)
    with VLLMBackend.start(manifest=tmp_path / "export", adapter_dir=tmp_path / "served", startup_timeout=120,
                           log_file=tmp_path / "server.log") as backend:
        assert backend.routes == {"planner": "planner-v4", "calculator": "calculator-v4"}
        assert backend.base_model == policies.base_name
        reply = backend.chat_model("planner", greedy=True, max_new_tokens=8).invoke(PROMPT)
        assert reply.response_metadata["mappa"]["output_token_ids"] == \
            _local(policies, "planner").response_metadata["mappa"]["output_token_ids"]
        backend.sync(policies, 5)  # the runtime endpoints exist: start() set VLLM_ALLOW_RUNTIME_LORA_UPDATING
        assert set(backend.models()) == {policies.base_name, "planner-v5", "calculator-v5"}
        process = backend.process
    assert process.wait(timeout=30) is not None


def test_sync_loads_new_names_switches_routing_and_unloads_the_old(policies, server, backend) -> None:
    assert backend.base_model == policies.base_name and backend.models() == [policies.base_name]
    assert backend.sync(policies, 0) == {"planner": "planner-v0", "calculator": "calculator-v0"}
    model = backend.chat_model("planner", greedy=True, max_new_tokens=8)  # made once, used across versions
    before = model.invoke(PROMPT)
    assert before.response_metadata["mappa"]["adapter"] == "planner-v0"
    assert before.content == _local(policies, "planner").content

    perturb(policies, seed=2)  # "the update"
    backend.sync(policies, 1)
    assert set(backend.models()) == {policies.base_name, "planner-v1", "calculator-v1"}
    after = model.invoke(PROMPT)
    assert after.response_metadata["mappa"]["adapter"] == "planner-v1"
    assert after.content == _local(policies, "planner").content != before.content
    loads = [b["lora_name"] for b in server.paths("/v1/load_lora_adapter")]
    unloads = [b["lora_name"] for b in server.paths("/v1/unload_lora_adapter")]
    assert loads == ["planner-v0", "calculator-v0", "planner-v1", "calculator-v1"]
    assert sorted(unloads) == ["calculator-v0", "planner-v0"]
    assert not (backend.adapter_dir / "planner-v0").exists() and (backend.adapter_dir / "planner-v1").exists()

    backend.sync(policies, 1)  # the same iteration again (a resumed run): never the same name twice
    assert backend.routes["planner"] == "planner-v1-r2"


def test_greedy_replies_match_the_local_policy_token_for_token(policies, backend) -> None:
    backend.sync(policies, 0)
    base = httpx.post(f"{backend.base_url}/chat/completions", json={
        "model": backend.base_model, "messages": [{"role": "system", "content": PROMPT[0].content},
                                                  {"role": "user", "content": PROMPT[1].content}],
        "temperature": 0, "max_tokens": 8}).json()["choices"][0]["message"]["content"]
    for agent in AGENTS:
        remote = backend.chat_model(agent, greedy=True, max_new_tokens=8).invoke(PROMPT)
        local = _local(policies, agent)
        got, want = remote.response_metadata["mappa"], local.response_metadata["mappa"]
        assert remote.content == local.content != base
        assert got["token_source"] == "backend" and got["agent"] == agent and got["model"] == policies.base_name
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["output_token_ids"] == want["output_token_ids"]
        assert got["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5)
        assert got["finished"] == want["finished"]


def test_sampled_logprobs_are_the_behaviour_policy_the_loss_recomputes(policies, backend) -> None:
    backend.sync(policies, 0)
    reply = backend.chat_model("calculator", temperature=1.0, max_new_tokens=10, seed=7).invoke(PROMPT)
    rec = reply.response_metadata["mappa"]
    recomputed = policies.token_logprobs("calculator", [rec["prompt_token_ids"]], [rec["output_token_ids"]])[0]
    assert torch.allclose(recomputed.detach(), torch.tensor(rec["output_logprobs"]), atol=1e-4)
    again = backend.chat_model("calculator", temperature=1.0, max_new_tokens=10, seed=7).invoke(PROMPT)
    assert again.response_metadata["mappa"]["output_token_ids"] == rec["output_token_ids"]  # seed honoured


def test_routes_to_the_base_model_or_nowhere_are_refused(policies, backend) -> None:
    with pytest.raises(VLLMError, match=r"no adapter is routed for agent 'planner'"):
        backend.chat_model("planner").invoke(PROMPT)
    with pytest.raises(ValueError, match=r"agent 'planner' is routed to the base model"):
        backend.route("planner", backend.base_model)
    backend.sync(policies, 0)
    backend.routes["planner"] = backend.base_model  # a route set behind the backend's back
    with pytest.raises(ValueError, match="routed to the base model"):
        backend.chat_model("planner").invoke(PROMPT)
    with pytest.raises(VLLMError, match=r"'nope' is not loaded"):
        backend.route("planner", "nope")


def test_duplicate_and_unknown_adapters_get_the_servers_errors(policies, backend, tmp_path) -> None:
    backend.sync(policies, 0)
    with pytest.raises(VLLMError, match="already loaded"):
        backend.load_adapter("planner-v0", backend.adapter_dir / "planner-v0")
    raw = httpx.post(f"{backend.base_url}/load_lora_adapter",
                     json={"lora_name": "planner-v0", "lora_path": str(backend.adapter_dir / "planner-v0")})
    assert raw.status_code == 400 and "already been loaded" in raw.json()["error"]["message"]
    with pytest.raises(VLLMError, match="HTTP 404.*No adapter found"):
        backend.load_adapter("ghost", tmp_path / "no-such-folder")
    with pytest.raises(VLLMError, match="HTTP 404.*cannot be found"):
        backend.unload_adapter("ghost")
    with pytest.raises(VLLMError, match="still routed for planner"):
        backend.unload_adapter("planner-v0")


def test_a_server_without_token_ids_is_retokenized_and_the_action_says_so(policies, tiny_path, tmp_path) -> None:
    with LoRAServer.from_pretrained(str(tiny_path), token_ids=False) as old, \
            VLLMBackend.connect(old.base_url, adapter_dir=tmp_path / "a") as backend:
        backend.sync(policies, 0)
        model = backend.chat_model("planner", greedy=True, max_new_tokens=8)
        graph = arithmetic.build_arithmetic_graph({"planner": model, "calculator": model}).compile()
        _, episode = instrument(graph).run_episode({"question": "3 plus 5"})
    local = _local(policies, "planner", n=8).response_metadata["mappa"]
    first = episode.actions[0]
    assert first.token_source == "retokenized" and first.adapter == "planner-v0" and first.agent == "planner"
    assert first.prompt_token_ids == local["prompt_token_ids"]  # ChatML is append-only: the prompt re-renders exactly
    text = policies.tokenizer.decode(first.output_token_ids, skip_special_tokens=True)
    assert text.strip() == first.output_text.strip()
    if first.output_logprobs is not None:  # kept only where the re-encoding has one token per reported log-prob
        assert len(first.output_logprobs) == len(first.output_token_ids)


def test_token_id_strings_in_logprobs_give_exact_output_ids_on_an_old_server(policies, tiny_path, tmp_path) -> None:
    with LoRAServer.from_pretrained(str(tiny_path), token_ids=False) as old, \
            VLLMBackend.connect(old.base_url, adapter_dir=tmp_path / "a") as backend:
        backend.sync(policies, 0)
        model = backend.chat_model("planner", greedy=True, max_new_tokens=8,
                                   extra_body={"return_tokens_as_token_ids": True})
        rec = model.invoke(PROMPT).response_metadata["mappa"]
    want = _local(policies, "planner").response_metadata["mappa"]
    assert rec["token_source"] == "retokenized"  # the prompt still had to be re-rendered
    assert rec["output_token_ids"] == want["output_token_ids"]
    assert rec["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5)


def test_retokenized_tool_calls_follow_the_chat_template(policies) -> None:
    message = AIMessage(content="", tool_calls=[{"name": "python", "args": {"code": "print(1)"}, "id": "c1"}])
    hf = [{"role": "user", "content": "run it"}]
    ids = _retokenize_output(policies.tokenizer, hf, None, message, finished=True)
    text = policies.tokenizer.decode(ids)
    assert text == '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call><|im_end|>'
    assert not policies.tokenizer.decode(_retokenize_output(policies.tokenizer, hf, None, message, False)).endswith(
        "<|im_end|>")


def test_async_calls_record_tokens_too(policies, backend) -> None:
    backend.sync(policies, 0)
    reply = asyncio.run(backend.chat_model("planner", greedy=True, max_new_tokens=8).ainvoke(PROMPT))
    assert reply.response_metadata["mappa"]["output_token_ids"] == \
        _local(policies, "planner").response_metadata["mappa"]["output_token_ids"]


def test_trainer_rolls_out_through_the_server_and_on_update_swaps_versions(policies, server, backend, tmp_path) -> None:
    backend.sync(policies, 0)
    models = {a: backend.chat_model(a, max_new_tokens=6, temperature=1.0) for a in AGENTS}
    judge = VerifierJudge(lambda action, episode, ref: float(len(action.output_text) % 2), name="parity")
    config = TrainConfig(run_name="v", output_dir=str(tmp_path / "run"), iterations=1, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=2, lr=5e-3, max_new_tokens=6,
                         reward=RewardConfig(filter_zero_signal=False))
    trainer = Trainer(arithmetic.build_arithmetic_graph(models).compile(), policies, judge,
                      arithmetic.make_tasks(4, seed=1), config, on_update=backend.sync)
    before = {n: p.detach().clone() for n, p in policies.adapter_parameters("planner").items()}
    tasks = trainer.sample_tasks(1)
    episodes = trainer.rollout(tasks, 1)
    actions = [a for e in episodes for a in e.actions if a.kind == "llm"]
    assert actions and all(a.token_source == "backend" and a.trainable for a in actions)
    assert {a.adapter for a in actions} == {"planner-v0", "calculator-v0"}
    trainer.step()  # rollouts, judge, update, on_update -> sync
    moved = any(not torch.equal(before[n], p) for n, p in policies.adapter_parameters("planner").items())
    assert moved and backend.iteration == 1 and backend.routes == {"planner": "planner-v1", "calculator": "calculator-v1"}
    assert "planner-v0" not in backend.models()
    remote = backend.chat_model("planner", greedy=True, max_new_tokens=8).invoke(PROMPT)
    assert remote.content == _local(policies, "planner").content  # the server now serves the updated adapter


def test_local_backend_has_the_same_surface(policies, tiny_path) -> None:
    live = LocalBackend(policies)
    assert live.sync(policies, 3) == {"planner": "planner", "calculator": "calculator"} and live.iteration == 3
    torch.manual_seed(0)
    serving = LocalBackend(AgentPolicies.from_pretrained(str(tiny_path), AGENTS))
    fresh = serving.chat_model("planner", greedy=True, max_new_tokens=8).invoke(PROMPT)
    serving.sync(policies, 1)  # a separate serving copy gets the trained weights
    synced = serving.chat_model("planner", greedy=True, max_new_tokens=8).invoke(PROMPT)
    assert synced.content == _local(policies, "planner").content != fresh.content
    assert synced.response_metadata["mappa"]["token_source"] == "backend"


def test_local_backend_refuses_an_adapter_of_another_shape(policies, tiny_path, tmp_path) -> None:
    from mappa_graph.models.policies import LoraSettings

    other = AgentPolicies.from_pretrained(str(tiny_path), ["planner"], lora=LoraSettings(target_modules=["q_proj"]))
    folder = save_adapter(other, "planner", tmp_path / "narrow")
    with pytest.raises(ValueError, match="other LoRA settings"):
        LocalBackend(policies).load_adapter("planner", folder)
    with pytest.raises(FileNotFoundError, match="no adapter weights"):
        LocalBackend(policies).load_adapter("planner", Path(tmp_path / "missing"))


def test_an_adapter_of_other_modules_with_as_many_tensors_is_refused_and_changes_nothing(tiny_path, tmp_path) -> None:
    """peft loads the keys that match and skips the rest: an adapter of other target modules loaded nothing
    and the agent served the base model, with no error."""
    from mappa_graph.models.policies import LoraSettings

    def team(modules: list[str]) -> AgentPolicies:
        return AgentPolicies.from_pretrained(str(tiny_path), ["planner"], lora=LoraSettings(target_modules=modules))

    serving, other = team(["q_proj", "v_proj"]), team(["k_proj", "o_proj"])
    assert len(other.adapter_parameters("planner")) == len(serving.adapter_parameters("planner"))
    folder = save_adapter(other, "planner", tmp_path / "other-modules")
    before = {n: p.detach().clone() for n, p in serving.adapter_parameters("planner").items()}
    with pytest.raises(ValueError, match="does not fit agent 'planner''s LoRA .* nothing was changed"):
        LocalBackend(serving).load_adapter("planner", folder)
    assert all(torch.equal(before[n], p) for n, p in serving.adapter_parameters("planner").items())
    with torch.no_grad():
        next(iter(other.adapter_parameters("planner").values()))[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        other.load_adapter("planner", save_adapter(other, "planner", tmp_path / "nan"))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                    reason="needs vLLM (the [vllm] extra) and a CUDA device")
def test_real_vllm_serves_the_adapters_and_swaps_them_at_run_time(policies, tmp_path) -> None:
    """The same path against vLLM itself: load by name, route, swap after an update, record exact tokens."""
    extra = ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "1024"]
    with VLLMBackend.start(policies=policies, extra_args=extra, adapter_dir=tmp_path / "served",
                           startup_timeout=600) as backend:
        for iteration in (0, 1):
            if iteration:
                perturb(policies, seed=2)
                backend.sync(policies, iteration)
            assert backend.routes == {a: f"{a}-v{iteration}" for a in AGENTS}
            for agent in AGENTS:
                rec = backend.chat_model(agent, greedy=True, max_new_tokens=8).invoke(PROMPT).response_metadata["mappa"]
                assert rec["token_source"] == "backend" and rec["adapter"] == f"{agent}-v{iteration}"
                assert rec["prompt_token_ids"] == _local(policies, agent).response_metadata["mappa"]["prompt_token_ids"]
                # near-ties of a random model may break differently on GPU, so compare what vLLM reports for the
                # tokens it chose with what the trainer's policy computes for them: the same adapter, same weights
                want = policies.token_logprobs(agent, [rec["prompt_token_ids"]], [rec["output_token_ids"]])[0]
                assert torch.allclose(torch.tensor(rec["output_logprobs"]), want.detach(), atol=2e-3)
        assert "planner-v0" not in backend.models()


def test_adapter_files_rebuild_the_folders_a_live_model_exports(tmp_path, tiny_path) -> None:
    """What a model-less Ray worker writes for its vLLM server is byte for byte what export writes."""
    from mappa_graph.serving.adapter_files import AdapterFiles

    policies = AgentPolicies.from_pretrained(str(tiny_path), ["planner", "coder", "reviewer"],
                                             share={"reviewer": "coder"})
    perturb(policies, seed=3)
    files = AdapterFiles.of(policies)
    assert files.adapters == ["planner", "coder"] and files.adapter_of["reviewer"] == "coder"
    for adapter in files.adapters:
        live = save_adapter(policies, adapter, tmp_path / "live" / adapter)
        rebuilt = save_adapter(files, adapter, tmp_path / "files" / adapter)  # the same call VLLMBackend.sync makes
        names = sorted(p.name for p in live.iterdir())
        assert names == sorted(p.name for p in rebuilt.iterdir()) and "adapter_model.safetensors" in names
        assert all((live / n).read_bytes() == (rebuilt / n).read_bytes() for n in names)
    fresh = AgentPolicies.from_pretrained(str(tiny_path), ["planner"])
    fresh.load_adapter("planner", tmp_path / "files" / "planner")
    for name, p in policies.adapter_parameters("planner").items():
        torch.testing.assert_close(fresh.adapter_parameters("planner")[name], p)
    assert files.tokenizer.get_vocab() == policies.tokenizer.get_vocab()
    with pytest.raises(KeyError, match="no files for adapter 'planner' yet"):
        AdapterFiles(files.base, files.adapter_of).write_adapter("planner", tmp_path / "none")
    with pytest.raises(TypeError, match="holds no model"):
        files.chat_model("planner")


def test_two_clients_of_one_server_never_fight_over_a_version_name(policies, server, backend, tmp_path) -> None:
    """Ray workers on one node share its server: when another client takes `planner-v1` between this one's
    name check and its load, this one loads under the next name instead of failing the rollouts."""
    with VLLMBackend.connect(server.base_url, adapter_dir=tmp_path / "other") as other:
        other.sync(policies, 1)
        real = backend._fresh_name
        stale = iter(["planner-v1"])  # what this client saw just before the other one loaded that name
        backend._fresh_name = lambda stem: next(stale, None) or real(stem)
        routes = backend.sync(policies, 1)
        assert routes["planner"] == "planner-v1-r2" and routes["calculator"] == "calculator-v1-r2"
        assert other.routes["planner"] == "planner-v1"  # the other client's version is untouched
        assert {"planner-v1", "planner-v1-r2", "calculator-v1", "calculator-v1-r2"} <= set(server.adapters)
        assert not (backend.adapter_dir / "planner-v1").exists()  # the folder for the lost name is cleaned up
        reply = backend.chat_model("planner", greedy=True, max_new_tokens=8).invoke(PROMPT)
        assert reply.response_metadata["mappa"]["adapter"] == "planner-v1-r2"
        assert reply.content == _local(policies, "planner").content


@pytest.mark.parametrize("temperature", [None, 0.7, 1.3])
def test_every_request_sets_the_temperature_and_the_action_records_it(policies, server, backend, temperature) -> None:
    backend.sync(policies, 0)
    reply = backend.chat_model("calculator", temperature=temperature, max_new_tokens=10, seed=3).invoke(PROMPT)
    sent = server.paths("/v1/chat/completions")[-1]["temperature"]
    rec = reply.response_metadata["mappa"]
    assert sent == rec["temperature"] == (1.0 if temperature is None else temperature)
    recomputed = policies.token_logprobs("calculator", [rec["prompt_token_ids"]], [rec["output_token_ids"]],
                                         temperature=rec["temperature"])[0]
    assert torch.allclose(recomputed.detach(), torch.tensor(rec["output_logprobs"]), atol=1e-5)
    greedy = backend.chat_model("calculator", greedy=True, max_new_tokens=4).invoke(PROMPT)
    assert server.paths("/v1/chat/completions")[-1]["temperature"] == greedy.response_metadata["mappa"]["temperature"] == 0.0


def test_the_trainers_temperature_from_the_run_metadata_wins_over_the_models_own(policies, server, backend) -> None:
    # TrainConfig.temperature reaches models the app constructed (at 1.0 here) through the rollout's metadata
    from mappa_graph.training.rollouts import rollout_metadata

    backend.sync(policies, 0)
    config = {"metadata": rollout_metadata(0, 1, "t", 0, temperature=0.6)}
    for model in (backend.chat_model("calculator", temperature=1.0, max_new_tokens=6),
                  policies.chat_model("calculator", temperature=1.0, max_new_tokens=6)):
        rec = model.invoke(PROMPT, config=config).response_metadata["mappa"]
        assert rec["temperature"] == 0.6
        recomputed = policies.token_logprobs("calculator", [rec["prompt_token_ids"]], [rec["output_token_ids"]],
                                             temperature=0.6)[0]
        assert torch.allclose(recomputed.detach(), torch.tensor(rec["output_logprobs"]), atol=1e-4)
    assert server.paths("/v1/chat/completions")[-1]["temperature"] == 0.6
    greedy = {"metadata": rollout_metadata(0, 1, "t", 0, greedy=True, temperature=0.6)}  # greedy still wins
    assert backend.chat_model("calculator", max_new_tokens=4).invoke(PROMPT, config=greedy) \
        .response_metadata["mappa"]["temperature"] == 0.0
    for model in (backend.chat_model("calculator", greedy=True, max_new_tokens=4),  # a greedy model stays greedy
                  policies.chat_model("calculator", do_sample=False, max_new_tokens=4)):
        assert model.invoke(PROMPT, config=config).response_metadata["mappa"]["temperature"] == 0.0
