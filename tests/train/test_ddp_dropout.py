"""Under torchrun, each rank draws its own attention-dropout masks (the trainer seeds rank r with
``seed * 7919 + r``), and a resumed run draws the same ones again (each rank's generator state is checkpointed)."""
import json
from pathlib import Path

import pytest
import torch

from mgk.functional import _mixture_flash

WORKER = Path(__file__).with_name("ddp_dropout_worker.py")


def _draws(record_dir):
    return [json.loads((record_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ranks_draw_different_dropout_masks_and_resume_draws_them_again(tmp_path, th):
    if not _mixture_flash.available(torch.empty(0), 0.1):
        pytest.skip(f"the C++ kernel (which draws the dropout seeds) is unavailable: {_mixture_flash.build_error()}")
    args = ["train", "--attention", "mgk", "--steps", "4",
            *th.sets(*th.TINY, "batch_size=4", "dropout=0.0", "attn_dropout=0.5", "eval_every=100",
                     "checkpoint_every=100")]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for d in (straight, stopped, tmp_path / "resumed"):
        d.mkdir()
    th.run_torchrun(2, [str(straight), "0", *args, "--out", str(tmp_path / "run1")], script=WORKER)
    rank0, rank1 = _draws(straight)
    layers = 2  # the TINY model's layers: one draw per attention call and step
    assert [s for s, _, _ in rank0] == [s for s, _, _ in rank1] == [s for s in range(4) for _ in range(layers)]
    seeds0, seeds1 = {(a, b) for _, a, b in rank0}, {(a, b) for _, a, b in rank1}
    assert len(seeds0) == len(seeds1) == len(rank0), "every call draws a new (seed, offset)"
    assert not seeds0 & seeds1, "the two ranks drew the same dropout stream"
    (_, s0, o0), (_, s1, o1) = rank0[0], rank1[0]
    mask0 = _mixture_flash.dropout_mask(s0, o0, 2, 4, 16, 16, 0.5)
    assert not torch.equal(mask0, _mixture_flash.dropout_mask(s1, o1, 2, 4, 16, 16, 0.5))
    assert torch.equal(mask0, _mixture_flash.dropout_mask(s0, o0, 2, 4, 16, 16, 0.5))

    # Stopped after step 2 (as by SIGINT) and resumed: each rank continues its own stream exactly.
    run2 = tmp_path / "run2"
    th.run_torchrun(2, [str(stopped), "2", *args, "--out", str(run2)], script=WORKER)
    th.run_torchrun(2, [str(tmp_path / "resumed"), "0", "train", "--resume", str(run2)], script=WORKER)
    for before, after, whole in zip(_draws(stopped), _draws(tmp_path / "resumed"), (rank0, rank1)):
        assert [s for s, _, _ in before] == [0, 0, 1, 1] and [s for s, _, _ in after] == [2, 2, 3, 3]
        assert before + after == whole
