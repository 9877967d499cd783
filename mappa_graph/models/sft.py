"""Supervised warm start: teach a base model the team's formats before RL, on synthetic traces.

A policy-gradient run needs a policy that sometimes succeeds. Real runs start from an instruction-tuned
model; the offline tiny model starts from random weights, so the learning demos first fine-tune the whole
base on synthetic (prompt, reply) pairs of every agent, then train one LoRA adapter per agent with RL. The
result is cached by a hash of the data and settings, so tests and demos pay for it once.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel
from tqdm.auto import tqdm

from .loading import load_base_model, model_identity
from .quiet import quiet_transformers
from .tiny import building, cache_root


class SFTExample(BaseModel):
    """One supervised pair: chat messages (HF format) and the assistant reply to learn."""

    messages: list[dict]
    reply: str
    tools: list[dict] | None = None


def warm_start_key(base: str, examples: Sequence[SFTExample], *, steps: int, batch_size: int, lr: float,
                   seed: int, threads: int) -> str:
    """The cache key of a warm start: everything that changes its result, the base's build version included, and
    torch's intra-op thread count, which splits the reductions differently (the tests' arithmetic warm start
    built on 1 thread ended at loss 0.385 against 0.367 on 2, and was served to callers on 2)."""
    settings = [model_identity(base), [e.model_dump() for e in examples], steps, batch_size, lr, seed, threads]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def warm_start(
    base: str,
    examples: Sequence[SFTExample],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Full fine-tune of `base` on the examples (loss on reply tokens only); returns the saved folder."""
    import torch

    key = warm_start_key(base, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         threads=torch.get_num_threads())
    target = Path(cache_dir) if cache_dir is not None else cache_root() / f"warm-{key}"
    if (target / "warm_start.json").exists():
        return target
    model, tokenizer, _ = load_base_model(base)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    encoded = []
    eos = tokenizer.eos_token or ""
    for ex in examples:
        prompt_text = tokenizer.apply_chat_template(ex.messages, tools=ex.tools, tokenize=False,
                                                    add_generation_prompt=True)
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        reply = tokenizer(ex.reply + eos, add_special_tokens=False)["input_ids"]
        encoded.append((prompt, reply))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    model.train()
    pad = tokenizer.pad_token_id or 0
    losses = []
    # disable=None: a live bar on a terminal only; a log (CI, `> file`) gets no carriage-return redraws
    for step in tqdm(range(steps), desc="warm start", disable=None if progress else True, leave=False):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        loss = _batch_loss(model, batch, pad)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    with building(target) as work:
        with quiet_transformers():
            model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / "warm_start.json").write_text(json.dumps({"base": base, "steps": steps, "final_loss": losses[-1]}))
    return target


def _batch_loss(model, batch: list[tuple[list[int], list[int]]], pad: int, *, slack: float = 1.25):
    """The batch's mean reply-token loss, computed over groups of rows of similar length: a padded batch is
    as wide as its longest row, and agents' prompts differ (a coder's carries the tool schemas, three times a
    planner's), so one padded forward pass would spend most of its work on padding. The rows stay the same
    random draw and the loss is the same token-weighted mean, so training follows the same path, cheaper.
    A group grows while its longest row is at most `slack` times its shortest."""
    rows = sorted(batch, key=lambda row: len(row[0]) + len(row[1]))
    groups: list[list[tuple[list[int], list[int]]]] = []
    for row in rows:
        if groups and len(row[0]) + len(row[1]) <= slack * (len(groups[-1][0][0]) + len(groups[-1][0][1])):
            groups[-1].append(row)
        else:
            groups.append([row])
    tokens = sum(len(r) for _, r in batch)
    return sum(_reply_loss(model, group, pad, reduction="sum") for group in groups) / tokens


def _reply_loss(model, batch: list[tuple[list[int], list[int]]], pad: int, *, reduction: str = "mean"):
    """Mean cross-entropy over the reply tokens only. Rows are left-padded so every reply ends at the last
    position, and the LM head runs over the last `tail` positions only (`logits_to_keep`): prompts are most of
    each sequence, and a small model's step is mostly the vocabulary projection over them."""
    import torch

    width = max(len(p) + len(r) for p, r in batch)
    tail = max(len(r) for _, r in batch) + 1  # +1: the last prompt position predicts the first reply token
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(batch), tail - 1), -100, dtype=torch.long)
    for i, (p, r) in enumerate(batch):
        seq = p + r
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
        labels[i, tail - 1 - len(r) :] = torch.tensor(r)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count from each row's first token
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=tail).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100, reduction=reduction)
