"""The attention registry: one declaration per kind (family, label, options dataclass, factory, FLOP formula, cache
layout, variants), read by labels, tables, benchmarks and the test suite; a name is registered once."""
import dataclasses
from functools import partial

import pytest

from mgk import config
from mgk.analyze.run import run_label as analyze_label
from mgk.attention import MGKAttention, registry
from mgk.attention.mgk import MGKOptions
from mgk.attention.registry import (
    AttentionKind,
    CacheSpec,
    attention_kinds,
    build_attention,
    display_label,
    get_kind,
    kind_variants,
    make_options,
    register,
    run_label,
    variant_name,
)
from mgk.bench.attention import analytic_flops, variant
from mgk.fields import Label, spec
from mgk.reproduce.collect import attention_flops
from mgk.reproduce.experiments import Row
from mgk.tasks.lra_table import setting


def test_the_papers_six_kinds_in_order_then_the_baselines_added_since():
    assert attention_kinds() == ("softmax", "mgk", "smgk", "linear", "mlk", "smlk", "gqa", "gmgk")
    assert [get_kind(k).family for k in attention_kinds()] == ["softmax", "mixture", "mixture", "linear", "linear",
                                                               "linear", "softmax", "mixture"]
    assert [get_kind(k).label for k in attention_kinds()] == ["softmax", "MGK", "sMGK", "linear", "MLK", "sMLK",
                                                              "GQA", "gMGK"]


def test_registering_a_name_twice_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'mgk' is already registered"):
        register(dataclasses.replace(get_kind("mgk")))
    assert get_kind("mgk").factory.keywords == {"keys": "separate"}  # the first declaration stays


@pytest.mark.parametrize("change, message", [(dict(family="quadratic"), "family"),
                                             (dict(variants=({"pi": "soft_e"},)), "first variant"),
                                             (dict(variants=({}, {"pi": "bogus"})), "'pi'"),
                                             (dict(options=dict), "Options dataclass")])
def test_a_bad_declaration_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        register(dataclasses.replace(get_kind("mgk"), name="mgk-bad", **change))
    assert "mgk-bad" not in attention_kinds()


def test_every_variant_builds_with_its_options():
    for kind, values in kind_variants():
        module = build_attention(kind, 16, 2, **values, **({"max_len": 8} if "max_len" in get_kind(kind).options.names()
                                                           else {}))
        for name, value in values.items():
            if name == "sigma2":  # the module holds the variances themselves: a parameter when learned
                assert value == "learned" and module.learned_variances, (kind, name)
                continue
            assert getattr(module, {"pi": "pi_mode"}.get(name, name)) == value, (kind, name)
    assert variant_name("mgk", {"pi": "soft_e"}) == "mgk+pi=soft_e" and variant_name("linear", {}) == "linear"


def test_options_are_checked_in_one_place_naming_option_and_kind():
    with pytest.raises(ValueError, match="'mix' does not apply to attention kind 'mgk'"):
        make_options("mgk", mix="keys")
    with pytest.raises(ValueError, match="'num_keys' of kind 'smgk' must be >= 1, got 0"):
        make_options("smgk", num_keys=0)
    with pytest.raises(ValueError, match="'sigma2' of kind 'mgk' must be a finite number > 0"):
        make_options("mgk", sigma2=(1.0, float("nan")))
    with pytest.raises(ValueError, match="'pi_norm' of kind 'mgk' applies only with pi='learned'"):
        make_options("mgk", pi="hard_e", pi_norm="none")
    with pytest.raises(ValueError, match="'normalize' of kind 'linear' must be one of 'row', 'length', 'none'"):
        make_options("linear", normalize="rows")
    assert make_options("mgk", sigma2=[1.0, 2.0]).sigma2 == (1.0, 2.0)  # a list is held as a tuple (hashable)
    # the same rule reset a preset's learned-weight shape under Soft-E, and keeps one a user set
    opts = dataclasses.replace(make_options("mgk", pi_shape="layer"), pi="soft_e")
    assert opts.reset_inapplicable().pi_shape == "head"
    assert opts.reset_inapplicable(keep={"pi_shape"}).pi_shape == "layer"


def test_labels_come_from_the_option_values():
    assert display_label("smgk", 4, make_options("smgk", pi="soft_e")) == "sMGK x 4 (Soft-E)"
    assert display_label("mgk", 1, make_options("mgk")) == "MGK x 1"
    assert display_label("mlk", 4, make_options("mlk", mix="keys")) == "MLK x 4 (mix=keys)"
    assert run_label("mgk", 4, make_options("mgk", pi="hard_e")) == "mgk-4 hard_e"
    assert run_label("smgk", None, make_options("smgk", pi="hard_e"), sep="+") == "smgk+hard_e"
    # options that do not name a variant (shapes, fixed variances) leave the label alone
    assert run_label("mgk", 8, make_options("mgk", pi_shape="position", max_len=4, sigma2=(4.0, 1.0))) == "mgk-8"


@pytest.mark.parametrize("kind, keys, scalars", [("softmax", 1, 0), ("mgk", 3, 3), ("smgk", 1, 3)])
def test_key_value_caches_store_the_declared_keys(kind, keys, scalars):
    """Key vectors, value vectors and per-key scalars (MGK / sMGK: one per component, the bias log pi - |k|^2 / 2
    sigma^2 with sMGK's shifts folded in) per token and head."""
    options = make_options(kind, **({"num_keys": 3} if kind != "softmax" else {}))
    assert get_kind(kind).cache.stored_per_token(options) == (keys, 1, scalars)
    H, D, L = 2, 8, 10
    assert get_kind(kind).cache.cache_bytes(options, num_heads=H, head_dim=D, length=L) == \
        H * L * ((keys + 1) * D + scalars) * 4


@pytest.mark.parametrize("kind", ["linear", "mlk", "smlk"])
def test_linear_kinds_keep_a_state_of_fixed_size(kind):
    cache, options = get_kind(kind).cache, make_options(kind)
    assert cache.recurrent and cache.stored_per_token(options) == (0, 0, 0)
    sizes = {cache.cache_bytes(options, num_heads=2, head_dim=8, length=n, element_size=2) for n in (1, 100, 10_000)}
    assert sizes == {2 * (8 * 8 + 8) * 2}


def test_flops_of_each_kind_come_from_its_options():
    shape = dict(heads=4, length=64, batch=1, embed_dim=32, head_dim=8, causal=False, backward=False)
    mgk, smgk = get_kind("mgk"), get_kind("smgk")
    plain, hard = make_options("mgk"), make_options("mgk", pi="hard_e")
    assert mgk.flops(hard, **shape) == mgk.flops(plain, **shape, mixture_kernel=True)  # summed before the values
    assert mgk.flops(plain, **shape) > mgk.flops(plain, **shape, mixture_kernel=True)
    # sMGK has one key projection instead of M: the difference is (M - 1) projections
    assert mgk.flops(plain, **shape) - smgk.flops(plain, **shape) == 2 * 64 * 32 * 4 * 8
    softe = make_options("mgk", pi="soft_e")
    assert mgk.flops(softe, **{**shape, "backward": True}) > mgk.flops(plain, **{**shape, "backward": True})
    assert analytic_flops("mgk-hard", 4, 64, 1, 32, 8, causal=False, backward=False) == mgk.flops(hard, **shape)


@dataclasses.dataclass(frozen=True)
class TemperatureOptions(MGKOptions):
    """MGK with one more option that names a variant: what adding an option through the registry alone looks like."""

    temperature: str = spec("fixed", choices=("fixed", "learned"), label=Label({"learned": "learned T"}),
                            doc="test option")


@pytest.fixture
def extra_kind():
    """A kind registered for one test (and removed after it): MGK whose options have one more labelled field."""
    def factory(embed_dim, num_heads, temperature="fixed", **kw):
        return MGKAttention(embed_dim, num_heads, keys="separate", **kw)

    kind = register(AttentionKind("mgk-t", "mixture", "MGK-T", TemperatureOptions, factory,
                                  partial(get_kind("mgk").flops.func, separate=True), CacheSpec("num_keys"),
                                  ({}, {"temperature": "learned"})))
    yield kind
    del registry._REGISTRY[kind.name]


def test_a_kind_added_through_the_registry_alone_is_built_labelled_counted_and_tabled(extra_kind):
    assert attention_kinds()[-1] == "mgk-t" and ("mgk-t", {"temperature": "learned"}) in kind_variants()
    module = build_attention("mgk-t", 16, 2, temperature="learned", pi="soft_e", max_len=8)
    assert isinstance(module, MGKAttention) and module.pi_mode == "soft_e"
    options = make_options("mgk-t", temperature="learned")
    assert display_label("mgk-t", 2, options) == "MGK-T x 2 (learned T)"
    assert run_label("mgk-t", 2, options) == "mgk-t-2 temperature=learned"
    assert setting({"attention": "mgk-t", "num_heads": 2, "attention_options": {"temperature": "learned"}}) == \
        ("mgk-t+temperature=learned", 2)
    bench = variant("mgk-t+temperature=learned")
    assert bench.kind == "mgk-t" and bench.options == {"temperature": "learned"}
    assert analytic_flops("mgk-t", 2, 16, 1, 16, 8, causal=False, backward=False) == \
        analytic_flops("mgk", 2, 16, 1, 16, 8, causal=False, backward=False)
    with pytest.raises(ValueError, match="'temperature' of kind 'mgk-t' must be one of"):
        make_options("mgk-t", temperature="annealed")
    # the run config, training records, reproduce rows and analysis labels read it from the registry too
    cfg = config.validate(config.apply_overrides(config.RunConfig(), ["attention=mgk-t", "temperature=learned"]))
    assert config.flat(cfg)["temperature"] == "learned"
    assert config.from_dict(config.to_dict(cfg)) == cfg
    assert analyze_label(cfg) == "mgk-t-4 temperature=learned"
    assert Row("t", "mgk-t", 2, overrides=("temperature=learned",)).label == "MGK-T x 2 (learned T)"
    assert attention_flops(cfg) == attention_flops(config.replace(cfg, attention="mgk"))

