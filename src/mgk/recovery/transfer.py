"""Recovery losses of a converted model against its frozen source (the teacher): local attention transfer, where each
converted attention layer learns to reproduce the source layer's output on the source's own hidden states, and an
end-to-end distillation of the next-token distributions.

Local transfer needs one forward of the teacher per batch: hooks on its attention modules record what each was called
with and what it returned; each student attention module is then called with the very same arguments (hidden
states, masks, rotary angles, all detached) and compared to the teacher's output. The layers are independent given
the teacher's activations, so an error in one does not feed the next (Ainslie et al.'s uptraining trains end to
end instead; MHA2MLA and X-EcoMLA-style recoveries start with such layer-local objectives)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AttentionPairs", "Captured", "attention_pairs", "distillation_loss", "local_transfer_loss"]


@dataclass
class Captured:
    """One attention call of the teacher: its positional and keyword arguments (tensors detached) and its output."""

    args: tuple
    kwargs: dict
    output: Tensor | None = None


class AttentionPairs:
    """The (path, teacher module, student module) of every attention layer, and the hooks that record the teacher's
    calls. Use as a context manager around the teacher's forward: :attr:`calls` then holds one :class:`Captured` per
    layer, in order."""

    def __init__(self, pairs: list[tuple[str, nn.Module, nn.Module]]):
        self.pairs, self.calls, self._hooks = pairs, {}, []

    def __enter__(self) -> "AttentionPairs":
        self.calls = {}
        for path, teacher, _ in self.pairs:
            self._hooks.append(teacher.register_forward_pre_hook(self._before(path), with_kwargs=True))
            self._hooks.append(teacher.register_forward_hook(self._after(path)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before(self, path: str):
        def record(module, args, kwargs):
            """Keep the call's arguments: the student layer is called with the same ones."""
            self.calls[path] = Captured(_detached(args), _detached(kwargs))
        return record

    def _after(self, path: str):
        def record(module, args, output):
            """Keep the layer's output (the first element of the tuple attention modules return)."""
            self.calls[path].output = (output[0] if isinstance(output, tuple) else output).detach()
        return record

    @property
    def students(self) -> nn.ModuleList:
        """The student attention modules, in layer order (what recovery trains)."""
        return nn.ModuleList([student for _, _, student in self.pairs])


def _detached(value):
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def attention_pairs(teacher: nn.Module, student: nn.Module) -> AttentionPairs:
    """The attention layers of ``student`` (a model :func:`mgk.swap_attention` converted: its
    :class:`~mgk.integrations.hf.HFAttention` modules) and the modules of ``teacher`` at the same paths. ValueError
    when the two models do not line up (a path of the student missing in the teacher)."""
    from ..integrations.hf import HFAttention

    teachers = dict(teacher.named_modules())
    pairs = []
    for path, module in student.named_modules():
        if isinstance(module, HFAttention):
            if path not in teachers:
                raise ValueError(f"the converted model's attention {path} has no counterpart in the source")
            pairs.append((path, teachers[path], module))
    if not pairs:
        raise ValueError("the converted model holds no mgk attention module (swap_attention was not applied)")
    return AttentionPairs(pairs)


def local_transfer_loss(students: nn.ModuleList, paths: list[str], calls: dict[str, Captured]) -> Tensor:
    """The mean over layers of each student layer's output MSE against the teacher layer's, each layer called with
    the teacher's own arguments (use_cache off: a training call)."""
    losses = []
    for path, student in zip(paths, students):
        call = calls[path]
        kwargs = {**call.kwargs, "use_cache": False}
        for name in ("past_key_values", "past_key_value", "cache", "layer_past"):
            kwargs.pop(name, None)
        out = student(*call.args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        losses.append(F.mse_loss(out.float(), call.output.float()))
    return torch.stack(losses).mean()


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) of the next-token distributions, averaged over positions: (B, L, V) logits each."""
    t = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, 1)
    s = F.log_softmax(student_logits.float(), dim=-1).flatten(0, 1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")
