"""Three sequences packed into one row as transformers' ``DataCollatorWithFlattening`` packs them, and what each
gives alone: the fixtures of the packed-batch tests (cu_seq_lens and position_ids alike)."""
import torch

LENGTHS = (3, 5, 4)  # three sequences packed into one row of 12 tokens


def sequences(vocab: int = 40) -> list[list[int]]:
    """The token ids of the three sequences (seeded)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def packed(seqs, **collator) -> dict:
    """The collator's batch of ``seqs`` without labels: input_ids and position_ids (1, 12), with
    ``return_flash_attn_kwargs=True`` also cu_seq_lens_q/k int32 (4,) and max_length_q/k."""
    import transformers

    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": s} for s in seqs])
    batch.pop("labels")
    return batch


def alone(model, seqs) -> torch.Tensor:
    """The logits of each sequence called alone, concatenated along the length: (1, 12, vocab)."""
    return torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits for s in seqs], dim=1)
