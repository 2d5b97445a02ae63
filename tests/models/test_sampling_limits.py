"""The next-token draw at the edges of its arguments: any temperature > 0, however small, is a valid draw (the most
likely token, as greedy), and scores that are not finite (a model whose weights went NaN) are an error naming
``log_probs``, never a silent token 0 from argmax."""
from __future__ import annotations

import pytest
import torch

from mgk.models.sampling import next_token


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 1e-300, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_tiny_temperature_draws_the_most_likely_token(temperature, dtype):
    g = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(64, 50, generator=g), dim=-1).to(dtype)
    log_probs[torch.arange(64), torch.randint(0, 50, (64,), generator=g)] = 0.5  # one most likely token per row
    got = next_token(log_probs, temperature=temperature, generator=g)
    assert torch.equal(got, log_probs.argmax(dim=-1))
    got = next_token(log_probs, temperature=temperature, top_k=3, top_p=0.5, generator=g)
    assert torch.equal(got, log_probs.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", ["nan", "all -inf"])
def test_non_finite_scores_are_an_error_naming_log_probs(temperature, bad):
    log_probs = torch.log_softmax(torch.randn(3, 10), dim=-1)
    if bad == "nan":
        log_probs[1, 4] = float("nan")
    else:
        log_probs[2] = float("-inf")
    with pytest.raises(ValueError, match="^log_probs has NaN or a row without a finite entry"):
        next_token(log_probs, temperature=temperature)


def test_impossible_tokens_stay_impossible_and_a_row_with_one_finite_entry_draws_it():
    log_probs = torch.full((5, 8), float("-inf"))
    log_probs[torch.arange(5), torch.tensor([0, 3, 7, 2, 2])] = -50.0
    for t in (0.0, 1e-40, 1.0, 100.0):
        assert next_token(log_probs, temperature=t, generator=torch.Generator().manual_seed(1)).tolist() == \
            [0, 3, 7, 2, 2]
