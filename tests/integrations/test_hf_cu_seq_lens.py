"""Sequences flattened into one row and described by flash attention's keyword arguments (``cu_seq_lens_q`` /
``cu_seq_lens_k``, what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` returns and transformers passes
each attention module through ``**kwargs``): each sequence gives what it gives alone, also where transformers builds
no block mask (with the configs' default cache, in eval and in training mode); malformed boundaries are refused in one
line naming the argument."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import packed_sequences as ps  # noqa: E402

import mgk  # noqa: E402


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", ("softmax", "mgk", "linear"))
def test_each_flattened_sequence_gives_what_it_gives_alone(hf_model, arch, kind):
    """With the configs' default use_cache=True transformers builds no block mask from position_ids (eval and
    training mode alike): the boundaries come from cu_seq_lens only."""
    model = mgk.swap_attention(hf_model(arch), kind)
    seqs = ps.sequences()
    batch = ps.packed(seqs, return_flash_attn_kwargs=True)
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["cu_seq_lens_q"].tolist() == [0, 3, 8, 12]
    with torch.no_grad():
        alone = ps.alone(model, seqs)
        torch.testing.assert_close(model(**batch).logits, alone, atol=1e-5, rtol=0)  # eval, prefill on a cache
        torch.testing.assert_close(model(**batch, use_cache=False).logits, alone, atol=1e-5, rtol=0)
    model.train()  # what Trainer runs with the collator (dropout is 0 in these configs)
    torch.testing.assert_close(model(**batch).logits, alone, atol=1e-5, rtol=0)


def test_positions_running_on_across_the_boundaries_are_accepted(hf_model):
    """Without position_ids the model numbers the row 0..L-1; rotary angles are relative, so each sequence still
    gives what it gives alone (flash attention accepts them too)."""
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    seqs = ps.sequences()
    batch = ps.packed(seqs, return_flash_attn_kwargs=True)
    batch.pop("position_ids")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ps.alone(model, seqs), atol=1e-5, rtol=0)


def _refused(model, match, **changes):
    batch = {**ps.packed(ps.sequences(), return_flash_attn_kwargs=True), **changes}
    with pytest.raises(ValueError, match=match) as err, torch.no_grad():
        model(**batch)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ("cu_seq_lens_q", "cu_seq_lens_k"))
@pytest.mark.parametrize("bad", ([1, 3, 8, 12], [0, 8, 3, 12], [0, 3, 3, 8, 12], [0, 3, 8, 11], [0, 3, 8, 13]),
                         ids=("not-from-0", "decreasing", "empty-sequence", "short", "long"))
def test_malformed_boundaries_are_refused_in_one_line(hf_model, name, bad):
    model = mgk.swap_attention(hf_model("llama"), "softmax")
    _refused(model, name, **{name: torch.tensor(bad, dtype=torch.int32)})


def test_other_malformed_input_is_refused_in_one_line(hf_model):
    model = mgk.swap_attention(hf_model("llama"), "softmax")
    _refused(model, "cu_seq_lens_q", cu_seq_lens_q=torch.tensor([0.0, 3.0, 8.0, 12.0]))  # not integers
    _refused(model, "cu_seq_lens_q and cu_seq_lens_k differ", cu_seq_lens_k=torch.tensor([0, 4, 8, 12]))
    batch = ps.packed(ps.sequences(), return_flash_attn_kwargs=True)
    two_rows = dict(input_ids=batch["input_ids"].repeat(2, 1), position_ids=batch["position_ids"].repeat(2, 1))
    _refused(model, "cu_seq_lens_q / cu_seq_lens_k .*batch size 2", **two_rows)
    inside = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2, 3]])  # a restart at 5, inside the second sequence
    _refused(model, "cu_seq_lens_q / cu_seq_lens_k and position_ids disagree", position_ids=inside)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 4, 4]))  # sequences starting at 0, 4, 8
    block = ((seq[:, None] == seq[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril())[None, None]
    _refused(model, "block-diagonal attention_mask disagree", attention_mask=block, position_ids=None)
    padded = torch.ones(1, 12, dtype=torch.long)
    padded[0, 0] = 0
    _refused(model, "cu_seq_lens_q / cu_seq_lens_k .*padding", attention_mask=padded)
