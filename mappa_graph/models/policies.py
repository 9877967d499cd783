"""AgentPolicies: one base causal LM, one named peft LoRA adapter per agent.

All agents share the base weights (the reference keeps a full model copy per agent; adapters cost a few MB
each). Switching adapters is global state on the peft model, so generation and log-prob passes take a lock:
concurrent episodes on one local model are serialised here rather than mixing adapters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UnknownAgentError

if TYPE_CHECKING:
    import torch

    from .chat import PolicyChatModel


class LoraSettings(BaseModel):
    """LoRA hyper-parameters shared by every agent's adapter."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: list[str] | str = Field("all-linear", description="modules that get adapters")


class Generation(BaseModel):
    """What one sampled completion left behind: the exact tokens and the behaviour log-probs."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    finished: bool
    top_logprobs: list[list[tuple[int, float]]] = []


@contextmanager
def _seeded(seed: int | None, device: Any) -> Iterator[None]:
    """Sample with a fixed seed without disturbing the global torch RNG streams."""
    import torch

    if seed is None:
        yield
        return
    devices = [device.index or 0] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class AgentPolicies:
    """The team's policies: `model` is a peft model holding one adapter per agent on a shared base."""

    def __init__(
        self,
        base_model: Any,
        tokenizer: Any,
        agents: Sequence[str],
        *,
        base_name: str,
        base_path: str | None = None,
        lora: LoraSettings | None = None,
        adapters: dict[str, str] | None = None,
        share: dict[str, str] | None = None,
    ) -> None:
        from peft import LoraConfig, get_peft_model

        agents = list(dict.fromkeys(agents))
        if not agents:
            raise ValueError("AgentPolicies needs at least one agent name")
        share = dict(share or {})
        for agent, owner in share.items():
            if agent not in agents or owner not in agents or owner in share:
                raise ValueError(
                    f"share={{{agent!r}: {owner!r}}} must map an agent to another agent that owns its adapter "
                    f"(agents: {', '.join(agents)})"
                )
        # agent -> the adapter it generates with and trains; shared agents train their owner's adapter
        self.adapter_of = {agent: share.get(agent, agent) for agent in agents}
        self.adapters = [a for a in agents if a not in share]
        self.lora = lora or LoraSettings()
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.base_path = base_path
        self.agents = agents
        config = LoraConfig(
            r=self.lora.r,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=self.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base_model, config, adapter_name=self.adapters[0])
        for adapter in self.adapters[1:]:
            self.model.add_adapter(adapter, config)
        for agent, folder in (adapters or {}).items():
            self.load_adapter(agent, folder)
        self.lock = threading.RLock()
        self.model.eval()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        agents: Sequence[str],
        *,
        lora: LoraSettings | None = None,
        share: dict[str, str] | None = None,
        dtype: str | None = None,
        device: str | None = None,
    ) -> AgentPolicies:
        """Load a base model by hub name, local path, or "tiny" (built offline) and add one adapter per agent
        (`share={"verifier": "solver"}` lets an agent use and train another's adapter)."""
        from .loading import load_base_model

        model, tokenizer, path = load_base_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, agents, base_name=name_or_path, base_path=path, lora=lora, share=share)

    # ---- agents and adapters --------------------------------------------------------------------------
    def check_agent(self, agent: str) -> str:
        if agent not in self.agents:
            raise UnknownAgentError(f"unknown agent {agent!r} (agents: {', '.join(self.agents)})")
        return agent

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextmanager
    def active(self, agent: str) -> Iterator[None]:
        """Route the model through `agent`'s adapter for the body of the block."""
        adapter = self.adapter_of[self.check_agent(agent)]
        with self.lock:
            if self.model.active_adapter != adapter:
                self.model.set_adapter(adapter)
            yield

    @contextmanager
    def base_only(self) -> Iterator[None]:
        """The base model with every adapter off (the KL reference)."""
        with self.lock, self.model.disable_adapter():
            yield

    def adapter_parameters(self, agent: str) -> dict[str, torch.nn.Parameter]:
        """The LoRA tensors of one agent's adapter, by name: what its optimiser steps and what export saves."""
        adapter = self.adapter_of[self.check_agent(agent)]
        marker = f".{adapter}."
        params = {n: p for n, p in self.model.named_parameters() if "lora_" in n and marker in n}
        if not params:
            raise RuntimeError(f"agent {agent!r} has no LoRA parameters; is target_modules right for this model?")
        return params

    def load_adapter(self, agent: str, folder: str | Path) -> None:
        """Replace an agent's adapter weights with those saved in a PEFT adapter folder."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = self.adapter_of[self.check_agent(agent)]
        weights = Path(folder) / "adapter_model.safetensors"
        if not weights.exists():
            raise FileNotFoundError(f"no adapter weights at {weights} (expected a PEFT adapter folder)")
        with self.lock:
            set_peft_model_state_dict(self.model, load_file(str(weights)), adapter_name=adapter)

    def chat_model(self, agent: str, **kwargs: Any) -> PolicyChatModel:
        """A langchain-core chat model whose calls go to `agent`'s adapter (use it inside that agent's node)."""
        from .chat import PolicyChatModel

        self.check_agent(agent)
        return PolicyChatModel(policies=self, agent=agent, **kwargs)

    # ---- tokens -----------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat-template the messages (HF format) into prompt token ids, generation prompt included."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [eos] if eos is not None else []

    def generate(
        self,
        agent: str,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        do_sample: bool = True,
        seed: int | None = None,
    ) -> Generation:
        """Sample one completion under `agent`'s adapter, with the log-prob of each sampled token under the
        distribution it was sampled from (temperature applied, no top-k/top-p: the behaviour policy the
        importance ratio needs)."""
        return self.sample(self.adapter_of[self.check_agent(agent)], prompt_ids, max_new_tokens=max_new_tokens,
                           temperature=temperature, do_sample=do_sample, seed=seed)

    def sample(
        self,
        adapter: str | None,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        do_sample: bool = True,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> Generation:
        """`generate` by peft adapter name (any loaded adapter, not only an agent's; None: the base with
        adapters off), optionally with the `top_logprobs` most likely tokens at each step (what an
        OpenAI-compatible server reports)."""
        import torch

        ids = torch.tensor([list(prompt_ids)], device=self.device)
        with self.lock:
            if adapter is None:
                route = self.model.disable_adapter()
            else:
                if self.model.active_adapter != adapter:
                    self.model.set_adapter(adapter)
                route = nullcontext()
            with route, torch.no_grad(), _seeded(seed, self.device):
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=do_sample,
                    temperature=temperature if do_sample else None,
                    top_k=None,
                    top_p=None,
                    eos_token_id=self.stop_token_ids or None,
                    pad_token_id=self.tokenizer.pad_token_id,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
        new = out.sequences[0, ids.shape[1]:]
        logp = torch.log_softmax(torch.stack(out.scores, dim=0)[:, 0, :].float(), dim=-1)  # (T, V)
        chosen = logp.gather(-1, new[: logp.shape[0], None])[:, 0]
        tokens = new.tolist()
        stop = set(self.stop_token_ids)
        finished = False
        for i, tok in enumerate(tokens):
            if tok in stop:
                tokens, finished = tokens[: i + 1], True
                break
        tops: list[list[tuple[int, float]]] = []
        if top_logprobs:
            for t in range(len(tokens)):
                values, indices = logp[t].topk(top_logprobs)
                tops.append(list(zip(indices.tolist(), values.tolist())))
        return Generation(
            prompt_token_ids=list(prompt_ids),
            output_token_ids=tokens,
            output_logprobs=chosen[: len(tokens)].tolist(),
            finished=finished,
            top_logprobs=tops,
        )

    def token_logprobs(
        self,
        agent: str | None,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        *,
        pack: bool = True,
        max_tokens_per_row: int | None = None,
    ) -> list[torch.Tensor]:
        """Log-prob of each output token given its prompt; gradients flow into `agent`'s adapter (agent=None:
        the base with adapters off, no grad). Returns one (T_i,) tensor per sample.

        pack=True (the default) concatenates the samples into rows of at most `max_tokens_per_row` tokens
        (first-fit decreasing; a longer sample gets a row of its own), each sequence isolated by position ids
        that restart at 0, and projects only the output positions onto the vocabulary: no prompt position
        reaches the LM head. The default capacity is the longest sample, so rows are as wide as the padded
        batch would be, but fewer and nearly full: sdpa and eager attention cost (W, W) per row whatever the
        mask. Packing needs sdpa or eager attention and a transformers whose masking_utils builds the packed
        mask and whose LM head takes a boolean logits_to_keep (5.x); otherwise, and with pack=False, it is one
        right-padded forward for the whole batch with full logits. Both give the same log-probs to float
        rounding (tests/test_packing.py)."""
        import torch

        if len(prompts) != len(outputs):
            raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"sample {i} has an empty prompt: its first output token has nothing to condition on")
        if max_tokens_per_row is not None and max_tokens_per_row < 1:
            raise ValueError(f"max_tokens_per_row must be >= 1 or None (the longest sample), got {max_tokens_per_row}")
        ctx = self.base_only() if agent is None else self.active(agent)
        grad = torch.no_grad() if agent is None else torch.enable_grad()
        if pack and self._can_pack():
            with ctx, grad:
                return self._packed_logprobs(prompts, outputs, max_tokens_per_row)
        seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long, device=self.device)  # (B, L)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with ctx, grad:
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # (B, L, V)
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, L-1)
        result = []
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            start = len(p) - 1  # logits at position t predict token t+1
            result.append(logp[i, start : start + len(o)])
        return result

    def _can_pack(self) -> bool:
        try:
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
            from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
        except ImportError:  # older transformers would attend across the packed sequences, silently
            return False
        # flash-attention reads packed position ids only in a batch of one row (_is_packed_sequence), so
        # several rows would mix sequences there; custom kernels skip the mask altogether
        return getattr(self.model.config, "_attn_implementation", None) in ("sdpa", "eager")

    def _packed_logprobs(
        self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], max_tokens_per_row: int | None
    ) -> list[torch.Tensor]:
        import torch

        lengths = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        rows = _first_fit_decreasing(lengths, max_tokens_per_row or max(lengths))
        width = max(sum(lengths[i] for i in row) for row in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (R, W)
        # Position ids restarting at 0 mark the sequence boundaries: with no 2D attention mask and no cache,
        # transformers (masking_utils.find_packed_sequence_indices) turns them into a block-diagonal causal
        # mask for sdpa/eager. The row's tail padding is one more such block, attended by nothing else.
        positions = torch.zeros((len(rows), width), dtype=torch.long)  # (R, W)
        keep = torch.zeros((len(rows), width), dtype=torch.bool)  # positions whose logits predict an output
        order = []  # samples in the row-major order of their kept positions
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                p, o = prompts[i], outputs[i]
                ids[r, offset : offset + lengths[i]] = torch.tensor([*p, *o])
                positions[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
                keep[r, offset + len(p) - 1 : offset + lengths[i] - 1] = True  # logits at t predict token t+1
                order.append(i)
                offset += lengths[i]
            positions[r, offset:] = torch.arange(width - offset)
        targets = ids[:, 1:][keep[:, :-1]]  # (N,) the output tokens, in kept order
        ids, positions, keep = ids.to(self.device), positions.to(self.device), keep.to(self.device)
        # A 2D boolean logits_to_keep projects only the kept positions: (N, V), flattened row-major
        logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(self.device)[:, None])[:, 0]  # (N,)
        pieces = logp.split([len(outputs[i]) for i in order])
        by_sample = dict(zip(order, pieces))
        return [by_sample[i] for i in range(len(order))]


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin sample indices into rows of at most `capacity` tokens, longest first; a sample longer than the
    capacity gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows
