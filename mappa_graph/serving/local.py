"""Local backend: transformers + peft in this process, the same surface as VLLMBackend.

    backend = LocalBackend(policies)                 # the trainer's own policies: sync is then a no-op
    backend = LocalBackend.from_manifest("export/")  # production: base + exported adapters, checked

The chat models are PolicyChatModel, so replies carry exact token ids and behaviour log-probs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BaseMismatchError

if TYPE_CHECKING:
    from ..models.chat import PolicyChatModel
    from ..models.policies import AgentPolicies
    from .export import AdapterManifest


class LocalBackend:
    def __init__(self, policies: AgentPolicies) -> None:
        self.policies = policies
        self.iteration: int | None = None

    @classmethod
    def from_manifest(
        cls,
        manifest: AdapterManifest | str | Path,
        *,
        nodes: Sequence[str] | None = None,
        base_model: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
    ) -> LocalBackend:
        """Load the manifest's base (or `base_model`), check it is the one the adapters were trained on, and
        load the adapters of `nodes` (default: all), one per agent."""
        from ..models.loading import load_base_model
        from ..models.policies import AgentPolicies, LoraSettings
        from .export import base_fingerprint, load_manifest

        if not isinstance(manifest, _manifest_type()):
            manifest = load_manifest(manifest)
        nodes = list(nodes or manifest.nodes)
        source = base_model or _base_source(manifest)
        model, tokenizer, path = load_base_model(source, dtype=dtype, device=device)
        if manifest.base_fingerprint is not None and base_fingerprint(model) != manifest.base_fingerprint:
            raise BaseMismatchError(
                f"base model mismatch: {source!r} has architecture fingerprint {base_fingerprint(model)} but the "
                f"adapters in {manifest.root} were trained on {manifest.base_model!r} (fingerprint "
                f"{manifest.base_fingerprint}); load that base (base_model=...)"
            )
        folders: dict[str, Path] = {}  # agent -> adapter folder
        for node in nodes:
            entry = manifest.nodes[node]
            folder = manifest.adapter_dir(node).resolve()
            if folders.setdefault(entry.agent, folder) != folder:
                raise ValueError(f"manifest maps agent {entry.agent!r} to two adapter folders "
                                 f"({folders[entry.agent]} and {folder}); one agent has one adapter")
        owner: dict[Path, str] = {}
        share = {agent: owner.setdefault(folder, agent) for agent, folder in folders.items()}
        share = {agent: first for agent, first in share.items() if first != agent}
        policies = AgentPolicies(model, tokenizer, list(folders), base_name=manifest.base_model, base_path=path,
                                 lora=_lora_settings(LoraSettings, folders.values()), share=share)
        backend = cls(policies)
        for agent, folder in folders.items():
            if agent not in share:
                backend.load_adapter(agent, folder)
        backend.iteration = manifest.iteration
        return backend

    def chat_model(self, agent: str, *, greedy: bool = False, max_new_tokens: int | None = None,
                   temperature: float | None = None, **kwargs: Any) -> PolicyChatModel:
        """A chat model on `agent`'s adapter (greedy: argmax decoding)."""
        if greedy:
            kwargs["do_sample"] = False
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        if temperature is not None:
            kwargs["temperature"] = temperature
        return self.policies.chat_model(agent, **kwargs)

    def adapter_name(self, agent: str) -> str:
        return self.policies.adapter_of[self.policies.check_agent(agent)]

    def load_adapter(self, agent: str, path: str | Path) -> None:
        """Replace `agent`'s adapter weights with a PEFT folder's, refusing one whose tensors do not fit."""
        from safetensors import safe_open

        weights = Path(path) / "adapter_model.safetensors"
        if not weights.exists():
            raise FileNotFoundError(f"no adapter weights at {weights} (expected a PEFT adapter folder)")
        with safe_open(str(weights), "pt") as f:
            saved = len(list(f.keys()))
        expected = len(self.policies.adapter_parameters(agent))
        if saved != expected:
            raise ValueError(f"adapter {path} holds {saved} tensors but agent {agent!r} has {expected} LoRA tensors: "
                             "it was trained with other LoRA settings (rank, target modules) or on another base")
        self.policies.load_adapter(agent, path)

    def sync(self, policies: AgentPolicies, iteration: int) -> dict[str, str]:
        """After an update: the trainer's own policies serve live (nothing to do); other policies get the
        trained adapter weights copied in. Usable as `Trainer(on_update=backend.sync)`."""
        import torch

        if policies is not self.policies:
            with torch.no_grad(), policies.lock, self.policies.lock:
                for adapter in policies.adapters:
                    if adapter not in self.policies.adapters:
                        continue
                    target = self.policies.adapter_parameters(adapter)
                    for name, param in policies.adapter_parameters(adapter).items():
                        target[name].copy_(param.detach().to(target[name].device))
        self.iteration = iteration
        return {agent: self.policies.adapter_of[agent] for agent in self.policies.agents}


def _manifest_type() -> type:
    from .export import AdapterManifest

    return AdapterManifest


def _base_source(manifest: AdapterManifest) -> str:
    """The exported base path when it exists on this machine, else the base model's name (hub id or "tiny")."""
    if manifest.base_model_path and Path(manifest.base_model_path).exists():
        return manifest.base_model_path
    return manifest.base_model


def _lora_settings(settings_type: type, folders: Any) -> Any:
    """LoraSettings matching the saved adapters (AgentPolicies gives every adapter the same settings)."""
    configs = []
    for folder in folders:
        data = json.loads((Path(folder) / "adapter_config.json").read_text())
        target = data.get("target_modules")
        configs.append({"r": data.get("r", 8), "alpha": data.get("lora_alpha", 16),
                        "dropout": data.get("lora_dropout", 0.0),
                        "target_modules": sorted(target) if isinstance(target, list) else target})
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError(f"the manifest's adapters have different LoRA settings ({configs}); a local backend "
                         "holds adapters of one shape (serve mixed ones through vLLM)")
    return settings_type(**configs[0])
