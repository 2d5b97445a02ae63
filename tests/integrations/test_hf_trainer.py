"""transformers.Trainer trains a swapped model, checkpoints it and resumes from the checkpoint exactly (10 steps ==
5 steps + resume to 10); the checkpoint loads through the Auto classes; gradient checkpointing gives the same
gradients."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

import mgk  # noqa: E402
from mgk.integrations.hf import HFAttention  # noqa: E402


class _Periodic(torch.utils.data.Dataset):
    """16 periodic sequences of 12 tokens (next-token prediction)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = 3 + (i + torch.arange(12)) % 6
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class _StopAt(transformers.TrainerCallback):
    """Interrupts a run after ``step`` steps (after its checkpoint there), as a killed job would be."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _trainer(model, out, max_steps=10, stop=None):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2, save_steps=5,
        save_strategy="steps", logging_steps=100, report_to="none", dataloader_num_workers=0, seed=0, data_seed=0,
        use_cpu=True, disable_tqdm=True, warmup_steps=2)
    callbacks = [] if stop is None else [_StopAt(stop)]
    return transformers.Trainer(model=model, args=args, train_dataset=_Periodic(), callbacks=callbacks)


def _swapped(hf_model):
    return mgk.swap_attention(hf_model("llama", use_cache=False), "mgk").train()


def test_ten_steps_equal_five_and_a_resume_to_ten(hf_model, tmp_path):
    straight = _swapped(hf_model)
    _trainer(straight, tmp_path / "straight").train()
    first = _swapped(hf_model)
    _trainer(first, tmp_path / "resumed", stop=5).train()  # warm-up then linear decay over 10 steps: stopped at 5
    checkpoint = tmp_path / "resumed" / "checkpoint-5"
    resumed = _swapped(hf_model)
    _trainer(resumed, tmp_path / "resumed").train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    ids = torch.arange(3, 12).unsqueeze(0)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert isinstance(loaded.model.layers[0].self_attn, HFAttention)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, first.eval()(input_ids=ids).logits)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_gradient_checkpointing_gives_the_same_gradients(hf_model, batch, arch):
    ids, mask = batch
    grads = []
    for checkpointing in (False, True):
        model = mgk.swap_attention(hf_model(arch), "mgk").train()
        if checkpointing:  # (5.x also names it activation_checkpointing_enable)
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)
