"""Export trained adapters as standard PEFT folders plus a manifest that maps graph nodes to adapters.

The manifest is the hand-off to production: it names the base model (and a fingerprint of its config, so a
mismatched base is refused), and for each node the adapter name and folder. Each export gets versioned
adapter names, since vLLM can serve a stale cache for a reused name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies

MANIFEST_FILE = "manifest.json"
MANIFEST_SCHEMA = 1


class AdapterEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str
    adapter_name: str = Field(description="the name to serve it under (versioned)")
    path: str = Field(description="adapter folder, relative to the manifest")


class AdapterManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = MANIFEST_SCHEMA
    base_model: str
    base_model_path: str | None = None
    base_fingerprint: str | None = None
    nodes: dict[str, AdapterEntry]
    run: str | None = None
    iteration: int | None = None
    version: int = 1
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    # the folder the manifest was read from or written to (not serialised): where relative adapter paths start
    _root: Path | None = PrivateAttr(None)

    @property
    def root(self) -> Path | None:
        return self._root

    def adapter_dir(self, node: str, root: str | Path | None = None) -> Path:
        if node not in self.nodes:
            raise KeyError(f"unknown node {node!r} in manifest (nodes: {', '.join(self.nodes)})")
        root = root if root is not None else self._root
        if root is None:
            raise ValueError("this manifest does not know its folder: pass root=, or read it with load_manifest(path)")
        return Path(root) / self.nodes[node].path

    def adapter_names(self) -> dict[str, Path]:
        """Served adapter name -> absolute adapter folder, one entry per distinct adapter (what vLLM's
        `--lora-modules name=path` takes)."""
        return {entry.adapter_name: self.adapter_dir(node).resolve() for node, entry in self.nodes.items()}


def base_fingerprint(model: Any) -> str:
    """A short hash of the base model's architecture config: equal bases give equal fingerprints."""
    config = getattr(model, "config", None)
    if hasattr(model, "get_base_model"):
        config = model.get_base_model().config
    data = config.to_dict() if config is not None else {}
    keep = {k: data.get(k) for k in sorted(data) if k in _ARCH_KEYS}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


_ARCH_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta",
}


def export_adapters(
    policies: AgentPolicies,
    path: str | Path,
    *,
    nodes: Mapping[str, str] | None = None,
    run: str | None = None,
    iteration: int | None = None,
    version: int = 1,
    metrics: Mapping[str, Any] | None = None,
) -> AdapterManifest:
    """Write one PEFT adapter folder per agent and `manifest.json`. `nodes` maps node name to agent name
    (default: each agent serves the node of the same name). The folder is written to a temporary sibling and
    moved into place, so a crash never leaves a half-written export."""
    nodes = dict(nodes or {agent: agent for agent in policies.agents})
    for node, agent in nodes.items():
        policies.check_agent(agent)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    adapters = sorted({policies.adapter_of[agent] for agent in nodes.values()})
    with policies.lock:
        policies.model.save_pretrained(str(tmp), selected_adapters=adapters)
    manifest = AdapterManifest(
        base_model=policies.base_name,
        base_model_path=policies.base_path,
        base_fingerprint=base_fingerprint(policies.model),
        nodes={
            node: AdapterEntry(
                agent=agent,
                adapter_name=f"{policies.adapter_of[agent]}-v{version}",
                path=policies.adapter_of[agent],
            )
            for node, agent in nodes.items()
        },
        run=run,
        iteration=iteration,
        version=version,
        metrics=dict(metrics or {}),
    )
    (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    manifest._root = target
    return manifest


def load_manifest(path: str | Path) -> AdapterManifest:
    """Read and check a manifest (a folder holding manifest.json, or the file): every adapter folder must
    exist and hold a PEFT adapter."""
    path = Path(path)
    file = path / MANIFEST_FILE if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no {MANIFEST_FILE} at {path}: pass the folder export_adapters wrote")
    manifest = AdapterManifest.model_validate_json(file.read_text())
    if manifest.schema_version > MANIFEST_SCHEMA:
        raise ValueError(
            f"manifest schema {manifest.schema_version} is newer than this mappa_graph reads ({MANIFEST_SCHEMA})"
        )
    for node, entry in manifest.nodes.items():
        folder = file.parent / entry.path
        if not (folder / "adapter_config.json").exists():
            raise FileNotFoundError(
                f"adapter folder for node {node!r} is missing or incomplete: {folder} (manifest path "
                f"{entry.path!r}); copy the whole export folder, or fix the path in {file}"
            )
    manifest._root = file.parent
    return manifest
