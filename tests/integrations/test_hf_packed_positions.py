"""Sequences packed into one row and told apart by ``position_ids`` alone (what ``DataCollatorWithFlattening()``
returns by default: input_ids and position_ids restarting at 0). transformers builds the block mask from them only
without a cache and without a 2D mask; with the cache the configs' ``use_cache=True`` makes (eval, and training as
``Trainer`` runs it), or with a padding mask, the sequences would see each other. Each sequence must give what it
gives alone, whether or not a cache was asked for; a cache filled by a packed forward holds several sequences in one
row, so a later step is refused in one line rather than attending across them (TEST_CASES R30: equality or a
one-line refusal, never a silent mix)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import packed_sequences as ps  # noqa: E402

import mgk  # noqa: E402


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", ("softmax", "mgk", "gmgk", "linear"))
def test_each_sequence_packed_by_position_ids_gives_what_it_gives_alone(hf_model, arch, kind):
    model = mgk.swap_attention(hf_model(arch), kind)
    seqs = ps.sequences()
    batch = ps.packed(seqs)
    assert sorted(batch) == ["input_ids", "position_ids"]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    with torch.no_grad():
        alone = ps.alone(model, seqs)
        torch.testing.assert_close(model(**batch).logits, alone, atol=1e-5, rtol=0)  # eval: use_cache=True
        torch.testing.assert_close(model(**batch, use_cache=False).logits, alone, atol=1e-5, rtol=0)
    model.train()  # what Trainer runs with the collator (dropout is 0 in these configs)
    torch.testing.assert_close(model(**batch).logits, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", mgk.attention_kinds())
@pytest.mark.parametrize("arch", ("llama", "qwen2", "gpt2"))
def test_packed_rows_with_a_padding_mask_give_each_sequence_alone_with_or_without_a_cache(hf_model, arch, kind):
    """Two rows, each packing two sequences by position_ids restarting at 0, with a 2D attention_mask (row 1
    left-padded): use_cache True or False, eval or training mode, each sequence gives what it gives alone."""
    model = mgk.swap_attention(hf_model(arch), kind)
    a, b, c = ps.sequences()
    ids = torch.tensor([a + b, [0] + c + a])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [1, 0, 1, 2, 3, 0, 1, 2]])
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    real = mask.bool()
    with torch.no_grad():
        rows = [ps.alone(model, [a, b])[0], ps.alone(model, [c, a])[0]]
        alone = torch.stack([rows[0], torch.cat([rows[1][:1], rows[1]])])  # row 1's padding position: unused
        for use_cache in (True, False):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=use_cache).logits
            torch.testing.assert_close(out[real], alone[real], atol=1e-5, rtol=0, msg=f"use_cache={use_cache}")
    model.train()  # dropout is 0 in these configs
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(out[real], alone[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ("softmax", "mgk"))
@pytest.mark.parametrize("collator", ({}, {"return_flash_attn_kwargs": True}), ids=("position_ids", "cu_seq_lens"))
def test_a_step_after_a_packed_forward_on_a_cache_is_refused_in_one_line(hf_model, kind, collator):
    model = mgk.swap_attention(hf_model("llama"), kind)
    cache = transformers.DynamicCache(config=model.config)
    seqs = ps.sequences()
    with torch.no_grad():
        packed = model(**ps.packed(seqs, **collator), past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(packed, ps.alone(model, seqs), atol=1e-5, rtol=0)  # the packed forward is exact
        with pytest.raises(ValueError, match=r"^layer 0's cache was filled by a packed forward") as err:
            model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[4]]), past_key_values=cache,
                  use_cache=True)
    assert "\n" not in str(err.value)
    cache.reset()  # an emptied cache decodes again
    with torch.no_grad():
        model(input_ids=torch.tensor([seqs[0]]), past_key_values=cache, use_cache=True)
        model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)


def test_left_padding_with_its_mask_is_not_read_as_packing(hf_model, batch):
    """generate's position_ids for a left-padded row (1 on the padding, then 0, 1, ...) restart inside the row; the
    mask's padding says what they mean, as in transformers, which reads position_ids only without a 2D mask."""
    ids, mask = batch
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert position_ids[1].tolist()[:4] == [1, 1, 1, 0]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True).logits
        alone = model(input_ids=ids[1:, 3:], use_cache=False).logits
    torch.testing.assert_close(out[1:, 3:], alone, atol=1e-5, rtol=0)


def test_positions_that_jump_forward_are_one_sequence_as_in_the_original(hf_model):
    """PoSE-style gaps (0, 1, 2, 30, 31, 32) give rotary angles, not boundaries: with a cache the swapped softmax
    model gives what the original gives, and decoding goes on."""
    model = hf_model("llama")
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    ids = torch.tensor([ps.sequences()[1] + [9]])
    positions = torch.tensor([[0, 1, 2, 30, 31, 32]])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=positions, use_cache=True).logits
        cache = transformers.DynamicCache(config=swapped.config)
        got = swapped(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        swapped(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[33]]), past_key_values=cache,
                use_cache=True)


def test_a_packed_row_is_read_alike_whatever_the_other_rows_padding(hf_model):
    """Row 0 packs two sequences; row 1 is or is not left-padded: row 0's logits are each sequence alone both ways."""
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    a, b, _ = ps.sequences()
    ids = torch.tensor([a + b, b + a])
    positions = torch.tensor([[*range(3), *range(5)], list(range(8))])
    alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits for s in (a, b)], dim=1)
    for padded in (False, True):
        mask = torch.ones_like(ids)
        mask[1, :1] = 0 if padded else 1
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).logits
        torch.testing.assert_close(out[:1], alone, atol=1e-5, rtol=0)


def test_a_sequence_starting_at_a_chunk_boundary_is_refused_in_one_line(hf_model):
    """A packed row cut between two cached calls: the second call's positions restart at 0 in a row the cache
    holds tokens of; attending it to the cached sequence would mix them."""
    model = mgk.swap_attention(hf_model("llama"), "softmax")
    a, b, _ = ps.sequences()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([a]), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"^position_ids restart at 0 in a call on layer 0's cache") as err:
            model(input_ids=torch.tensor([b]), position_ids=torch.arange(len(b))[None], past_key_values=cache,
                  use_cache=True)
    assert "\n" not in str(err.value)
