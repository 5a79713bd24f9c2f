"""GPT training samples: fixed-length windows over a shuffled stream of documents.

1. Document order: the split's documents [start_doc, end_doc), shuffled with the seed, laid end
   to end (each ends with <eod>) form one token stream; ``doc_order[k]`` is its k-th document.
2. Windows: window w is stream[w s : w s + s + 1] (s = seq_length); consecutive windows share
   one token, N stream tokens give (N - 1) // s windows, the tail is dropped. Windows cross
   document boundaries; only their pieces are read from the memory-mapped .bin.
3. Sample order: sample i is window ``sample_order[i]``, a second seeded permutation.

``dataset[i]`` is {"tokens": LongTensor[s], "labels": LongTensor[s]}, labels[t] == tokens[t + 1];
``document_masks`` adds Megatron's per-document "position_ids", "document_ids", "loss_mask"
(chapter 07) when asked.

Which samples each rank trains on: with b = micro_batch_size, M micro-batches, D = dp_size,
G = b M D, step k reads global indices [k G, (k+1) G); micro-batch m of dp rank r gets
[k G + (m D + r) b, k G + (m D + r + 1) b), index g being sample g % len(dataset) (a pure
function, so resume sees the same samples; Megatron's MegatronPretrainingSampler).
``train_valid_split`` gives the last documents (file order) to validation, like --split.

Megatron-LM: megatron/core/datasets/gpt_dataset.py (GPTDataset)."""

from __future__ import annotations

import numpy as np
import torch

from .errors import DataError
from .indexed_dataset import IndexedDataset


def resolve_split(split, num_docs: int) -> tuple[int, int]:
    """A split spec -> a document range ``(start_doc, end_doc)``, 0 <= start < end <= num_docs.

    split: None (all documents), ``(start_doc, end_doc)`` as ints, or ``(start_frac,
    end_frac)`` as floats in [0, 1], rounded to the nearest document boundary.
    """
    if split is None:
        start, end = 0, num_docs
    else:
        lo, hi = split
        if isinstance(lo, float) or isinstance(hi, float):
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"fraction split {split} must satisfy 0 <= start <= end <= 1")
            start, end = round(lo * num_docs), round(hi * num_docs)
        else:
            start, end = int(lo), int(hi)
    if not 0 <= start < end <= num_docs:
        raise ValueError(f"split {split} gives documents [{start}, {end}), which is not a "
                         f"non-empty range inside [0, {num_docs})")
    return start, end


def train_valid_split(indexed: IndexedDataset, valid_fraction: float = 0.1) -> tuple[tuple[int, int], tuple[int, int]]:
    """Document ranges ``(train, valid)``: the last documents (at least one) go to validation.

    Deterministic and seed-free: ``train == (0, n - v)`` and ``valid == (n - v, n)`` with
    v = max(1, round(n * valid_fraction)). valid_fraction == 0 gives an empty valid range.
    """
    n = len(indexed)
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    n_valid = 0 if valid_fraction == 0 else max(1, round(n * valid_fraction))
    if n - n_valid < 1:
        raise DataError(f"{indexed.prefix}: {n} documents cannot be split into train and "
                        f"valid with valid_fraction={valid_fraction}")
    return (0, n - n_valid), (n - n_valid, n)


def document_masks(tokens: torch.Tensor, eod: int, reset_position_ids: bool = False,
                   reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict[str, torch.Tensor]:
    """Megatron's per-document masks for tokens [s] or [b, s] (a document starts after each `eod`
    and at the window's start); only the keys asked for:

      "position_ids"  [.., s] int64, reset_position_ids: t minus the start of t's document
      "document_ids"  [.., s] int64, reset_attention_mask: the number of `eod`s before t (a query
                      attends within its document: the block-diagonal causal mask)
      "loss_mask"     [.., s] float32, eod_mask_loss: 0 where the input is `eod`
    Megatron: gpt_dataset.py, _get_ltor_masks_and_position_ids."""
    is_eod = (tokens == eod).long()                                          # [.., s]
    out = {}
    document = is_eod.cumsum(-1) - is_eod                                    # [.., s] eods strictly before t
    if reset_attention_mask:
        out["document_ids"] = document
    if reset_position_ids:
        positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)   # [.., s]
        starts = torch.where(document != document.roll(1, -1), positions, torch.zeros_like(positions))
        starts[..., 0] = 0
        out["position_ids"] = positions - starts.cummax(-1).values           # [.., s]
    if eod_mask_loss:
        out["loss_mask"] = 1.0 - is_eod.float()
    return out


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens (+ shifted labels) from a document range, seeded.
    numpy int64 attributes: doc_order[k] (the stream's k-th document), doc_starts[k] (its stream
    position; doc_starts[-1] = num_tokens), sample_order[i] (the window that is sample i)."""

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int, split=None, eod: int | None = None,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, eod_mask_loss: bool = False):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be positive")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.split = resolve_split(split, len(indexed))
        self.masks = dict(reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                          eod_mask_loss=eod_mask_loss)
        if any(self.masks.values()) and eod is None:
            raise ValueError("reset_position_ids, reset_attention_mask and eod_mask_loss need the tokenizer's eod id")
        self.eod = eod

        # Two independent streams of randomness from one seed: the document order must not
        # change when only the sample shuffle changes, and vice versa.
        doc_rng = np.random.default_rng([seed, 0])
        sample_rng = np.random.default_rng([seed, 1])

        start, end = self.split
        self.doc_order = doc_rng.permutation(np.arange(start, end, dtype=np.int64))
        lengths = indexed.sequence_lengths[self.doc_order].astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.doc_starts[-1])
        if self.num_tokens < seq_length + 1:
            raise DataError(f"{indexed.prefix}: documents [{start}, {end}) hold "
                            f"{self.num_tokens} tokens, but one sample of seq_length="
                            f"{seq_length} needs {seq_length + 1}; use a smaller seq_length or more data")
        num_windows = (self.num_tokens - 1) // seq_length
        self.sample_order = sample_rng.permutation(num_windows).astype(np.int64)

    def __len__(self) -> int:
        return len(self.sample_order)

    def stream(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the document stream, as int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"stream range [{start}, {start + length}) outside [0, {self.num_tokens})")
        out = np.empty(length, dtype=np.int64)
        # k = the stream position of the document that contains token `start`
        # (side="right" skips empty documents, which start where the next one does)
        k = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        pos, filled = start, 0
        while filled < length:
            n = min(length - filled, int(self.doc_starts[k + 1]) - pos)
            offset = pos - int(self.doc_starts[k])
            out[filled:filled + n] = self.indexed.get(int(self.doc_order[k]), offset, n)
            filled, pos, k = filled + n, pos + n, k + 1
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: {"tokens": LongTensor[s], "labels": LongTensor[s]}, and document_masks'
        keys when a switch asks for them."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        s = self.seq_length
        window = torch.from_numpy(self.stream(int(self.sample_order[i]) * s, s + 1))
        sample = {"tokens": window[:-1], "labels": window[1:]}
        if any(self.masks.values()):
            sample.update(document_masks(sample["tokens"], self.eod, **self.masks))
        return sample

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.prefix!r}, documents {self.split}, "
                f"seq_length={self.seq_length}, seed={self.seed}: {len(self)} samples from {self.num_tokens} tokens)")


def global_sample_indices(step: int, micro_batch_size: int, microbatch_index: int,
                          grad_accum_steps: int, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
    """[k G + (m D + r) b, k G + (m D + r + 1) b) as a list for (step k, microbatch m, dp_rank r), G = b M D."""
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("grad_accum_steps", grad_accum_steps), ("dp_size", dp_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if not 0 <= microbatch_index < grad_accum_steps:
        raise ValueError(f"microbatch_index={microbatch_index} must be in [0, grad_accum_steps={grad_accum_steps})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    global_batch = micro_batch_size * grad_accum_steps * dp_size
    start = step * global_batch + (microbatch_index * dp_size + dp_rank) * micro_batch_size
    return list(range(start, start + micro_batch_size))


def batch_for_step(dataset: GPTDataset, step: int, micro_batch_size: int,
                   microbatch_index: int, grad_accum_steps: int, dp_rank: int = 0,
                   dp_size: int = 1) -> dict[str, torch.Tensor]:
    """Micro-batch ``microbatch_index`` of dp rank ``dp_rank`` at ``step``: {"tokens", "labels":
    LongTensor[b, s]} (+ the dataset's document masks, [b, s] each), row j being sample
    ``global_sample_indices(...)[j] % len(dataset)``."""
    indices = global_sample_indices(step, micro_batch_size, microbatch_index, grad_accum_steps, dp_rank, dp_size)
    samples = [dataset[g % len(dataset)] for g in indices]
    return {key: torch.stack([x[key] for x in samples]) for key in samples[0]}


__all__ = ["GPTDataset", "train_valid_split", "global_sample_indices", "batch_for_step", "document_masks"]
