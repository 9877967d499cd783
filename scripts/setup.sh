#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv, the CPU torch wheel first, then the project with its dev and ray extras.
# torch is pinned here (not in pyproject) so no dependency can pull a newer, multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,ray]"
# The reference teams (agents/) and tools (tools/) live beside the library, not in its wheel: put this checkout
# on the venv's path so examples, benchmarks and `mappa train agents.x:f` import them without sys.path edits.
.venv/bin/python - <<'PY'
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
(site / "mappa_graph_checkout.pth").write_text(str(pathlib.Path.cwd().resolve()) + "\n")
PY
.venv/bin/python -c "import torch, mappa_graph, agents, tools; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
