"""Run by test_ddp_dropout.py under torchrun: ``mgk train ARGS`` with every attention-dropout draw of the fused
kernel recorded. Usage: ``ddp_dropout_worker.py RECORD_DIR STOP_AFTER ARGS...``.

Each rank writes the (step, seed, offset) of its draws (``draw_dropout_seed``, one per attention call in training)
to ``RECORD_DIR/rank<r>.json``. With ``STOP_AFTER`` > 0 every rank asks for a graceful stop after that step, as a
SIGINT would (last.pt written, exit status 130, mapped to 0 here so that torchrun succeeds)."""
import json
import os
import signal
import sys
from pathlib import Path

from mgk import cli
from mgk.functional import _mixture_flash
from mgk.train.loop import Trainer


def main(record_dir: str, stop_after: int, args: list[str]) -> int:
    draws, trainer = [], {}
    draw = _mixture_flash.draw_dropout_seed

    def recorded():
        seed, offset = draw()
        draws.append([trainer["self"].state.step, seed, offset])
        return seed, offset

    train_step, after_step = Trainer.train_step, Trainer._after_step

    def step(self):
        trainer["self"] = self
        return train_step(self)

    def after(self, *a):
        after_step(self, *a)
        if self.state.step == stop_after:
            self.stop.signum = signal.SIGINT

    _mixture_flash.draw_dropout_seed, Trainer.train_step, Trainer._after_step = recorded, step, after
    code = cli.main(args)
    rank = int(os.environ["RANK"])
    (Path(record_dir) / f"rank{rank}.json").write_text(json.dumps(draws))
    return 0 if stop_after and code == 128 + signal.SIGINT else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
