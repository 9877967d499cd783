"""Trained adapters back into production graphs, and merging one adapter into full weights.

    graph = bind_adapters(build_arithmetic_graph, "export/", backend="local", greedy=True)
    graph = bind_adapters(build_arithmetic_graph, "export/", backend=VLLMBackend.connect("http://gpu:8000"))

A LangGraph graph closes over its chat models, so the unit bound is a graph factory: a function from a
mapping node -> chat model to a graph (the reference agents are built this way). Each node the manifest names
gets a chat model on its adapter; other nodes get the caller's `defaults`, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_core.language_models import BaseChatModel

from .export import AdapterManifest, load_manifest

GraphFactory = Callable[[Mapping[str, BaseChatModel]], Any]
BackendSpec = Any  # "local", "vllm", a server URL, a LocalBackend or a VLLMBackend


class _NodeModels(dict):
    def __missing__(self, node: str) -> BaseChatModel:
        raise KeyError(f"no chat model for node {node!r}: the manifest has no adapter for it "
                       f"(bound: {', '.join(self) or 'none'}); pass defaults={{{node!r}: model}}")


def bind_adapters(
    graph_factory: GraphFactory,
    manifest: AdapterManifest | str | Path,
    *,
    backend: BackendSpec = "local",
    nodes: Sequence[str] | None = None,
    defaults: Mapping[str, BaseChatModel] | None = None,
    greedy: bool = False,
    max_new_tokens: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    base_model: str | None = None,
    compile: bool = True,
) -> Any:
    """The production graph: `graph_factory(models)` with each manifest node's model on its adapter (through
    the local transformers backend or vLLM), compiled if the factory returned a StateGraph."""
    manifest = _manifest(manifest)
    models, _ = adapter_models(manifest, backend=backend, nodes=nodes, greedy=greedy, max_new_tokens=max_new_tokens,
                               model_kwargs=model_kwargs, base_model=base_model)
    chosen = list(models)
    for node, model in (defaults or {}).items():
        models.setdefault(node, model)
    graph = graph_factory(models)
    graph_nodes = [n for n in getattr(graph, "nodes", {}) if not n.startswith("__")]
    if graph_nodes:
        unknown = [n for n in chosen if n not in graph_nodes]
        if unknown:
            raise ValueError(f"unknown node {unknown[0]!r}: the manifest binds it but the graph has no such node "
                             f"(graph nodes: {', '.join(graph_nodes)}); fix the manifest's nodes or pass nodes=[...]")
    if compile and hasattr(graph, "compile") and not hasattr(graph, "invoke"):
        graph = graph.compile()
    return graph


def adapter_models(
    manifest: AdapterManifest | str | Path,
    *,
    backend: BackendSpec = "local",
    nodes: Sequence[str] | None = None,
    greedy: bool = False,
    max_new_tokens: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    base_model: str | None = None,
) -> tuple[dict[str, BaseChatModel], Any]:
    """node -> chat model on that node's adapter, and the backend serving them."""
    manifest = _manifest(manifest)
    for node in nodes or ():
        if node not in manifest.nodes:
            raise ValueError(f"unknown node {node!r} (manifest nodes: {', '.join(manifest.nodes)})")
    chosen = list(nodes or manifest.nodes)
    serving = _backend(backend, manifest, chosen, base_model)
    kwargs = dict(model_kwargs or {})
    models = _NodeModels({
        node: serving.chat_model(manifest.nodes[node].agent, greedy=greedy, max_new_tokens=max_new_tokens, **kwargs)
        for node in chosen
    })
    return models, serving


def _manifest(manifest: AdapterManifest | str | Path) -> AdapterManifest:
    if isinstance(manifest, AdapterManifest):
        if manifest.root is None:
            raise ValueError("this AdapterManifest does not know its folder; pass the export folder's path instead")
        return load_manifest(manifest.root)  # re-checked: the folders may have moved since
    return load_manifest(manifest)


def _backend(backend: BackendSpec, manifest: AdapterManifest, nodes: list[str], base_model: str | None) -> Any:
    from .local import LocalBackend

    if backend == "local":
        return LocalBackend.from_manifest(manifest, nodes=nodes, base_model=base_model)
    if isinstance(backend, LocalBackend):
        for node in nodes:
            entry = manifest.nodes[node]
            backend.load_adapter(entry.agent, manifest.adapter_dir(node))
        return backend
    from .vllm import VLLMBackend

    if backend == "vllm":
        return VLLMBackend.start(base_model, manifest=manifest)
    if isinstance(backend, str) and backend.startswith(("http://", "https://")):
        backend = VLLMBackend.connect(backend)
    if isinstance(backend, VLLMBackend):
        backend.use_manifest(manifest, nodes)
        return backend
    raise ValueError(f"unknown backend {backend!r}: use 'local', 'vllm', a vLLM server URL, or a LocalBackend / "
                     "VLLMBackend instance")


def merge_adapter(
    manifest: AdapterManifest | str | Path,
    node: str,
    out_dir: str | Path,
    *,
    base_model: str | None = None,
    atol: float = 1e-4,
) -> Path:
    """Fold `node`'s adapter into full weights (peft merge_and_unload) for a single-agent deployment that
    needs no LoRA support; the merged model's logits are checked against base+adapter before saving."""
    import torch
    from peft import PeftModel

    from ..errors import BaseMismatchError
    from ..models.loading import load_base_model
    from .export import base_fingerprint
    from .local import _base_source

    manifest = _manifest(manifest)
    folder = manifest.adapter_dir(node)  # unknown node: KeyError naming the manifest's nodes
    source = base_model or _base_source(manifest)
    model, tokenizer, _ = load_base_model(source)
    if manifest.base_fingerprint is not None and base_fingerprint(model) != manifest.base_fingerprint:
        raise BaseMismatchError(f"base model mismatch: {source!r} is not the base the adapters were trained on "
                                f"({manifest.base_model!r}); pass base_model=...")
    peft_model = PeftModel.from_pretrained(model, str(folder)).eval()
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "merge check: 1 + 2 = ?"}], tokenize=False,
                                          add_generation_prompt=True)
    ids = torch.tensor([tokenizer(probe, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits.float()
        merged = peft_model.merge_and_unload()
        got = merged(input_ids=ids).logits.float()
    gap = float((want - got).abs().max())
    if gap > atol:
        raise RuntimeError(f"merged weights disagree with base+adapter by {gap:.2e} (> {atol}); not saved")
    out = Path(out_dir)
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    entry = manifest.nodes[node]
    (out / "mappa_merged.json").write_text(json.dumps({
        "node": node, "agent": entry.agent, "adapter_name": entry.adapter_name, "base_model": manifest.base_model,
        "run": manifest.run, "iteration": manifest.iteration, "max_logit_gap": gap,
    }, indent=2))
    return out
