"""Memory of a 4-agent team: 4 LoRA adapters on one shared base (mappa_graph) vs 4 separate full models (the
MAPPA reference's layout), for serving (weights + a forward per agent) and for training (plus one optimiser step
per agent: full fine-tuning for the separate models, the adapter only for LoRA). Each variant runs in its own
subprocess so peaks do not mix. Goal: adapters / separate peak memory <= 0.3.

    .venv/bin/python benchmarks/multi_lora_memory.py [--agents 4] [--size 20m 80m] [--device cpu|cuda]

Peak memory is the rise of the process's peak RSS over its level after imports (CPU), or torch's peak CUDA
allocation (GPU); "weights" and "train state" are exact byte counts of parameters + buffers and of gradients +
optimiser states. Per-call activations and allocator slack are the same in both layouts, so at 20M
parameters they weigh more than they do at real scale; `--size 80m` shows the trend.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GOAL = 0.3
SIZES = {  # Qwen2 configs built offline, with the tiny tokenizer's vocabulary
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "20m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2),
    "80m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4),
}


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def measure(variant: str, phase: str, agents: int, size: str, device: str) -> dict[str, float]:
    """One variant in this process: build the team, run each agent (and train it), report memory."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from mappa_graph import AgentPolicies
    from mappa_graph.models import LoraSettings
    from mappa_graph.models.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=1024,
                         **SIZES[size])
    torch.set_num_threads(1)  # memory is measured, not speed; one thread keeps a busy machine from crawling
    torch.manual_seed(0)
    torch.ones(8, 8) @ torch.ones(8, 8)  # torch's own lazy allocations belong to the baseline
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_bytes()
    names = [f"agent{i}" for i in range(agents)]
    # serving: one 64-token request per agent at a time; training: a micro-batch of 2 such sequences
    batch = torch.randint(0, config.vocab_size, (1 if phase == "serve" else 2, 64), device=device)

    if variant == "separate":
        models = [Qwen2ForCausalLM(config).to(device) for _ in names]
        weights = sum(_tensor_bytes([*m.parameters(), *m.buffers()]) for m in models)
        state, optimizers = 0, []  # every agent's optimiser lives for the whole run
        for model in models:
            if phase == "serve":
                with torch.no_grad():
                    model(input_ids=batch)
                continue
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # the reference fine-tunes every copy fully
            optimizers.append(opt)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            state += _tensor_bytes([p.grad for p in model.parameters()])
            state += _tensor_bytes([t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()])
    else:
        policies = AgentPolicies(Qwen2ForCausalLM(config).to(device), tokenizer, names, base_name=size,
                                 lora=LoraSettings(r=8, alpha=16))
        policies.model.to(device)
        weights = _tensor_bytes([*policies.model.parameters(), *policies.model.buffers()])
        state, optimizers = 0, []
        for agent in names:
            with policies.active(agent):
                if phase == "serve":
                    with torch.no_grad():
                        policies.model(input_ids=batch)
                    continue
                params = list(policies.adapter_parameters(agent).values())
                opt = torch.optim.AdamW(params, lr=1e-5)  # only this agent's adapter trains
                optimizers.append(opt)
                policies.model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                state += _tensor_bytes([p.grad for p in params])
                state += _tensor_bytes([t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()])
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_bytes() - rss0
    return {"peak": float(peak), "weights": float(weights), "state": float(state)}


def _child(variant: str, phase: str, size: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", variant, phase, "--agents", str(args.agents), "--size", size,
           "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{variant}/{phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--size", nargs="+", choices=sorted(SIZES), default=["20m"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "PHASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.agents, args.size[0], args.device)))
        return 0

    mib = 1024 * 1024
    met = True
    for size in args.size:
        print(f"{args.agents} agents, Qwen2 '{size}' config, {args.device}; each variant in its own process")
        print(f"{'phase':6s} {'variant':28s} {'peak MiB':>9s} {'weights MiB':>12s} {'train state MiB':>16s}")
        for phase in ("serve", "train"):
            rows = {v: _child(v, phase, size, args) for v in ("separate", "adapters")}
            for variant, label in (("separate", f"{args.agents} separate full models"),
                                   ("adapters", f"1 base + {args.agents} LoRA adapters")):
                r = rows[variant]
                print(f"{phase:6s} {label:28s} {r['peak'] / mib:9.1f} {r['weights'] / mib:12.1f} "
                      f"{r['state'] / mib:16.1f}")
            ratio = rows["adapters"]["peak"] / rows["separate"]["peak"]
            resident = {v: rows[v]["weights"] + rows[v]["state"] for v in rows}
            met &= ratio <= GOAL
            print(f"{phase:6s} ratio adapters/separate: peak {ratio:.3f}, weights+train state "
                  f"{resident['adapters'] / resident['separate']:.3f}  (goal <= {GOAL}: "
                  f"{'met' if ratio <= GOAL else 'MISSED'})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
