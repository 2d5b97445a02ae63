"""The nested run config: every field's declared range and choices checked from its declaration, one table of
--set names (flat and dotted), config.yaml written nested and read in both forms, presets' per-kind attention forms."""
import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml

from mgk import config as config_mod
from mgk.attention import get_kind
from mgk.attention.registry import attention_kinds
from mgk.fields import range_text
from mgk.tasks import all_presets

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_v0_1_0"


def _kind_taking(path: str) -> dict:
    """``{"attention": kind}`` of the first registered kind that takes the option at ``path`` (nothing for others)."""
    if not path.startswith("attention.options."):
        return {}
    name = path.split(".")[-1]
    return {"attention": next(k for k in attention_kinds() if name in get_kind(k).options.names())}


def _declared(what: str):
    """(flat name, dotted path, metadata) of every settable field that declares ``what`` ("range" or "choices")."""
    for name, path in config_mod.flat_keys().items():
        meta = config_mod.field_of(path).metadata
        has_range = any(meta.get(k) is not None for k in ("ge", "gt", "le", "lt"))
        if (has_range if what == "range" else meta.get("choices") is not None):
            yield pytest.param(name, path, meta, id=name)


def _sequence(path: str) -> bool:
    return "tuple" in str(config_mod.field_of(path).type)


def _outside_and_inside(meta, integer: bool) -> tuple[list, list]:
    step = 1 if integer else 1e-3
    outside, inside = [], []
    for key, bad, good in (("ge", -step, 0), ("gt", 0, step), ("le", step, 0), ("lt", 0, -step)):
        if meta.get(key) is not None:
            outside.append(meta[key] + bad)
            inside.append(meta[key] + good)
    return outside, inside


@pytest.mark.parametrize("name, path, meta", list(_declared("range")))
def test_every_declared_range_is_checked_naming_the_field(name, path, meta):
    integer = "int" in str(config_mod.field_of(path).type) and "float" not in str(config_mod.field_of(path).type)
    outside, inside = _outside_and_inside(meta, integer)
    base = config_mod.run_config(**_kind_taking(path))
    wrap = (lambda x: (x,)) if _sequence(path) else (lambda x: x)
    text = range_text(meta)
    for value in outside:
        with pytest.raises(ValueError, match=re.escape(f"config field {name} must be {text}")):
            config_mod.validate(config_mod.replace(base, {path: wrap(value)}))
    for value in ([] if integer else [math.nan, math.inf]):
        with pytest.raises(ValueError, match=re.escape(f"config field {name} must be a finite number {text}")):
            config_mod.validate(config_mod.replace(base, {path: wrap(value)}))
    for value in inside:
        config_mod.validate(config_mod.replace(base, {path: wrap(value)}))


@pytest.mark.parametrize("name, path, meta", list(_declared("choices")))
def test_every_declared_choice_is_checked_naming_the_field(name, path, meta):
    base = config_mod.run_config(**_kind_taking(path))
    with pytest.raises(ValueError, match=rf"config field {name} must be .*{re.escape(repr(meta['choices'][0]))}"):
        config_mod.validate(config_mod.apply_overrides(base, [f"{name}=no-such-{name}"]))
    for choice in meta["choices"]:
        config_mod.validate(config_mod.apply_overrides(base, [f"{name}={choice}"]))


def test_every_field_has_a_flat_name_and_a_dotted_path_and_they_agree():
    keys = config_mod.flat_keys()
    assert len(keys) == len(set(keys.values()))
    for path in keys.values():
        assert config_mod.field_of(path).metadata["doc"], path  # every field documents itself
    assert keys["attention"] == "attention.kind" and keys["attn_eps"] == "attention.options.eps"
    assert keys["eval_every"] == "eval.every" and keys["lr"] == "optim.lr" and keys["pi"] == "attention.options.pi"
    flat = config_mod.apply_overrides(config_mod.RunConfig(), ["lr=3e-4", "pi=soft_e", "eval_every=7"])
    dotted = config_mod.apply_overrides(config_mod.RunConfig(), ["optim.lr=3e-4", "attention.options.pi=soft_e",
                                                                "eval.every=7"])
    assert flat == dotted and flat.optim.lr == 3e-4 and flat.eval.every == 7
    with pytest.raises(ValueError, match="--set learning_rate: unknown config field"):
        config_mod.apply_overrides(config_mod.RunConfig(), ["learning_rate=1"])
    with pytest.raises(ValueError, match="filled in from max_len"):
        config_mod.apply_overrides(config_mod.RunConfig(), ["attention.options.max_len=9"])
    with pytest.raises(ValueError, match="cannot parse 'many' as int"):
        config_mod.apply_overrides(config_mod.RunConfig(), ["num_heads=many"])


def test_the_kind_is_chosen_first_whatever_the_order_of_the_pairs():
    a = config_mod.apply_overrides(config_mod.RunConfig(), ["mix=keys", "attention=mlk"])
    b = config_mod.apply_overrides(config_mod.RunConfig(), ["attention=mlk", "mix=keys"])
    assert a == b and a.attention.options.mix == "keys"
    with pytest.raises(ValueError, match="'mix' does not apply to attention kind 'mgk'"):
        config_mod.apply_overrides(config_mod.RunConfig(), ["mix=keys"])


@pytest.mark.parametrize("preset", sorted(all_presets()))
def test_presets_validate_and_survive_config_yaml(preset):
    cfg = config_mod.validate(all_presets()[preset])
    text = yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False)
    again = config_mod.from_dict(yaml.safe_load(text))
    assert again == cfg and config_mod.flat(again) == config_mod.flat(cfg)
    assert isinstance(yaml.safe_load(text)["attention"]["options"], dict)  # nested, not flat


def test_a_flat_0_1_0_config_reads_and_drops_options_its_kind_never_used():
    flat = yaml.safe_load((FIXTURE / "config.yaml").read_text())
    cfg = config_mod.from_dict(flat)
    assert (cfg.attention.kind, cfg.attention.num_heads, cfg.data.segment_len, cfg.model.adaptive_cutoffs) == \
        ("mgk", 2, 16, (50,))
    assert all(config_mod.flat(cfg)[k] == v for k, v in flat.items() if k not in ("adaptive_cutoffs",))
    softmax = config_mod.from_dict({**flat, "attention": "softmax"})  # 0.1.0 stored pi, sigma2 ... for every kind
    assert softmax.attention.options.as_kwargs() == {}
    with pytest.raises(ValueError, match=r"unknown config fields \['colour'\]"):
        config_mod.from_dict({**flat, "colour": "red"})
    nested = config_mod.to_dict(cfg)
    with pytest.raises(ValueError, match=r"unknown config fields \['optim.momentum'\]"):
        config_mod.from_dict({**nested, "optim": {**nested["optim"], "momentum": 0.9}})
    with pytest.raises(ValueError, match="'mix' does not apply to attention kind 'mgk'"):
        config_mod.from_dict({**nested, "attention": {**nested["attention"], "options": {"mix": "keys"}}})


def test_a_preset_gives_each_kind_its_own_form_and_an_option_set_on_purpose_is_checked():
    paper = all_presets()["listops-paper"]
    assert paper.attention.kind == "mgk" and paper.attention.options.pi_shape == "layer"
    softmax = config_mod.validate(config_mod.apply_overrides(paper, attention="softmax"))
    assert softmax.attention.options.as_kwargs() == {}
    mlk = config_mod.apply_overrides(paper, attention="mlk").attention.options
    assert (mlk.mix, mlk.normalize, mlk.pi_shape, mlk.pi_norm) == ("keys", "length", "layer", "none")
    linear = config_mod.apply_overrides(paper, attention="linear").attention.options
    assert linear.normalize == "length"
    # the preset's learned-weight shape goes back to the default under Soft-E; set on purpose it is refused
    softe = config_mod.validate(config_mod.apply_overrides(paper, pi="soft_e"))
    assert (softe.attention.options.pi_shape, softe.attention.options.pi_norm) == ("head", "softmax")
    with pytest.raises(ValueError, match="config field pi_shape applies only with pi='learned', not pi='soft_e'"):
        config_mod.validate(config_mod.apply_overrides(paper, ["pi_shape=layer"], pi="soft_e"))
    with pytest.raises(ValueError, match="'normalize' does not apply to attention kind 'softmax'"):
        config_mod.apply_overrides(paper, ["normalize=row"], attention="softmax")
    assert paper.attention_forms and "attention_forms" not in config_mod.to_dict(paper)


def test_models_are_built_from_their_config_objects():
    cfg = config_mod.run_config(attention="smgk", num_heads=2, head_dim=4, d_model=8, vocab_size=11, num_classes=3,
                                max_len=9, pi="soft_e")
    enc = config_mod.encoder_config(cfg)
    assert enc.attention.options.max_len == 9 and enc.attention.kind == "smgk"
    from mgk.models import LRAClassifier

    model = LRAClassifier(enc)
    attn = model.encoder.blocks[0].attn
    assert (attn.keys, attn.pi_mode, attn.num_heads, attn.head_dim, attn.max_len) == ("shifted", "soft_e", 2, 4, 9)
    assert dataclasses.replace(enc, max_len=9) == enc


@pytest.mark.parametrize("key,near", [
    ("lrr", "'lr'"), ("cutoffs", "'adaptive_cutoffs'"), ("num_head", "'num_heads'"), ("pi_shap", "'pi_shape'"),
    ("model.d_modle", "'model.d_model'"), ("optim.lrr", "'optim.lr'"),
    ("attention.options.num_key", "'attention.options.num_keys'"),
])
def test_a_mistyped_set_key_gets_a_close_match_in_one_line(key, near):
    for call in (lambda: config_mod.apply_overrides(config_mod.RunConfig(), [f"{key}=1"]),
                 lambda: config_mod.replace(config_mod.RunConfig(), {key: 1})):
        with pytest.raises(ValueError, match=rf"^--set {key}: unknown config field; did you mean {near}") as err:
            call()
        assert "\n" not in str(err.value) and "known fields" not in str(err.value)
    if "." not in key:
        with pytest.raises(ValueError, match=rf"^--set {key}: unknown config field; did you mean {near}"):
            config_mod.run_config(**{key: 1})


def test_mistyped_fields_of_a_saved_config_get_close_matches():
    with pytest.raises(ValueError, match=r"^unknown config fields \['model.d_modle'\]; did you mean "
                                         r"'model.d_model' for model.d_modle\?$"):
        config_mod.from_dict({"model": {"d_modle": 3}})
    with pytest.raises(ValueError, match=r"^unknown config fields \['lrr'\]; did you mean 'lr' for lrr\?$"):
        config_mod.from_dict({"lrr": 1})
