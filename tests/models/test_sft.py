"""The warm start's loss: left-padded rows with the LM head over the reply tail only must give the same loss
as the plain right-padded, full-logits computation (it is only cheaper)."""

import torch

from mappa_graph.models.loading import load_base_model
from mappa_graph.models.sft import _reply_loss


def _full_loss(model, batch, pad):
    width = max(len(p) + len(r) for p, r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(batch):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(r)
        mask[i, : len(seq)] = 1
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def test_reply_loss_matches_full_logits_loss_on_rows_of_different_lengths():
    model, tokenizer, _ = load_base_model("tiny")
    model.eval()
    torch.manual_seed(0)
    batch = [([5, 9, 17, 33, 2, 8, 40], [11, 12, 13]), ([7, 3], [21, 22, 23, 24, 25]), ([4, 4, 4, 4], [30])]
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        ours, reference = _reply_loss(model, batch, pad), _full_loss(model, batch, pad)
    assert torch.allclose(ours, reference, atol=1e-5), (float(ours), float(reference))


def test_batch_loss_over_length_groups_equals_the_one_padded_batch_loss():
    from mappa_graph.models.sft import _batch_loss

    model, tokenizer, _ = load_base_model("tiny")
    model.eval()
    pad = tokenizer.pad_token_id
    # rows as three agents' prompts of very different lengths, in random order, replies of different lengths
    batch = [([5 + i % 7] * (12, 40, 15)[i % 3], [11 + i % 4] * (1 + i % 5)) for i in range(9)]
    with torch.no_grad():
        grouped, reference = _batch_loss(model, batch, pad), _full_loss(model, batch, pad)
    assert torch.allclose(grouped, reference, atol=1e-5), (float(grouped), float(reference))


def test_warm_start_key_changes_with_the_tiny_models_build_version(monkeypatch):
    """A warm start cached from an older tiny tokenizer must not be reused after the tiny model changes (the key
    once held only the name "tiny")."""
    from mappa_graph.models import tiny
    from mappa_graph.models.sft import SFTExample, warm_start_key

    examples = [SFTExample(messages=[{"role": "user", "content": "2+2?"}], reply="4")]
    settings = {"steps": 10, "batch_size": 2, "lr": 1e-3, "seed": 0, "threads": 2}
    before = warm_start_key("tiny", examples, **settings)
    assert warm_start_key("tiny", examples, **settings) == before
    assert warm_start_key("tiny:1", examples, **settings) != before
    monkeypatch.setattr(tiny, "TINY_VERSION", "v-next")
    assert warm_start_key("tiny", examples, **settings) != before
    assert warm_start_key("/models/qwen", examples, **settings) == warm_start_key("/models/qwen", examples, **settings)


def test_a_warm_start_built_on_one_torch_thread_is_not_served_to_a_caller_on_two(tiny_path, tmp_path, monkeypatch):
    """torch's intra-op thread count splits the reductions differently, so the same settings give other
    weights: the arithmetic warm start built on 1 thread (a test that set it) ended at loss 0.385 against 0.367
    on 2, and the trainer tests that read it from the cache failed in a full run and passed alone."""
    from mappa_graph.models.sft import SFTExample, warm_start

    monkeypatch.setenv("MAPPA_CACHE_DIR", str(tmp_path))
    examples = [SFTExample(messages=[{"role": "user", "content": f"{i}+2?"}], reply=str(i + 2)) for i in range(4)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = warm_start(str(tiny_path), examples, steps=2, batch_size=2, progress=False)
        torch.set_num_threads(2)
        two = warm_start(str(tiny_path), examples, steps=2, batch_size=2, progress=False)
    finally:
        torch.set_num_threads(before)
    assert one != two and one.parent == two.parent == tmp_path
