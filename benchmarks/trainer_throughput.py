"""Update-step throughput: our per-adapter update (`Trainer._update_adapter`: token-level PPO clip over
micro-batches, packed log-prob pass) vs TRL's GRPOTrainer loss, on the same warm-started tiny model with the
same LoRA adapters, the same samples and the same optimiser steps. Goal: ours / TRL tokens/s >= 1.5.

    .venv/bin/python benchmarks/trainer_throughput.py [--samples 64] [--reps 7] [--threads 1]

TRL is not a dependency of the project: install it beside the venv, leaving torch and transformers alone,
    .venv/bin/pip install --target .bench_site --no-deps trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 \\
        dill==0.4.1 multiprocess==0.70.19
(trl 1.16 asks for transformers>=4.56.2, so it runs on the project's 5.24). TRL's side calls TRL's own code:
a GRPOTrainer is built offline around our peft model, and its `_compute_loss` (which runs
`_get_per_token_logps_and_entropies` through TRL's fused LM head) is called on inputs laid out as
`_generate_and_score_completions` lays them out: prompts left-padded and completions right-padded to the
longest of the agent's generation batch, then split into `steps_per_generation` micro-batches by TRL's
`split_tensor_dict`. loss_type "dapo" (TRL's default) normalises by the batch's completion tokens, which is our
token-level mean, so both sides optimise the same number; the script checks that before timing.

Each "update" is one optimiser step per adapter over all its samples (micro-batches accumulate gradients),
grad-norm clip 1.0, AdamW. Only completion tokens (the ones that carry loss) are counted. Variants run
interleaved, the order rotating each repetition, after one warm-up each; medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
BENCH_SITE = ROOT / ".bench_site"
if BENCH_SITE.is_dir():
    sys.path.append(str(BENCH_SITE))  # appended: the venv's torch and transformers always win

import torch  # noqa: E402

from agents.arithmetic import warm_policies  # noqa: E402
from mappa_graph import (
    AgentPolicies,  # noqa: E402
    TrainConfig,  # noqa: E402
    Trainer,  # noqa: E402
)
from mappa_graph.models.policies import _first_fit_decreasing  # noqa: E402
from mappa_graph.training.credit import Sample  # noqa: E402
from mappa_graph.training.loss import clipped_surrogate, flatten_tokens  # noqa: E402
from mappa_graph.training.optim import AgentOptimizers  # noqa: E402

GOAL = 1.5
INSTALL = (".venv/bin/pip install --target .bench_site --no-deps trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 "
           "dill==0.4.1 multiprocess==0.70.19")


def make_samples(policies: AgentPolicies, n: int, *, prompt_len: tuple[int, int], completion_len: tuple[int, int],
                 seed: int) -> list[Sample]:
    """n samples alternating between the agents, random tokens, lengths uniform in the given ranges; behaviour
    log-probs are the current policy's plus noise, so ratios leave 1 and some tokens clip."""
    rng = random.Random(seed)
    vocab = len(policies.tokenizer)
    special = set(policies.tokenizer.all_special_ids)
    tokens = [t for t in range(vocab) if t not in special]
    samples = []
    for i in range(n):
        agent = policies.adapters[i % len(policies.adapters)]
        samples.append(Sample(
            action_id=f"a{i}", episode_id=f"e{i // 4}", agent=agent,
            prompt_token_ids=[rng.choice(tokens) for _ in range(rng.randint(*prompt_len))],
            output_token_ids=[rng.choice(tokens) for _ in range(rng.randint(*completion_len))],
            reward=0.0, advantage=rng.gauss(0.0, 1.0),
        ))
    for agent in policies.adapters:
        mine = [s for s in samples if s.agent == agent]
        now = policies.token_logprobs(agent, [s.prompt_token_ids for s in mine], [s.output_token_ids for s in mine],
                                      pack=False)
        for s, lp in zip(mine, now):
            s.behaviour_logprobs = [float(x) + rng.gauss(0.0, 0.1) for x in lp.detach()]
    return samples


class _Padded:
    """Our policies with the packed pass switched off, to show what packing alone buys."""

    def __init__(self, policies: AgentPolicies) -> None:
        self._policies = policies

    def __getattr__(self, name: str):
        return getattr(self._policies, name)

    def token_logprobs(self, agent, prompts, outputs, **kwargs):
        return self._policies.token_logprobs(agent, prompts, outputs, pack=False, **kwargs)


class _RowTokens(_Padded):
    """Our policies with another packed row capacity than token_logprobs' default."""

    def __init__(self, policies: AgentPolicies, row_tokens: int) -> None:
        super().__init__(policies)
        self._row_tokens = row_tokens

    def token_logprobs(self, agent, prompts, outputs, **kwargs):
        return self._policies.token_logprobs(agent, prompts, outputs, max_tokens_per_row=self._row_tokens, **kwargs)


def ours_update(policies, optimizers: AgentOptimizers, config: TrainConfig, by_adapter: dict[str, list[Sample]]) -> None:
    """The trainer's own per-adapter step, called unbound on a view holding just what it reads."""
    view = SimpleNamespace(config=config, optimizers=optimizers, policies=policies, iteration=0)
    for adapter, group in by_adapter.items():
        Trainer._update_adapter(view, adapter, group)


def build_grpo_trainer(policies: AgentPolicies, *, micro: int, steps: int, max_completion: int, out: str):
    from datasets import IterableDataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out, report_to="none", use_cpu=True, save_strategy="no", max_steps=1,
        per_device_train_batch_size=micro, gradient_accumulation_steps=steps, steps_per_generation=steps,
        num_generations=micro, max_completion_length=max_completion,
        bf16=False, gradient_checkpointing=False,  # TRL's defaults are True; ours runs fp32, no checkpointing
        loss_type="dapo", epsilon=0.2, beta=0.0,
    )
    # The loss never reads the dataset, but the trainer wants one. An IterableDataset because datasets 5.2's
    # fingerprinting of an in-memory Dataset fails to pickle pyarrow 24-26 tables with its dill Pickler here.
    data = IterableDataset.from_generator(lambda: iter([{"prompt": "x"}] * (micro * steps)))
    trainer = GRPOTrainer(model=policies.model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=data, processing_class=policies.tokenizer)
    if trainer.model is not policies.model:
        raise RuntimeError("GRPOTrainer wrapped the model: TRL and ours would not train the same weights")
    trainer.current_gradient_accumulation_steps = steps  # set by transformers' training loop, which we skip
    return trainer


def grpo_generation_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """The batch as GRPOTrainer._generate_and_score_completions builds it (no vLLM, no reference model)."""
    from trl.trainer.utils import pad

    prompt = [torch.tensor(s.prompt_token_ids) for s in samples]
    completion = [torch.tensor(s.output_token_ids) for s in samples]
    completion_mask = pad([torch.ones_like(c) for c in completion], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompt, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompt], padding_value=0, padding_side="left"),
        "completion_ids": pad(completion, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.advantage for s in samples]),
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": pad([torch.tensor(s.behaviour_logprobs) for s in samples], padding_value=0.0,
                                   padding_side="right"),
    }


def trl_update(trainer, policies: AgentPolicies, optimizers: AgentOptimizers, batches: dict[str, list[dict]]) -> None:
    for adapter, micro_batches in batches.items():
        opt = optimizers.optimizers[adapter]
        params = list(policies.adapter_parameters(adapter).values())
        opt.zero_grad(set_to_none=True)
        with policies.active(adapter):
            for inputs in micro_batches:
                trainer._compute_loss(policies.model, inputs).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def check_same_objective(trainer, policies, by_adapter, batches, config: TrainConfig) -> float:
    """Largest |our loss - TRL's loss| over all micro-batches, before any step."""
    worst = 0.0
    with torch.no_grad():
        for adapter, group in by_adapter.items():
            total = sum(len(s.output_token_ids) for s in group)
            with policies.active(adapter):
                for k, inputs in enumerate(batches[adapter]):
                    chunk = group[k * config.micro_batch_size : (k + 1) * config.micro_batch_size]
                    new = policies.token_logprobs(adapter, [s.prompt_token_ids for s in chunk],
                                                  [s.output_token_ids for s in chunk])
                    logp, adv = flatten_tokens(new, [s.advantage for s in chunk])
                    old, _ = flatten_tokens([torch.tensor(s.behaviour_logprobs) for s in chunk], [0.0] * len(chunk))
                    ours = float(clipped_surrogate(logp, old, adv, config.clip_eps)[0].sum() / total)
                    worst = max(worst, abs(ours - float(trainer._compute_loss(policies.model, inputs))))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="samples per update, alternating two agents")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per forward, both sides")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(20, 300))
    parser.add_argument("--completion-len", type=int, nargs=2, default=(4, 64))
    parser.add_argument("--row-tokens", type=int, nargs="*", default=[0],
                        help="packed row capacities to time; 0: token_logprobs' default (the longest sample); "
                             "the first is 'ours'")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of each variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core machine: 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    try:
        import trl
    except ImportError:
        sys.exit(f"TRL is not installed. This benchmark loads it from {BENCH_SITE}; create that folder with\n"
                 f"    cd {ROOT} && {INSTALL}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    with contextlib.redirect_stderr(io.StringIO()):  # the warm start's and model loading's progress bars
        policies = warm_policies()
    agents = policies.adapters
    if args.samples % (len(agents) * args.micro_batch):
        sys.exit(f"--samples {args.samples} must be a multiple of {len(agents)} agents x --micro-batch "
                 f"{args.micro_batch}, so every adapter has whole micro-batches on both sides")
    samples = make_samples(policies, args.samples, prompt_len=tuple(args.prompt_len),
                           completion_len=tuple(args.completion_len), seed=args.seed)
    by_adapter = {a: [s for s in samples if s.agent == a] for a in agents}
    steps = len(by_adapter[agents[0]]) // args.micro_batch
    config = TrainConfig(micro_batch_size=args.micro_batch, clip_eps=0.2, max_grad_norm=1.0, kl_coef=0.0)
    optimizers = AgentOptimizers(policies, lr=config.lr)

    from trl.trainer.utils import split_tensor_dict

    with tempfile.TemporaryDirectory() as out:
        trainer = build_grpo_trainer(policies, micro=args.micro_batch, steps=steps,
                                     max_completion=args.completion_len[1], out=out)
        pad_id = policies.tokenizer.pad_token_id
        batches = {a: split_tensor_dict(grpo_generation_batch(g, pad_id), steps) for a, g in by_adapter.items()}
        policies.model.train()  # both sides train; the tiny model and the adapters have no dropout
        gap = check_same_objective(trainer, policies, by_adapter, batches, config)

        variants = {}
        for cap in args.row_tokens:
            view = _RowTokens(policies, cap) if cap else policies  # 0: the call the trainer makes
            variants[f"mappa packed (rows <= {cap or 'longest'})"] = (
                lambda view=view: ours_update(view, optimizers, config, by_adapter))
        variants["mappa padded (pack=False)"] = lambda: ours_update(_Padded(policies), optimizers, config, by_adapter)
        variants["TRL GRPOTrainer._compute_loss"] = lambda: trl_update(trainer, policies, optimizers, batches)
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():  # warm-up, not timed
            run()
        names = list(variants)
        for rep in range(args.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                variants[name]()
                seconds[name].append(time.perf_counter() - start)

    completion_tokens = sum(len(s.output_token_ids) for s in samples)
    real_tokens = sum(len(s.prompt_token_ids) + len(s.output_token_ids) for s in samples)
    trl_tokens = sum(int(b["prompt_ids"].numel() + b["completion_ids"].numel()) for bs in batches.values() for b in bs)
    rows, row_tokens = 0, 0
    for group in by_adapter.values():
        for k in range(0, len(group), args.micro_batch):
            lengths = [len(s.prompt_token_ids) + len(s.output_token_ids) for s in group[k : k + args.micro_batch]]
            packed = _first_fit_decreasing(lengths, args.row_tokens[0] or max(lengths))
            rows += len(packed)
            row_tokens += len(packed) * max(sum(lengths[i] for i in row) for row in packed)
    print(f"tiny Qwen2 ({sum(p.numel() for p in policies.model.get_base_model().parameters()) / 1e6:.2f}M params incl. "
          f"LoRA r={policies.lora.r}), adapters {', '.join(agents)}; trl {trl.__version__}, torch {torch.__version__}, "
          f"{args.threads} thread(s)")
    print(f"{args.samples} samples ({len(agents)} agents), prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"completions {args.completion_len[0]}-{args.completion_len[1]}, micro-batch {args.micro_batch}, "
          f"{steps} micro-batches per adapter, one AdamW step per adapter per update, seed {args.seed}")
    print(f"tokens per update: {completion_tokens} completion (counted), {real_tokens} prompt+completion; forward "
          f"positions: TRL padded {trl_tokens} ({real_tokens / trl_tokens:.0%} real), ours packed {row_tokens} in "
          f"{rows} rows ({real_tokens / row_tokens:.0%} real)")
    print(f"same objective: max |ours - TRL| loss per micro-batch before any step = {gap:.2e}")
    print(f"TRL side: GRPOTrainer built offline around our peft model; its own _compute_loss called "
          f"(loss_type=dapo, fp32, no gradient checkpointing); {args.reps} interleaved reps after 1 warm-up, medians")
    trl_rate = completion_tokens / statistics.median(seconds["TRL GRPOTrainer._compute_loss"])
    for name, times in seconds.items():
        median = statistics.median(times)
        rate = completion_tokens / median
        print(f"  {name:34s} {1000 * median:8.1f} ms/update  {rate:9.0f} tokens/s  ratio vs TRL {rate / trl_rate:5.2f}"
              f"   (min {1000 * min(times):.1f}, max {1000 * max(times):.1f} ms)")
    ours = completion_tokens / statistics.median(seconds[names[0]])
    print(f"ours / TRL = {ours / trl_rate:.2f} (goal >= {GOAL}): {'met' if ours / trl_rate >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
