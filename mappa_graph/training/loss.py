"""The policy-gradient loss: token-level PPO-clipped surrogate (REINFORCE++ advantages) with an optional KL.

Small pure functions on tensors, shapes in comments, so they can be checked on hand-made numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip (Schulman et al. 2017), per token: -min(rho * A, clip(rho, 1-eps, 1+eps) * A).

    logprobs, old_logprobs, advantages: (N,) over all tokens of the batch. The ratio rho is taken against the
    behaviour log-probs recorded at rollout, which makes several optimiser steps per rollout batch valid.
    Returns (per-token loss (N,), per-token clipped mask (N,))."""
    if not (logprobs.shape == old_logprobs.shape == advantages.shape):
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)}"
        )
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    ratio = torch.exp(logprobs - old_logprobs)  # (N,)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)  # (N,)
    was_clipped = (clipped < unclipped).detach()
    return loss, was_clipped


def k1_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(pi || ref) per token: log pi - log ref. Unbiased as a value, so it is what the reference
    takes off the reward; as a loss its expected gradient under samples from pi is zero (the score-function
    identity), so it must not be used as a loss term."""
    return logprobs - ref_logprobs


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator (Schulman, "Approximating KL divergence", 2020), per token: r - log r - 1 with
    r = ref / pi. Non-negative and low-variance; as a loss its expected gradient is the gradient of KL(ref || pi),
    which pulls pi toward the reference. The estimator GRPO (DeepSeekMath) puts in its loss."""
    log_ratio = ref_logprobs - logprobs  # (N,) log r
    return torch.exp(log_ratio) - log_ratio - 1.0


def behaviour_tensor(values: Sequence[float] | None, like: torch.Tensor) -> torch.Tensor:
    """Recorded behaviour log-probs as a tensor beside `like` (same device and dtype), or `like` detached when
    nothing was recorded. Built on the model's device: a CPU tensor next to CUDA log-probs fails at the first
    subtraction."""
    if values is None:
        return like.detach()
    if len(values) != like.numel():
        raise ValueError(f"{len(values)} behaviour log-probs for {like.numel()} tokens")
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def flatten_tokens(
    per_sample: Sequence[torch.Tensor], advantages: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-sample token tensors (T_i,) into (N,) and broadcast each sample's advantage."""
    if len(per_sample) != len(advantages):
        raise ValueError(f"{len(per_sample)} samples but {len(advantages)} advantages")
    flat = torch.cat([t.reshape(-1) for t in per_sample])  # (N,)
    adv = torch.cat(
        [torch.full((t.numel(),), float(a), dtype=flat.dtype, device=flat.device) for t, a in zip(per_sample, advantages)]
    )
    return flat, adv
