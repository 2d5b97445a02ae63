"""The paper's MGK-4 in Hugging Face models of 8 heads: swap_attention(model, "mgk", num_heads=4) keeps head_dim
(a rotary Llama allows nothing else), stays causal, generates the same with and without its cache, and trains."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.integrations.hf import HFAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 40


def _model(arch: str):
    """A tiny random model of 8 heads of head_dim 8 (hidden 64), 2 layers, eval mode."""
    tf = transformers
    if arch == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.LlamaForCausalLM
    else:
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=64, attn_pdrop=0.0,
                               resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.GPT2LMHeadModel
    torch.manual_seed(0)
    return mgk.swap_attention(cls(config).eval(), "mgk", num_heads=4)


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_mgk4_of_an_8_head_model_keeps_head_dim_is_causal_and_generates_alike_with_its_cache(arch):
    model = _model(arch)
    layers = [m.attn for m in model.modules() if isinstance(m, HFAttention)]
    assert len(layers) == 2 and all((a.num_heads, a.head_dim, a.num_keys) == (4, 8, 2) for a in layers)
    assert all(a.conversion["rule"] == "merge" for a in layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    changed = ids.clone()
    changed[:, 6:] = 3 + (changed[:, 6:] - 2) % (VOCAB - 3)
    with torch.no_grad():
        a, b = (model(input_ids=x, use_cache=False).logits for x in (ids, changed))
    torch.testing.assert_close(b[:, :6], a[:, :6], atol=1e-5, rtol=0)
    assert not torch.allclose(b[:, 6:], a[:, 6:], atol=1e-4)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_mgk4_of_an_8_head_model_trains(arch):
    model = _model(arch).train()
    start = torch.randint(3, 9, (8, 1), generator=torch.Generator().manual_seed(2))
    ids = 3 + (start + torch.arange(16)) % 6  # periodic sequences: next-token prediction
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses[::10]


def test_calibration_on_a_hf_model_pairs_by_attention_maps_and_ranks_by_its_loss():
    model = _model("gpt2")  # merged by weights; now a fresh one measured on a batch
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(model.config).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(3))
    merged = mgk.swap_attention(gpt2, "mgk", num_heads=4, calibration={"input_ids": ids})
    assert all("data" in m.attn.conversion["by"] for m in merged.modules() if isinstance(m, HFAttention))
    torch.manual_seed(0)
    pruned = mgk.swap_attention(transformers.GPT2LMHeadModel(model.config).eval(), "softmax", num_heads=4,
                                calibration={"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss)
    record = next(m for m in pruned.modules() if isinstance(m, HFAttention)).attn.conversion
    assert record["rule"] == "prune" and "E|dL/dxi_h|" in record["by"] and len(record["keep"]) == 4
