"""The local rollout engine: concurrent episodes' model calls decoded together, one KV-cached batch.

Every local sample goes through here, so there is one definition of the behaviour distribution: the raw logits
divided by the call's temperature, nothing else (no top-k, top-p or repetition penalty, whatever the model's
generation_config says). `behaviour_logprobs` is that definition; the training pass (`token_logprobs`) uses the
same function, so on the first, on-policy epoch the importance ratio is 1 to float rounding.

Continuous batching, as vLLM's scheduler does it but on Hugging Face parts: a request joins the running batch
after a prefill of its own (its KV cache is left-padded to the batch's width and concatenated), every decoding
step is one forward of all rows with their own positions and attention mask, and a row leaves as soon as it
stops (`DynamicCache.batch_select_indices`). Each row routes through its own LoRA adapter in the same forward
(peft's mixed-batch `adapter_names`) and samples with its own seeded `torch.Generator`, so what a row draws does
not depend on which other rows share its batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .policies import AgentPolicies, Generation

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


def behaviour_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Log-probs of the behaviour policy from raw logits (..., V): softmax(logits / T) in float32. The sampler
    draws from it and the loss recomputes it; a tensor temperature broadcasts over the leading dims."""
    import torch

    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=logits.device, dtype=torch.float32)[..., None]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


@dataclass
class SampleRequest:
    """One completion to sample: the prompt, the adapter (None: base model), and how to sample it."""

    adapter: str | None
    prompt_ids: list[int]
    max_new_tokens: int = 64
    temperature: float = 1.0
    do_sample: bool = True
    seed: int | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("cannot sample from an empty prompt: render at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"sampling temperature must be > 0, got {self.temperature} (use do_sample=False "
                             "for greedy decoding)")


@dataclass
class _Row:
    request: SampleRequest
    future: Future
    generator: Any = None
    length: int = 0  # tokens of this row in the KV cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False  # stopped on a stop token (not cut by max_new_tokens)
    done: bool = False


class _Batch:
    """The rows decoding together and their shared, left-padded KV cache. Not thread-safe: one owner."""

    def __init__(self, policies: AgentPolicies) -> None:
        self.policies = policies
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: Any = None  # (B, L) 1 where the cache holds a real token of that row
        # each row's next input token and its position, kept on the device beside the mask: a step builds no
        # tensor from Python lists (two host-to-device copies per step on a GPU)
        self.next_ids: Any = None  # (B,)
        self.positions: Any = None  # (B,)
        self.stop = frozenset(policies.stop_token_ids)
        self.cache_kwarg = cache_kwarg(policies.model)

    @contextmanager
    def _route(self, rows: Sequence[_Row]) -> Iterator[dict[str, Any]]:
        """Forward kwargs that send each row through its adapter. Rows of one adapter (the common case: one
        agent's turn, or a static batch) take peft's plain path; mixed rows use its per-row `adapter_names`,
        which costs a module walk and a sub-batch per adapter per layer."""
        model = self.policies.model
        names = {r.request.adapter for r in rows}
        if len(names) > 1:
            yield {"adapter_names": [r.request.adapter or BASE_ADAPTER for r in rows]}
            return
        (name,) = names
        if name is None:
            with model.disable_adapter():
                yield {}
            return
        if name not in model.peft_config:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {name}")
        if model.active_adapter != name:
            model.set_adapter(name)
        yield {}

    def join(self, rows: Sequence[_Row]) -> None:
        """Prefill new rows together (left-padded), sample each one's first token, and merge the caches of
        those still going into the batch. A row whose prefill fails gets the error and the others go on."""
        try:
            self._join(rows)
        except Exception as exc:  # noqa: BLE001 - find the bad request(s): prefill each row alone
            if len(rows) == 1:
                rows[0].future.set_exception(exc)
                return
            for row in rows:
                self.join([row])

    def _join(self, rows: Sequence[_Row]) -> None:
        import torch
        from transformers import DynamicCache

        policies = self.policies
        device = policies.device
        width = max(len(r.request.prompt_ids) for r in rows)
        pad = policies.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(r.request.prompt_ids)) + r.request.prompt_ids for r in rows],
                           device=device)  # (N, P) left-padded, so every row's last position is its own
        mask = torch.tensor([[0] * (width - len(r.request.prompt_ids)) + [1] * len(r.request.prompt_ids)
                             for r in rows], device=device)  # (N, P)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, P)
        for row in rows:
            row.length = len(row.request.prompt_ids)
        cache = DynamicCache(config=policies.model.config)
        with self._route(rows) as route:
            out = policies.model(input_ids=ids, attention_mask=_needed(mask, rows, width), position_ids=positions,
                                 use_cache=True, logits_to_keep=1, **{self.cache_kwarg: cache}, **route)
        _pad_left(cache, mask, width)  # checks the cache is one the engine can batch
        for row in rows:
            if row.request.do_sample:
                # on the host: a draw is one uniform per row and step, and a host generator draws it without a
                # kernel launch (all rows' draws then go to the device in one copy)
                row.generator = torch.Generator().manual_seed(row.request.seed)
        tokens = self._pick(rows, out.logits[:, -1])
        going = [i for i, r in enumerate(rows) if not r.done]
        if not going:  # every row stopped at its first token (and an empty index would be a float tensor)
            return
        lengths = torch.tensor([rows[i].length for i in going], device=device)  # each row's next position
        if len(going) < len(rows):
            index = torch.tensor(going, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask, tokens = mask[index], tokens[index]
        if self.cache is None:
            self.cache, self.mask, self.rows = cache, mask, [rows[i] for i in going]
            self.next_ids, self.positions = tokens, lengths
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = _pad_left(self.cache, self.mask, width)
        cache = _pad_left(cache, mask, width)
        for layer, extra in zip(self.cache.layers, cache.layers):
            layer.keys = torch.cat([layer.keys, extra.keys], dim=0)
            layer.values = torch.cat([layer.values, extra.values], dim=0)
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0)),
                               torch.nn.functional.pad(mask, (width - mask.shape[1], 0))], dim=0)
        self.rows.extend(rows[i] for i in going)
        self.next_ids = torch.cat([self.next_ids, tokens])
        self.positions = torch.cat([self.positions, lengths])

    def step(self) -> None:
        """One decoding step for every row: feed each row's last token, sample its next."""
        import torch

        ids = self.next_ids[:, None]  # (B, 1)
        width = self.mask.shape[1]  # L: the cache's positions before this step
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)  # (B, L+1)
        with self._route(self.rows) as route:
            out = self.policies.model(input_ids=ids, attention_mask=_needed(self.mask, self.rows, width),
                                      position_ids=self.positions[:, None],
                                      use_cache=True, **{self.cache_kwarg: self.cache}, **route)
        for row in self.rows:
            row.length += 1
        self.positions = self.positions + 1
        self.next_ids = self._pick(self.rows, out.logits[:, -1])

    def retire(self) -> list[_Row]:
        """Drop the rows that are done from the batch (and the cache columns no row uses any more)."""
        import torch

        done = [r for r in self.rows if r.done]
        if not done:
            return []
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.next_ids = self.positions = None
            return done
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next_ids, self.positions = self.mask[index], self.next_ids[index], self.positions[index]
        unused = self.mask.shape[1] - max(r.length for r in self.rows)  # leading all-padding columns
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
        return done

    def _pick(self, rows: Sequence[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Choose each row's next token from its logits (N, V), record its behaviour log-prob, and return the
        tokens (N,) on the device. A sampled row draws one uniform from its own generator and takes the token
        where it falls in the row's cumulative distribution (inverse-CDF sampling, what a multinomial does
        inside, here for every row in one pass instead of one multinomial per row); a greedy row takes the
        arg-max. Tokens and log-probs come back to the host in one copy per step (on a GPU each copy is a sync
        that stalls the next forward)."""
        import torch

        temperatures = torch.tensor([r.request.temperature if r.request.do_sample else 1.0 for r in rows],
                                    device=logits.device)  # greedy: the arg-max, its log-prob at temperature 1
        logp = behaviour_logprobs(logits, temperatures)  # (N, V)
        tokens = logp.argmax(dim=-1)  # (N,)
        sampled = [r.request.do_sample for r in rows]
        if any(sampled):
            draws = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) if s
                               else torch.zeros(1, dtype=torch.float64) for r, s in zip(rows, sampled)])
            cdf = logp.double().exp().cumsum(dim=-1)  # (N, V); float64: 49k float32 terms drift by ~1e-5
            at = (draws.to(logp.device) * cdf[:, -1])[:, None]  # scaled to the row's own total
            # the first token whose cumulative probability exceeds the draw (a zero-probability token never is)
            drawn = torch.searchsorted(cdf, at, right=True)[:, 0].clamp_(max=logp.shape[-1] - 1)
            tokens = drawn if all(sampled) else torch.where(torch.tensor(sampled, device=logp.device), drawn, tokens)
        chosen = logp.gather(1, tokens[:, None])[:, 0]  # (N,)
        k = max(r.request.top_logprobs for r in rows)
        if k:
            values, indices = (t.tolist() for t in logp.topk(k, dim=-1))
        for i, (row, token, logprob) in enumerate(zip(rows, tokens.tolist(), chosen.tolist())):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if row.request.top_logprobs:
                n = row.request.top_logprobs
                row.tops.append(list(zip(indices[i][:n], values[i][:n])))
            if token in self.stop:
                row.finished = row.done = True
            elif len(row.tokens) >= row.request.max_new_tokens:
                row.done = True
        return tokens


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes a KV cache: `cache` since transformers 5.2x, `past_key_values` before.
    A model whose forward takes neither by name would silently drop the cache (every step then sees only its
    last token), so that is an error."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    raise TypeError(f"{type(base).__name__}.forward takes no KV cache (neither `cache` nor `past_key_values`): "
                    "the rollout engine needs a causal LM with a KV cache")


def _needed(mask: torch.Tensor, rows: Sequence[_Row], width: int) -> torch.Tensor | None:
    """The attention mask, or None when no row has padding (every row holds `width` real tokens before this
    forward), which is known on the host from lengths. Given a mask, transformers builds a 4-D one for every
    step and asks whether it is all ones (`padding_mask.all()` in a Python `if`: a device sync per step); the
    engine passed its all-ones mask on every step and made 0.78x HF generate's tokens/s at 16 rows on an
    H200, 1.14x without (benchmarks/results/gpu_check_h200_engine_no_mask_batched_draw.json)."""
    if all(r.length == width for r in rows):
        return None
    return mask


def _pad_left(cache: Any, mask: torch.Tensor, width: int) -> Any:
    """Left-pad every layer of a DynamicCache to `width` positions (the padding is masked out)."""
    import torch

    extra = width - mask.shape[1]
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"the rollout engine batches full-attention KV caches only, not {type(layer).__name__} "
                "(sliding-window or indexed attention); sample this model one sequence at a time"
            )
        if extra:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, extra, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, extra, 0))
    return cache


def _result(row: _Row) -> Generation:
    from .policies import Generation

    return Generation(prompt_token_ids=list(row.request.prompt_ids), output_token_ids=row.tokens,
                      output_logprobs=row.logprobs, finished=row.finished, top_logprobs=row.tops)


def _fail(rows: Sequence[_Row], exc: BaseException) -> None:
    for row in rows:
        if not row.future.done():
            row.future.set_exception(exc)


def decode(policies: AgentPolicies, requests: Sequence[SampleRequest]) -> list[Generation]:
    """Decode a fixed set of requests together in the calling thread (the engine without its scheduler)."""
    import torch

    rows = [_Row(request=r, future=Future()) for r in requests]
    for row in rows:
        if row.request.do_sample and row.request.seed is None:
            row.request.seed = int(torch.randint(0, 2**62, (1,)).item())
    batch = _Batch(policies)
    with policies.lock, policies.inference():
        batch.join(rows)
        for row in rows:
            if row.future.done() and row.future.exception() is not None:
                raise row.future.exception()
        while batch.rows:
            batch.step()
            batch.retire()
    return [_result(r) for r in rows]


class RolloutEngine:
    """One continuously batched decoding loop for all submitted requests.

    Threads call `sample` (blocking) and coroutines `asample`; both just queue a request and wait for its
    future, so N concurrent episodes share each forward pass instead of taking turns. New requests join at the
    next step (up to `max_batch` rows); finished rows leave at once. Each step holds the policies' lock, so a
    training pass or an adapter load never runs in the middle of a forward.

    The loop runs on the engine's own thread, or with `on_caller=True` in whichever thread calls `drive`
    (the trainer's: the one that also runs the training passes). On a CPU that matters: each thread that runs
    torch ops keeps its own OpenMP team, and with two teams of `torch.get_num_threads()` threads on as many
    cores libgomp stops spin-waiting between parallel regions, so every op pays a wake-up (SmolLM2 on 2 cores:
    decoding on a second thread made 0.69x the tokens/s of decoding on the thread that loaded the model)."""

    def __init__(self, policies: AgentPolicies, *, max_batch: int = 16, on_caller: bool = False) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.policies = policies
        self.max_batch = max_batch
        self._queue: deque[_Row] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._batch = _Batch(policies)
        self.steps = 0  # decoding steps run (a batch of B rows counts once)
        self.rows_per_step = 0  # sum of batch sizes over steps: rows_per_step / steps is the mean batch
        self._thread: threading.Thread | None = None
        self._driver: int | None = None  # the thread in `drive` now (on_caller only)
        if not on_caller:
            self._thread = threading.Thread(target=self._loop, name="mappa-rollout-engine", daemon=True)
            self._thread.start()

    def submit(self, request: SampleRequest) -> Future:
        """Queue a request; the future resolves to its Generation (or the error its decoding raised)."""
        import torch

        if request.do_sample and request.seed is None:
            # drawn here, in the caller's thread, so torch.manual_seed before a call still fixes its stream
            request.seed = int(torch.randint(0, 2**62, (1,)).item())
        if self._thread is None and self._driver == threading.get_ident():
            raise RuntimeError("a request submitted from the thread driving the engine would never be decoded "
                               "(that thread is waiting on it): submit from the episodes' threads")
        row = _Row(request=request, future=Future())
        with self._wake:
            if self._closed:
                raise RuntimeError("the rollout engine is closed; start a new one (AgentPolicies.start_engine)")
            self._queue.append(row)
            self._wake.notify()
        return row.future

    @property
    def alive(self) -> bool:
        """False once closed, or (own thread) in a forked child: threads do not survive a fork."""
        if self._closed:
            return False
        return self._thread is None or self._thread.is_alive()

    def sample(self, request: SampleRequest) -> Generation:
        return self.submit(request).result()

    async def asample(self, request: SampleRequest) -> Generation:
        return await asyncio.wrap_future(self.submit(request))

    def drive(self, futures: Sequence[Future]) -> None:
        """Return once every future in `futures` (the episodes submitting requests) is done. An `on_caller`
        engine decodes in this thread meanwhile; one with its own thread just waits. If this thread is
        interrupted, the engine closes and the requests still queued or decoding fail, so no episode thread
        waits forever (a later call decodes alone, see `AgentPolicies.generate`)."""
        if self._thread is not None:
            wait(futures)
            return
        with self._wake:
            if self._driver is not None:
                raise RuntimeError("the engine is already being driven by another thread")
            self._driver = threading.get_ident()
        try:
            while self._turn(lambda: all(f.done() for f in futures)):
                pass
        except BaseException as exc:
            self._stop(exc)  # nothing would decode a request submitted after this
            raise
        finally:
            self._driver = None

    def close(self) -> None:
        if self._thread is None:
            self._stop(RuntimeError("the rollout engine was closed before this request was decoded"))
            return
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()  # the loop decodes what is left, then returns

    def _stop(self, exc: BaseException) -> None:
        """Close an engine with no thread of its own: nothing decodes any more, so what still waits (queued
        or mid-decode) fails with `exc` rather than hangs."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            rows, self._queue = [*self._queue, *self._batch.rows], deque()
            self._batch = _Batch(self.policies)
        _fail(rows, exc)

    def _gather(self, window: float = 0.002, limit: float = 0.02) -> None:
        """From idle, wait while requests keep arriving (at most `limit` s): episodes started together then
        prefill as one batch instead of the first decoding alone while the rest queue behind it."""
        deadline = time.monotonic() + limit
        seen = -1
        while seen != len(self._queue) < self.max_batch and time.monotonic() < deadline:
            seen = len(self._queue)
            self._wake.wait(window)

    def _loop(self) -> None:
        while self._turn(None):
            pass

    def _turn(self, finished: Callable[[], bool] | None) -> bool:
        """Wait for work, then admit queued requests and run one decoding step. False when the loop is over:
        the engine closed with nothing left, or (driven) `finished()` holds while idle."""
        batch = self._batch
        with self._wake:
            while not self._queue and not batch.rows:
                if self._closed or (finished is not None and finished()):
                    return False
                # driven: look at `finished` again soon (an episode can end without a request to wake us)
                self._wake.wait(None if finished is None else 0.005)
            if not batch.rows:
                self._gather()
            joining = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch - len(batch.rows)))]
        try:
            with self.policies.lock, self.policies.inference():
                if joining:
                    batch.join(joining)  # a bad request fails alone: prefills run before the batch is touched
                for row in joining:
                    if row.done and not row.future.done():
                        row.future.set_result(_result(row))
                if batch.rows:
                    self.steps += 1
                    self.rows_per_step += len(batch.rows)
                    batch.step()
            for row in batch.retire():
                row.future.set_result(_result(row))
        except BaseException as exc:  # a failed step fails its rows; the loop goes on
            _fail([*joining, *batch.rows], exc)
            self._batch = _Batch(self.policies)
            if self._thread is None and not isinstance(exc, Exception):
                raise  # an interrupt of the driving thread stops the drive (which fails what is left)
        return True
