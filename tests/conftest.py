"""Shared fixtures. Tests never reach the network: hub access is switched off and any socket connection
to a non-loopback address fails loudly (a loopback server is how HTTP paths are tested)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MAPPA_CACHE_DIR", str(ROOT / ".mappa_cache"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_real_connect = socket.socket.connect


def _guarded_connect(self: socket.socket, address):  # type: ignore[no-untyped-def]
    host = address[0] if isinstance(address, tuple) else address
    if self.family in (socket.AF_INET, socket.AF_INET6) and host not in _LOOPBACK:
        raise RuntimeError(f"test tried to reach the network ({address!r}); tests may only use loopback servers")
    return _real_connect(self, address)


socket.socket.connect = _guarded_connect  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from mappa_graph.models.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def dabench_dir() -> Path:
    from tools.dabench import dabench_dir as shipped_dabench_dir

    return shipped_dabench_dir()  # the copy in examples/data: a missing file is a failure, not a skip


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small to split: on a busy 2-core machine two intra-op threads make an
    8-token generation ~70x slower (barrier waits). Modules that generate a lot use it; restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
