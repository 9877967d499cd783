import pytest
import torch

from mappa_graph.training.loss import clipped_surrogate, flatten_tokens, k1_kl


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
