"""AgentPolicies: one base causal LM, one named peft LoRA adapter per agent.

All agents share the base weights (the reference keeps a full model copy per agent; adapters cost a few MB
each). Switching adapters is global state on the peft model, so training and log-prob passes take a lock.
Sampling routes each row to its adapter inside one forward (models/engine.py), so with `start_engine`
concurrent episodes decode together rather than one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UnknownAgentError
from .quiet import quiet_transformers

if TYPE_CHECKING:
    import torch

    from .chat import PolicyChatModel
    from .engine import RolloutEngine


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
        with quiet_transformers():  # peft calls a property transformers 5 deprecated
            self.model = get_peft_model(base_model, config, adapter_name=self.adapters[0])
            for adapter in self.adapters[1:]:
                self.model.add_adapter(adapter, config)
        for agent, folder in (adapters or {}).items():
            self.load_adapter(agent, folder)
        self.lock = threading.RLock()
        self._engine: RolloutEngine | None = None
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
        params = {n: p for n, p in self.model.named_parameters() if _lora_adapter_of(n) == adapter}
        if not params:
            raise RuntimeError(f"agent {agent!r} has no LoRA parameters; is target_modules right for this model?")
        return params

    def load_adapter(self, agent: str, folder: str | Path) -> None:
        """Replace an agent's adapter weights with those saved in a PEFT adapter folder."""
        import torch
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = self.adapter_of[self.check_agent(agent)]
        weights = Path(folder) / "adapter_model.safetensors"
        if not weights.exists():
            raise FileNotFoundError(f"no adapter weights at {weights} (expected a PEFT adapter folder)")
        state = load_file(str(weights))
        broken = [name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
        if broken:
            raise ValueError(f"adapter {folder} has weights that are not finite ({', '.join(broken[:3])}): not loaded")
        params = self.adapter_parameters(agent)
        with self.lock, torch.no_grad():
            kept = {name: p.detach().clone() for name, p in params.items()}
            loaded = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
            # peft loads what matches and skips the rest: an adapter of other target modules (as many tensors)
            # loaded nothing and served the base model as this agent's
            missing = sorted(set(loaded.missing_keys) & set(params))
            if loaded.unexpected_keys or missing:
                for name, value in kept.items():
                    params[name].copy_(value)
                raise ValueError(
                    f"adapter {folder} does not fit agent {agent!r}'s LoRA (other target modules, or another base): "
                    f"{len(loaded.unexpected_keys)} of its tensors have no place here "
                    f"({', '.join(list(loaded.unexpected_keys)[:2])}) and {len(missing)} of the agent's were not in "
                    "it; nothing was changed")

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
        distribution it was sampled from (temperature only: the behaviour policy the importance ratio needs)."""
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
        OpenAI-compatible server reports).

        The draw is softmax(logits / temperature) and nothing else: the model's generation_config (top-k,
        top-p, repetition penalty...) is not applied, because the loss recomputes log-probs with that same
        temperature only (`engine.behaviour_logprobs`). With an engine running (`start_engine`) the call joins
        its continuous batch; otherwise it decodes alone, through the same code."""
        from .engine import SampleRequest, decode

        request = SampleRequest(adapter=adapter, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                temperature=temperature, do_sample=do_sample, seed=seed, top_logprobs=top_logprobs)
        engine = self._engine
        # A caller inside `with policies.active(...)` holds the lock each engine step needs: waiting on the
        # engine would deadlock, so such a call decodes here (RLock._is_owned: held by this thread).
        if engine is not None and engine.alive and not self.lock._is_owned():  # type: ignore[attr-defined]
            return engine.sample(request)
        return decode(self, [request])[0]

    # ---- the batched rollout engine ------------------------------------------------------------------
    def start_engine(self, *, max_batch: int = 16, on_caller: bool = False) -> RolloutEngine:
        """Route every later `generate`/`sample` call through a continuously batched engine (concurrent
        episodes then share each forward pass); returns it. `stop_engine` goes back to one call at a time.
        `on_caller`: the engine decodes only inside `engine.drive(futures)`, in the thread that calls it (on
        a CPU, the thread that also trains: see RolloutEngine), rather than on a thread of its own."""
        from .engine import RolloutEngine

        with self.lock:
            if self._engine is None or not self._engine.alive:  # not alive: e.g. in a forked child
                self._engine = RolloutEngine(self, max_batch=max_batch, on_caller=on_caller)
            return self._engine

    def stop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and engine.alive:
            engine.close()

    @contextmanager
    def batched(self, *, max_batch: int = 16, on_caller: bool = False) -> Iterator[RolloutEngine]:
        """Run the engine for the body of the block (e.g. around a pool of concurrent rollouts); an engine
        that was already running is left running (and is what the block gets). With `on_caller`, the block
        calls `engine.drive(futures)` to decode while its episodes run."""
        running = self._engine is not None and self._engine.alive
        engine = self.start_engine(max_batch=max_batch, on_caller=on_caller)
        try:
            yield engine
        finally:
            if not running:
                self.stop_engine()

    @contextmanager
    def inference(self) -> Iterator[None]:
        """Eval mode and no grad for a sampling forward (peft's per-row adapter routing refuses training
        mode), restoring the mode the model was in."""
        import torch

        with self.lock, torch.no_grad():
            training = self.model.training
            if training:
                self.model.eval()
            try:
                yield
            finally:
                if training:
                    self.model.train()

    def token_logprobs(
        self,
        agent: str | None,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        *,
        pack: bool = True,
        max_tokens_per_row: int | None = None,
        temperature: float | Sequence[float | None] | None = 1.0,
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
        rounding (tests/test_packing.py).

        `temperature` (one value, or one per sample; None means 1) divides the logits exactly as sampling did
        (`engine.behaviour_logprobs`), so a sample's recomputed log-probs equal its recorded behaviour log-probs
        before any update: pass each action's recorded temperature."""
        import torch

        from .engine import behaviour_logprobs

        if len(prompts) != len(outputs):
            raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"sample {i} has an empty prompt: its first output token has nothing to condition on")
        if max_tokens_per_row is not None and max_tokens_per_row < 1:
            raise ValueError(f"max_tokens_per_row must be >= 1 or None (the longest sample), got {max_tokens_per_row}")
        temperatures = _per_sample_temperatures(temperature, len(prompts))
        ctx = self.base_only() if agent is None else self.active(agent)
        grad = torch.no_grad() if agent is None else nullcontext()  # a caller's no_grad (a snapshot) is kept
        if pack and self._can_pack():
            with ctx, grad:
                return self._packed_logprobs(prompts, outputs, max_tokens_per_row, temperatures)
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
        scale = torch.tensor(temperatures)[:, None].expand(-1, width - 1)  # (B, L-1)
        logp = behaviour_logprobs(logits[:, :-1], scale).gather(-1, ids[:, 1:, None])[..., 0]  # (B, L-1)
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
        self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], max_tokens_per_row: int | None,
        temperatures: Sequence[float],
    ) -> list[torch.Tensor]:
        import torch

        from .engine import behaviour_logprobs

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
        scale = torch.ones((len(rows), width))  # (R, W) the temperature of the sample each position belongs to
        order = []  # samples in the row-major order of their kept positions
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                p, o = prompts[i], outputs[i]
                ids[r, offset : offset + lengths[i]] = torch.tensor([*p, *o])
                positions[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
                keep[r, offset + len(p) - 1 : offset + lengths[i] - 1] = True  # logits at t predict token t+1
                scale[r, offset : offset + lengths[i]] = temperatures[i]
                order.append(i)
                offset += lengths[i]
            positions[r, offset:] = torch.arange(width - offset)
        targets = ids[:, 1:][keep[:, :-1]]  # (N,) the output tokens, in kept order
        scale = scale[keep]  # (N,)
        ids, positions, keep = ids.to(self.device), positions.to(self.device), keep.to(self.device)
        # A 2D boolean logits_to_keep projects only the kept positions: (N, V), flattened row-major
        logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
        logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
        logp = behaviour_logprobs(logits, scale).gather(-1, targets.to(self.device)[:, None])[:, 0]  # (N,)
        pieces = logp.split([len(outputs[i]) for i in order])
        by_sample = dict(zip(order, pieces))
        return [by_sample[i] for i in range(len(order))]


def _lora_adapter_of(name: str) -> str | None:
    """The adapter a peft parameter belongs to, read as a path component: peft names LoRA tensors
    `...<module>.lora_A.<adapter>.weight`, so the component after a `lora_*` one is the adapter. A substring test
    would give an agent named `model` every adapter's tensors (`.model.` is in every name)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def _per_sample_temperatures(temperature: float | Sequence[float | None] | None, n: int) -> list[float]:
    """One temperature per sample (None: 1), each > 0: the logits are divided by it."""
    values = [temperature] * n if temperature is None or isinstance(temperature, (int, float)) else list(temperature)
    if len(values) != n:
        raise ValueError(f"{len(values)} temperatures for {n} samples: pass one, or one per sample")
    out = [1.0 if t is None else float(t) for t in values]
    for i, t in enumerate(out):
        if not t > 0:
            raise ValueError(f"sample {i} has temperature {t}: log-probs need a temperature > 0 (a greedy action "
                             "has no sampling distribution to train on)")
    return out


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
