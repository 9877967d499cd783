"""A tiny causal LM built offline: the CPU default and the model every test uses.

No hub is reachable here, so the project makes its own: a byte-level BPE tokenizer trained with `tokenizers`
in seconds, a ChatML chat template that renders tool calls the way Qwen/Hermes models do, and a ~1M-parameter
Qwen2 model from config. It is cached as an ordinary Hugging Face folder, so it loads through the same
`AutoModelForCausalLM.from_pretrained` code as a real model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .quiet import quiet_transformers

TINY_NAME = "tiny"
TINY_VERSION = "v2"
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"

# ChatML, plus tool schemas in the system turn and <tool_call> blocks in assistant turns (Hermes/Qwen style).
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string else '' }}"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a of to and in is for on with as by that this it be are from at or an what which how many mean median "
    "sum count max min std average total number value column row table data frame df print import pandas pd "
    "numpy np round correlation between filter where greater less than equal group by sort top rows answer "
    "plan step code run result error output analyst coder planner reporter solver verifier check final "
    "question task tool call python format name calculate compute find missing values unique rate price year "
    "age fare sex class survived date close open volume high low return percent ratio two decimal places "
    "correct wrong yes no true false add subtract multiply divide plus minus times equals boxed "
    # instruction and tool-schema vocabulary, so prompts of agent teams tokenize into words, not letters
    "You are team data-analysis Read write short numbered plan: which columns use computation answers loaded as "
    "DataFrame Call with prints exactly numbers asks If last failed, fix again From output, final requested "
    "format, e.g. rounding Question: Columns: Plan: Code output: Answer format: Constraints: Calculate Pearson "
    "How rows have Use Compute corr head int() round() mean() sum() function description parameters "
    "properties type string object required arguments code title Run get printed imported np, plt "
    "solution problem verdict VERDICT: incorrect reason expression Write Compute. integer rounded decimals "
    "@correlation[r_value] @count[value] @mean_ value] df[' '] .mean() .corr( .sum()) > ( ) , . : ; ? !"
).split()
_SNIPPETS = [
    "print(df['{c}'].mean())", "print(round(df['{c}'].median(), 2))", "print(len(df[df['{c}'] > {n}]))",
    "print(df['{c}'].corr(df['{d}']))", "print(df.shape)", "print(df['{c}'].isna().sum())",
    "@answer[{n}]", "@mean_{c}[{n}.{m}]", "\\boxed{{{n}}}", "{n} + {m} = {s}", "{n} * {m} = {p}",
    '<tool_call>{{"name": "python", "arguments": {{"code": "print({n})"}}}}</tool_call>',
]


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        snippet = rng.choice(_SNIPPETS).format(
            c=rng.choice(_WORDS), d=rng.choice(_WORDS), n=a, m=b, s=a + b, p=a * b
        )
        role = rng.choice(["system", "user", "assistant", "tool"])
        lines.append(f"{IM_START}{role}\n{words.capitalize()}. {snippet}{IM_END}\n")
    lines += [str(i) for i in range(1000)]
    return lines


def cache_root() -> Path:
    """Where built models live: $MAPPA_CACHE_DIR, else ~/.cache/mappa_graph."""
    return Path(os.environ.get("MAPPA_CACHE_DIR", Path.home() / ".cache" / "mappa_graph"))


@contextmanager
def building(target: Path) -> Iterator[Path]:
    """A scratch folder beside `target` that replaces it only when the block completes: a build killed halfway
    leaves the cache as it was (never a half-written model that looks finished), and concurrent builds of the
    same target never write into each other's folders."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
    try:
        yield work
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def build_tiny_model(cache_dir: str | Path | None = None, *, seed: int = 0, force: bool = False) -> Path:
    """Build (once) and return the folder of the tiny model and tokenizer. Deterministic for a given seed."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"tiny-{TINY_VERSION}-seed{seed}"
    if (target / "mappa_tiny.json").exists() and not force:
        return target
    with building(target) as work:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=4096,
            special_tokens=[PAD, IM_START, IM_END],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(seed=seed), trainer)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None, unk_token=None
        )
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(work)

        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
            pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
            bos_token_id=None,
        )
        model = Qwen2ForCausalLM(config)
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        with quiet_transformers():
            model.save_pretrained(work)
        n_params = sum(p.numel() for p in model.parameters())
        (work / "mappa_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed, "parameters": n_params}))
    return target
