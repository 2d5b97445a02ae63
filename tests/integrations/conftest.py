"""Tiny random Hugging Face models built from configs (no downloads) for the mgk.integrations.hf tests: ``hf_model``
builds one by name ("llama", "qwen2", "mistral", "gpt2", "bert"), in eval mode, seeded."""
import pytest
import torch

VOCAB = 40


def _build(name: str, **overrides):
    import transformers as tf

    if name == "llama":  # grouped keys and values: 4 query heads over 2 key/value heads
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.LlamaForCausalLM
    elif name == "qwen2":  # biases on q/k/v, none on o_proj
        config = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                use_sliding_window=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.Qwen2ForCausalLM
    elif name == "mistral":  # Llama's layout; its default sliding window is refused, so none
        config = tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.MistralForCausalLM
    elif name == "gpt2":  # a scale per layer, folded into the query projection
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                               resid_pdrop=0.0, embd_pdrop=0.0, scale_attn_by_inverse_layer_idx=True,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.GPT2LMHeadModel
    elif name == "bert":
        config = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, pad_token_id=0)
        cls = tf.BertForMaskedLM
    else:
        raise ValueError(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture
def hf_model(one_thread):
    return _build


@pytest.fixture
def batch():
    """(ids (2, 9), attention_mask (2, 9)): row 1 left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask
