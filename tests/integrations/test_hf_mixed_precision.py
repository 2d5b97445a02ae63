"""Mixed precision through a swapped model (TEST_CASES R33): every kind on every family trains under
``torch.autocast(..., dtype=torch.bfloat16)``, ``Trainer(bf16=True)`` and accelerate's ``mixed_precision="bf16"`` as
the original model does. The rotary models are where it breaks: transformers' rotary helper multiplies by float32
cos / sin, which promotes the bfloat16 query and keys past the values."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt2", "bert")


def _train_step(model, ids, mask, autocast: bool):
    """(loss, logits as float32, every parameter's gradient flattened) of one training forward and backward."""
    model.train()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.loss.item(), out.logits.detach().float(), grads


@pytest.mark.parametrize("kind", mgk.attention_kinds())
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_kind_trains_under_bf16_autocast_as_in_float32(hf_model, batch, arch, kind):
    ids, mask = batch
    original = hf_model(arch)
    model = mgk.swap_attention(copy.deepcopy(original), kind)
    loss, logits, grads = _train_step(model, ids, mask, autocast=True)
    loss32, logits32, grads32 = _train_step(model, ids, mask, autocast=False)
    assert torch.isfinite(logits).all() and torch.isfinite(grads).all()
    assert abs(loss - loss32) < 5e-2
    torch.testing.assert_close(logits, logits32, atol=2e-2, rtol=0)  # bfloat16 projections, float32 scores
    assert torch.nn.functional.cosine_similarity(grads, grads32, dim=0) > 0.99
    if kind == "softmax":
        reference, reference_logits, _ = _train_step(original, ids, mask, autocast=True)
        assert abs(loss - reference) < 5e-2
        torch.testing.assert_close(logits, reference_logits, atol=2e-2, rtol=0)


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_generate_under_bf16_autocast_gives_the_originals_tokens(hf_model, batch, arch):
    ids, mask = batch
    original = hf_model(arch)
    model = mgk.swap_attention(copy.deepcopy(original), "softmax")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = original.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)


class _Periodic(torch.utils.data.Dataset):
    """8 periodic sequences of 12 tokens (next-token prediction)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = 3 + (i + torch.arange(12)) % 6
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_trainer_bf16_trains_a_swapped_rotary_model_as_the_original(hf_model, tmp_path, arch):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    losses = []
    for swap in (False, True):
        model = hf_model(arch, use_cache=False)
        if swap:
            mgk.swap_attention(model, "softmax")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(swap)), max_steps=2, per_device_train_batch_size=4, bf16=True,
            use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
        losses.append(transformers.Trainer(model=model.train(), args=args, train_dataset=_Periodic()).train()
                      .training_loss)
    assert abs(losses[1] - losses[0]) < 5e-2, losses


def test_accelerate_bf16_trains_a_swapped_rotary_model(hf_model, batch):
    accelerate = pytest.importorskip("accelerate", reason="accelerate's mixed precision")
    ids, mask = batch
    losses = []
    for swap in (False, True):
        model = hf_model("llama")
        if swap:
            mgk.swap_attention(model, "mgk")
        accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
        model = accelerator.prepare(model.train())
        loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 5e-2, losses
