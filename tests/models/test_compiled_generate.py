"""``generate(..., compile=...)`` (:mod:`mgk.models.compiled_decode`): greedy tokens equal eager decoding's for every
kind and option set, traced in one graph (fullgraph) that no step recompiles; left-padded prompts and one-token
prompts (MGK's centre settles at the second token, before the compiled steps start) alike; inductor, the default
backend, for MGK here and for every kind in the slow suite; bad values of ``compile`` refused in one line."""
from __future__ import annotations

import pytest
import torch

from mgk.attention.registry import variant_name
from mgk.models.compiled_decode import CompiledStep, CompileError, check_compile
from models.test_generate import CASES, V, _lm


def _both(model, idx, n, backend, **kw):
    torch._dynamo.reset()  # each case compiles afresh: a recompilation would then be a step's, and an error
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(idx, n, temperature=0, compile=backend, **kw)
    return got, model.generate(idx, n, temperature=0, **kw)


@pytest.mark.parametrize("kind,options", CASES, ids=[variant_name(k, v) for k, v in CASES])
def test_compiled_greedy_generation_equals_eager_token_for_token(kind, options):
    model = _lm(kind, options)
    idx = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    got, want = _both(model, idx, 12, "aot_eager")
    assert got.shape == (2, 19) and torch.equal(got, want)


@pytest.mark.parametrize("kind", ["mgk", "softmax"])
def test_left_padded_and_one_token_prompts_compile_as_eager(kind):
    model = _lm(kind)
    idx = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, :4] = True
    pad[2, :5] = True  # one real token: the compiled steps start after the second
    got, want = _both(model, idx, 10, "aot_eager", key_padding_mask=pad)
    assert torch.equal(got, want)
    got, want = _both(model, idx[:, -1:], 6, "aot_eager")
    assert torch.equal(got, want)


def test_eos_ends_rows_under_compile_as_eager():
    model = _lm("smgk")
    idx = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(3))
    eos = int(model.generate(idx, 3, temperature=0)[0, -1])  # a token the first row reaches
    got, want = _both(model, idx, 9, "aot_eager", eos=eos)
    assert torch.equal(got, want) and bool((got[0, 7:] == eos).all())


def test_inductor_compiles_the_mgk_step_equal_to_eager():
    model = _lm("mgk", layers=1)
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    got, want = _both(model, idx, 6, True)
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kind,options", CASES, ids=[variant_name(k, v) for k, v in CASES])
def test_inductor_compiled_generation_equals_eager_for_every_kind(kind, options):
    model = _lm(kind, options)
    idx = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    got, want = _both(model, idx, 12, "inductor")
    assert torch.equal(got, want)


@pytest.mark.parametrize("value,message", [
    ("no_such_backend", "compile must be False, True"), (1, "compile must be False, True"),
    ("", "compile must be False, True")])
def test_bad_compile_values_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        check_compile(value)
    model = _lm("softmax")
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, compile=value)


def test_compile_needs_the_cache_and_a_step_past_the_capacity_is_refused():
    model = _lm("mgk").eval()
    idx = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="use_cache=True"):
        model.generate(idx, 2, compile=True, use_cache=False)
    assert check_compile(False) is None and check_compile(True) == "inductor"
    cache = model.new_cache()
    with torch.no_grad():
        model.next_log_probs(idx, past_key_values=cache)
        step = CompiledStep(model, cache, 5, backend="eager")
        step(idx[:, -1:])
        with pytest.raises(ValueError, match=r"fixed capacity \(5 tokens\) is used up"):
            step(idx[:, -1:])


def test_a_compiler_failure_is_one_line_naming_the_option():
    def failing(gm, example_inputs):
        raise RuntimeError("no C++ compiler found\n(and many more lines)")

    torch._dynamo.reset()
    torch._dynamo.register_backend(name="mgk_test_failing")(failing)
    model = _lm("mgk")
    with pytest.raises(CompileError) as err:
        model.generate(torch.randint(0, V, (1, 4)), 3, compile="mgk_test_failing")
    assert "\n" not in str(err.value) and str(err.value).startswith("compile='mgk_test_failing': torch.compile failed")


def test_past_the_recompilation_limit_a_generation_goes_on_eagerly_with_a_warning():
    """Each new capacity compiles again; past torch's limit (here 2) fullgraph=True would fail hard: the step warns
    and decodes eagerly instead, with the same tokens (a helper's report)."""
    model = _lm("softmax", layers=1)
    idx = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in (3, 4):
            model.generate(idx, n, temperature=0, compile="aot_eager")
        with pytest.warns(UserWarning, match="recompilation limit"):
            got = model.generate(idx, 6, temperature=0, compile="aot_eager")
    assert torch.equal(got, model.generate(idx, 6, temperature=0))


def test_the_compile_error_lists_every_backend_it_accepts():
    with pytest.raises(ValueError, match="aot_eager"):
        check_compile("nope")
