import pytest
import torch

from mappa_graph.training.loss import behaviour_tensor, clipped_surrogate, flatten_tokens, k1_kl, k3_kl


def test_clipping_bounds_the_ratio_on_both_sides() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))  # ratios 1.5, 0.5, 1.5, 0.5
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_surrogate(logp, old, adv, clip_eps=0.2)
    # A>0: min(1.5, 1.2)=1.2 (clipped) and min(0.5, 0.8)=0.5; A<0: min(-1.5, -1.2)=-1.5 and min(-0.5, -0.8)=-0.8
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [True, False, False, True]


def test_clipped_tokens_get_no_gradient_and_unclipped_get_the_pg_gradient() -> None:
    logp = torch.log(torch.tensor([1.5, 1.0])).requires_grad_()
    loss, _ = clipped_surrogate(logp, torch.zeros(2), torch.tensor([1.0, 2.0]), clip_eps=0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -2.0])  # d(-rho*A)/dlogp = -rho*A at rho=1


def test_shapes_and_eps_are_checked() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        clipped_surrogate(torch.zeros(3), torch.zeros(2), torch.zeros(3), 0.2)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        clipped_surrogate(torch.zeros(2), torch.zeros(2), torch.zeros(2), 0.0)


def test_flatten_broadcasts_advantages_per_token_and_k1_is_log_ratio() -> None:
    flat, adv = flatten_tokens([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])], [0.5, -1.0])
    assert flat.tolist() == [-1.0, -2.0, -3.0] and adv.tolist() == [0.5, 0.5, -1.0]
    assert k1_kl(torch.tensor([-1.0]), torch.tensor([-1.5])).tolist() == [0.5]


def _expected_grad(estimator, logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[grad of estimator(log pi(a), log ref(a))]: what a loss term on sampled tokens gives on average
    (samples are drawn from pi, so the weights pi(a) carry no gradient)."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)  # (V,)
    pi = logp.detach().exp()
    (pi * estimator(logp, ref)).sum().backward()
    return logits.grad


def test_k3_in_the_loss_pulls_toward_the_reference_where_k1_gives_no_gradient() -> None:
    """Issue 13 item 4: a k1 loss term has zero expected gradient under on-policy samples; k3's is the gradient of
    KL(ref || pi), so it regularises."""
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(5), torch.randn(5)
    ref = torch.log_softmax(ref_logits, dim=-1)
    k1_grad = _expected_grad(k1_kl, logits, ref)
    k3_grad = _expected_grad(k3_kl, logits, ref)
    assert torch.allclose(k1_grad, torch.zeros(5), atol=1e-6)
    # the exact gradient of KL(ref || pi) with respect to pi's logits
    exact = logits.clone().requires_grad_(True)
    (ref.exp() * (ref - torch.log_softmax(exact, dim=-1))).sum().backward()
    assert torch.allclose(k3_grad, exact.grad, atol=1e-6)
    assert k3_grad.abs().max() > 0.05
    # and a step along -k3_grad brings pi closer to the reference
    def kl(lg: torch.Tensor) -> float:
        return float((ref.exp() * (ref - torch.log_softmax(lg, dim=-1))).sum())
    assert kl(logits - 0.5 * k3_grad) < kl(logits)


def test_k3_is_nonnegative_and_zero_on_the_reference() -> None:
    logp = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    assert torch.allclose(k3_kl(logp, logp), torch.zeros(3))
    assert (k3_kl(logp, torch.log(torch.tensor([0.6, 0.1, 0.3]))) >= 0).all()


def test_behaviour_log_probs_are_built_on_the_reference_device_and_dtype() -> None:
    """Issue 13 item 2: the behaviour tensor was made on the CPU beside the model's log-probs (a crash on a GPU);
    the meta device stands in for a CUDA device here."""
    ref = torch.zeros(3, device="meta", dtype=torch.float64)
    old = behaviour_tensor([-0.1, -0.2, -0.3], ref)
    assert old.device == ref.device and old.dtype == ref.dtype
    assert k1_kl(old, ref).device == ref.device  # a CPU tensor here raised "not on the expected device"
    assert behaviour_tensor(None, ref).device == ref.device
    with pytest.raises(ValueError, match="2 behaviour log-probs for 3 tokens"):
        behaviour_tensor([-0.1, -0.2], ref)
