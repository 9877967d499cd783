"""Checkpoints a killed run resumes from: adapters, optimiser states, RNG states, iteration and config.

Each checkpoint is written to a temporary folder, fsynced and renamed into place, and only then named in
`latest`; a SIGKILL at any moment leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies
    from .optim import AgentOptimizers

LATEST = "latest"
_CHECKPOINT_NAME = re.compile(r"iter-\d+")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_globals() -> list[Any]:
    """What `np.random.get_state()` pickles as, for torch.load's weights-only unpickler."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    iteration: int,
    policies: AgentPolicies,
    optimizers: AgentOptimizers,
    *,
    config: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    import torch

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter-{iteration:06d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    adapters = {a: {n: p.detach().cpu().clone() for n, p in policies.adapter_parameters(a).items()} for a in policies.adapters}
    payload = {
        "iteration": iteration,
        "adapters": adapters,
        "optimizers": optimizers.state_dict(),
        "rng": rng_state(),
        "trainer": trainer_state,
    }
    with (tmp / "state.pt").open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    _write_atomic(tmp / "config.json", json.dumps(config, indent=2))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, name)
    for old in sorted(p for p in root.glob("iter-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not _CHECKPOINT_NAME.fullmatch(name):  # a pointer that leads out of the run folder loads nothing
        raise ValueError(f"checkpoint pointer {pointer} names {name!r}, not a checkpoint of this folder "
                         "(iter-N); it was not written by mappa_graph: fix or delete it")
    path = root / name
    if not (path / "state.pt").exists():
        raise FileNotFoundError(f"checkpoint pointer {pointer} names {path}, which is missing or incomplete")
    return path


def load_checkpoint(path: str | Path, policies: AgentPolicies, optimizers: AgentOptimizers) -> dict[str, Any]:
    """Restore adapters, optimisers and RNG; returns the saved payload (iteration, trainer state)."""
    import torch

    state = Path(path) / "state.pt"
    try:  # tensors, numbers, strings and the numpy RNG state's array, nothing that runs code as it loads
        with torch.serialization.safe_globals(_numpy_globals()):
            payload = torch.load(state, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"checkpoint {state} holds more than tensors and plain values, so it was not loaded "
                         f"(unpickling it could run any code): it was not written by mappa_graph, or was "
                         "changed since") from error
    missing = set(policies.adapters) - set(payload["adapters"])
    if missing:
        raise ValueError(f"checkpoint {path} has no adapter for {', '.join(sorted(missing))}; was it another team?")
    with torch.no_grad(), policies.lock:
        for adapter, tensors in payload["adapters"].items():
            params = policies.adapter_parameters(adapter)
            if set(params) != set(tensors):
                raise ValueError(f"checkpoint {path}: adapter {adapter!r} has other tensors (LoRA settings changed?)")
            for n, t in tensors.items():
                params[n].copy_(t)
    optimizers.load_state_dict(payload["optimizers"])
    set_rng_state(payload["rng"])
    return payload
