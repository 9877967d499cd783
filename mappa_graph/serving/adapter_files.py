"""A team's adapters as the files of their PEFT folders, with no model: what a Ray worker gets for each version
when the team's models are served elsewhere (`RayConfig(load_base=False)`, one vLLM server per node).

It carries what `VLLMBackend.sync` uses of an `AgentPolicies` (`adapters`, `adapter_of`, a folder per adapter
via `save_adapter`, the tokenizer), so a worker pushes each version to its node's server without holding
a copy of the base model, which for a 7B base saves that worker ~15 GB of memory and a minute of loading.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies


class AdapterFiles:
    def __init__(self, base: str, adapter_of: dict[str, str], files: dict[str, dict[str, bytes]] | None = None) -> None:
        self.base = base
        self.adapter_of = dict(adapter_of)
        self.agents = list(adapter_of)
        self.adapters = list(dict.fromkeys(adapter_of.values()))
        self.files: dict[str, dict[str, bytes]] = dict(files or {})
        self._tokenizer: Any = None

    @classmethod
    def of(cls, policies: AgentPolicies) -> AdapterFiles:
        """Export every adapter of `policies` (the driver's trainable copy) and keep the folders' bytes."""
        files = {}
        with tempfile.TemporaryDirectory(prefix="mappa-adapter-files-") as tmp:
            for adapter in policies.adapters:
                folder = save_adapter(policies, adapter, Path(tmp) / adapter)
                files[adapter] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return cls(policies.base_name, policies.adapter_of, files)

    def write_adapter(self, adapter: str, folder: str | Path) -> Path:
        """Write one adapter's PEFT folder (what export.save_adapter does for a live model)."""
        if adapter not in self.files:
            raise KeyError(f"no files for adapter {adapter!r} yet (have: {', '.join(self.files) or 'none'}); "
                           "the driver publishes them before the first rollout")
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        for name, data in self.files[adapter].items():
            (target / name).write_bytes(data)
        return target

    @property
    def tokenizer(self) -> Any:
        """The base's tokenizer (light: no weights), for clients that re-tokenise."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from ..models.loading import resolve_model_path

            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.base))
        return self._tokenizer

    def chat_model(self, agent: str, **kwargs: Any) -> Any:
        raise TypeError(
            f"chat_model({agent!r}): this Ray worker holds no model (RayConfig(load_base=False)); build the team on "
            "served models (e.g. VLLMBackend.chat_model), or set load_base=True to generate with a local copy"
        )

    def __repr__(self) -> str:
        return f"AdapterFiles(base={self.base!r}, adapters={self.adapters}, loaded={sorted(self.files)})"


def save_adapter(policies: AgentPolicies | AdapterFiles, adapter: str, folder: str | Path) -> Path:
    """Write one adapter as a standalone PEFT folder at `folder` (peft puts a named adapter in a sub-folder of
    the save directory; this saves to a temporary sibling and moves that sub-folder into place)."""
    if adapter not in policies.adapters:
        raise KeyError(f"unknown adapter {adapter!r} (adapters: {', '.join(policies.adapters)})")
    write = getattr(policies, "write_adapter", None)
    if write is not None:  # AdapterFiles: the folders' bytes, no model to save from
        return write(adapter, folder)
    target = Path(folder)
    tmp = target.with_name(f".{target.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with policies.lock:
        policies.model.save_pretrained(str(tmp), selected_adapters=[adapter])
    saved = tmp / adapter if (tmp / adapter / "adapter_config.json").exists() else tmp
    if target.exists():
        shutil.rmtree(target)
    saved.rename(target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def adapter_rank(folder: str | Path) -> int:
    """The LoRA rank `r` an adapter folder was saved with (vLLM's --max-lora-rank must be at least this)."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return int(config.get("r", 8))
