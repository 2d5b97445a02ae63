"""A swapped Hugging Face model survives save_pretrained / from_pretrained: the Auto classes (after
``import mgk.integrations.hf``) and ``pipeline`` give back the swapped model with identical logits, every kind and
option stored; transformers without mgk refuses the folder naming its mgk model type."""
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import attention_kinds  # noqa: E402
from mgk.integrations.hf import HFAttention  # noqa: E402
from mgk.integrations.hf.auto import MGKLlamaConfig  # noqa: E402

KINDS = attention_kinds()
AUTO = {"llama": "AutoModelForCausalLM", "gpt2": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM"}
OPTIONS = {"mgk": {"num_keys": 3, "sigma2": (2.0, 1.0, 0.5)}, "smgk": {"pi": "soft_e", "max_len": 64},
           "gqa": {"num_kv_heads": 2}}


def _perturbed(model):
    """``model`` with every attention parameter and buffer moved off its initial value (so a value the folder
    does not store, or stores under a name the load does not read, comes back different)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, HFAttention):
                for t in [*module.parameters(), *module.buffers()]:
                    if t.is_floating_point():
                        t.add_(0.05 * torch.rand(t.shape, generator=g))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _round_trip(hf_model, tmp_path, arch, kind, **options):
    model = _perturbed(mgk.swap_attention(hf_model(arch), kind, **options))
    model.save_pretrained(tmp_path)
    loaded = getattr(transformers, AUTO[arch]).from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    assert type(loaded) is type(model) and type(loaded).__name__.startswith("MGK")
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    return model, loaded


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_on_llama_comes_back_from_save_pretrained(hf_model, tmp_path, kind):
    model, loaded = _round_trip(hf_model, tmp_path, "llama", kind, **OPTIONS.get(kind, {}))
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["model_type"] == "mgk_llama"
    assert record["mgk_attention"]["kind"] == kind and record["mgk_attention"]["head_dim"] == 8
    assert loaded.config.mgk_attention == model.config.mgk_attention


@pytest.mark.parametrize("arch", ("gpt2", "bert"))
def test_gpt2_and_bert_come_back_from_save_pretrained(hf_model, tmp_path, arch):
    _round_trip(hf_model, tmp_path, arch, "mgk")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_on_every_architecture_comes_back(hf_model, tmp_path, arch, kind):
    _round_trip(hf_model, tmp_path, arch, kind, **OPTIONS.get(kind, {}))


def test_a_second_swap_with_fewer_heads_is_what_the_folder_rebuilds(hf_model, tmp_path):
    """GPT-2 mgk, then softmax with 2 heads: the record holds the heads built, not the arguments of one call."""
    model = mgk.swap_attention(mgk.swap_attention(hf_model("gpt2"), "mgk"), "softmax", num_heads=2)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.transformer.h[0].attn.attn.num_heads == 2
    ids = torch.randint(3, 40, (2, 7))
    assert torch.equal(_logits(loaded.eval(), ids), _logits(model, ids))


def test_fewer_heads_of_the_same_size_on_llama_come_back(hf_model, tmp_path):
    model, loaded = _round_trip(hf_model, tmp_path, "llama", "mgk", num_heads=2)
    assert loaded.model.layers[0].self_attn.attn.num_heads == 2 and loaded.config.mgk_attention["head_dim"] == 8


def test_the_base_model_and_a_classifier_load_from_a_causal_lm_folder(hf_model, tmp_path):
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    model.save_pretrained(tmp_path)
    base = transformers.AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).last_hidden_state, model.model(input_ids=ids).last_hidden_state)
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert type(classifier).__name__ == "MGKLlamaForSequenceClassification"
    assert isinstance(classifier.model.layers[0].self_attn, HFAttention)


def _tokenizer():
    """A word-level tokenizer of the tiny vocabulary ("w0" ... "w39"), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", bos_token="w1",
                                                eos_token="w2", unk_token="w0")


def test_pipeline_generates_from_the_folder_as_the_model_does(hf_model, tmp_path):
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    model.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    generator = transformers.pipeline("text-generation", model=str(tmp_path),
                                      tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path))
    assert type(generator.model).__name__ == "MGKLlamaForCausalLM"
    text = generator("w5 w6 w7", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)[0, 3:]
    assert [int(w[1:]) for w in text.split()] == expected.tolist()


def test_transformers_without_mgk_refuses_the_folder_naming_its_model_type(hf_model, tmp_path):
    mgk.swap_attention(hf_model("llama"), "mgk").save_pretrained(tmp_path)
    code = ("import sys, transformers as tf\n"
            "pipe = lambda p: tf.pipeline('text-generation', model=p)\n"
            "for load in (tf.AutoModelForCausalLM.from_pretrained, pipe):\n"
            "    try:\n        load(sys.argv[1])\n    except ValueError as e:\n        print(str(e).splitlines()[0])\n"
            "assert not any(m.startswith('mgk') for m in sys.modules), 'mgk was imported'\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all("`mgk_llama`" in line and "does not recognize" in line for line in lines)


def test_a_config_of_an_mgk_type_without_the_swap_is_refused_in_one_line():
    config = MGKLlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4)
    with pytest.raises(ValueError, match="mgk_attention") as err:
        transformers.AutoModelForCausalLM.from_config(config)
    assert "\n" not in str(err.value)


def test_a_config_written_by_hand_builds_a_fresh_swapped_model():
    config = MGKLlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, mgk_attention={"kind": "mgk", "options": {"num_keys": 3}})
    model = transformers.AutoModelForCausalLM.from_config(config)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, HFAttention) and attn.attn.num_keys == 3
