"""A tiny causal LM folder for the `mgk convert` tests: a Llama of 2 layers (6 query heads over 3 key/value groups,
head_dim 8) with a word-level tokenizer of the words of a small generated text, saved as a Hugging Face folder; and
that text as a WikiText-style folder (train and valid splits). No downloads."""
import random

import pytest

transformers = pytest.importorskip("transformers", reason="mgk convert needs transformers: pip install -e '.[hf]'")


def _text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(40)]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + " \n" for _ in range(lines))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """(model folder, data folder): a tiny Llama with its tokenizer, and wiki.{train,valid}.tokens."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("tiny_lm")
    data = root / "data"
    data.mkdir()
    (data / "wiki.train.tokens").write_text(_text(0, 600))
    (data / "wiki.valid.tokens").write_text(_text(1, 200))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": 3 + i for i in range(40)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=48, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # attention weights of a trained model's size: the key-norm term would matter
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, data
