"""Converting trained attention layers into other kinds: reading a layer (torch's, mgk's, or a Hugging Face one read by
:mod:`mgk.integrations.hf`) into an :class:`AttentionSource`, the rules for fewer heads (merge, pool, prune, slice:
:mod:`.regroup`) and the head measures that choose them (:mod:`.head_measures`), each kind's own rule and the exact
scale (:mod:`.layers`), and a swap that a refusal undoes (:mod:`.rollback`). Below :mod:`mgk.integrations.hf`, which
uses them; the entry points above it are :func:`mgk.swap_attention`, ``mgk train --init-from`` (:mod:`mgk.retrofit`)
and ``mgk convert`` (:mod:`mgk.recovery`)."""
from .layers import CONVERSION_KEY_SCALE, AttentionSource, convert_module, convert_source, load_conversion, swap_plan

__all__ = ["AttentionSource", "CONVERSION_KEY_SCALE", "convert_module", "convert_source", "load_conversion",
           "swap_plan"]
