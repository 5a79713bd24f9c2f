"""GPT training samples: fixed-length windows over a shuffled stream of documents.

A GPT is trained on sequences of exactly ``seq_length`` tokens, but documents have any length.
Megatron-LM's ``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``) resolves this the same
way this file does, in three steps:

1. **Document order.** The documents of the split, ``[start_doc, end_doc)`` of the indexed
   dataset, are shuffled with the seed. Laid end to end they form one token *stream*; every
   document already ends with ``<eod>`` (``preprocess --append-eod``), so the model can see the
   boundaries. ``doc_order[k]`` is the k-th document of the stream.

2. **Windows.** Window w is ``stream[w*s : w*s + s + 1]`` for s = seq_length: s + 1 tokens,
   because the model reads tokens ``[0, s)`` and predicts tokens ``[1, s + 1)``. Consecutive
   windows share one token (the last label of window w is the first input of window w + 1), so
   no token is wasted and a stream of N tokens gives ``(N - 1) // s`` full windows; the tail
   that does not fill a window is dropped. Windows cross document boundaries freely. Only the
   window's pieces are read from the memory-mapped ``.bin``; the stream is never materialized.

3. **Sample order.** Sample i is window ``sample_order[i]``, a second seeded permutation, so
   consecutive samples come from unrelated parts of the corpus.

``dataset[i]`` returns ``{"tokens": LongTensor[s], "labels": LongTensor[s]}`` with
``labels[t] == tokens[t + 1]`` for t < s - 1: labels are the tokens shifted left by one.

**Documents inside a window (chapter 07).** By default a window's documents see each other:
attention runs over the whole window and positions count from its start, as Megatron's
default does. Megatron's three switches (``--reset-position-ids``, ``--reset-attention-mask``,
``--eod-mask-loss``; its ``_get_ltor_masks_and_position_ids``) make each document of a window
train as if it were alone: ``document_masks`` adds ``"position_ids"`` (counting from 0 after
each ``<eod>``), ``"document_ids"`` (which document of the window each token is in; the model
attends only inside one) and ``"loss_mask"`` (0 where the input token is ``<eod>``).

**Which sample does each rank train on at each step?** ``batch_for_step`` is a pure function,
so a run resumed at step k sees exactly the samples the uninterrupted run saw. It follows
Megatron's ``MegatronPretrainingSampler``. With

    b = micro_batch_size, M = grad_accum_steps (microbatches per step), D = dp_size,
    G = b * M * D (the global batch size),

step k consumes the *global sample indices* ``[k*G, (k+1)*G)``, cut first by microbatch, then
by data-parallel rank: microbatch m of data-parallel rank r gets the b contiguous indices

    [k*G + (m*D + r)*b,  k*G + (m*D + r + 1)*b)

So, over all m and r, the step covers its G indices exactly once: the union over ranks and
microbatches equals the single-device (D = 1, M = 1, b = G) batch of the same step. Global
index g is sample ``g % len(dataset)``: when the dataset is exhausted the next epoch starts
over, with the same sample order.

Splits are by whole documents: ``train_valid_split`` gives the last ``valid_fraction`` of the
documents (in file order, before shuffling) to validation, as Megatron's ``--split`` does.
"""

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


def train_valid_split(indexed: IndexedDataset,
                      valid_fraction: float = 0.1) -> tuple[tuple[int, int], tuple[int, int]]:
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
    """Megatron's per-document masks for tokens [s] or [b, s] (the inputs, each document ending
    with `eod`): a document starts after each `eod` (and at the window's start).

      "position_ids"  [.., s] int64, reset_position_ids: t minus the start of t's document
      "document_ids"  [.., s] int64, reset_attention_mask: the number of `eod`s before t, so
                      a query attends to the keys of its own document only (the block-diagonal
                      causal mask; Megatron's THD format carries the same as cu_seqlens)
      "loss_mask"     [.., s] float32, eod_mask_loss: 0 where the input is `eod` (the
                      prediction of the next document's first token from the last one's end)
    Only the keys asked for. Megatron-LM: megatron/core/datasets/gpt_dataset.py,
    _get_ltor_masks_and_position_ids."""
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

    Attributes (all numpy int64):
      doc_order[k]     the k-th document of the stream (a permutation of the split's documents)
      doc_starts[k]    stream position where doc_order[k] begins; doc_starts[-1] = num_tokens
      sample_order[i]  the window (see module docstring) that is sample i
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int, split=None, eod: int | None = None,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, eod_mask_loss: bool = False):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be positive")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
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
                            f"{seq_length} needs {seq_length + 1}; use a smaller seq_length "
                            "or more data")
        num_windows = (self.num_tokens - 1) // seq_length
        self.sample_order = sample_rng.permutation(num_windows).astype(np.int64)

    def __len__(self) -> int:
        return len(self.sample_order)

    def stream(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the document stream, as int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"stream range [{start}, {start + length}) outside "
                             f"[0, {self.num_tokens})")
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
                f"seq_length={self.seq_length}, seed={self.seed}: {len(self)} samples "
                f"from {self.num_tokens} tokens)")


def global_sample_indices(step: int, micro_batch_size: int, microbatch_index: int,
                          grad_accum_steps: int, dp_rank: int = 0,
                          dp_size: int = 1) -> list[int]:
    """The global sample indices of (step, microbatch, dp_rank); see the module docstring.

    Returns ``range(k*G + (m*D + r)*b, k*G + (m*D + r + 1)*b)`` as a list, G = b*M*D.
    """
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("grad_accum_steps", grad_accum_steps), ("dp_size", dp_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if not 0 <= microbatch_index < grad_accum_steps:
        raise ValueError(f"microbatch_index={microbatch_index} must be in "
                         f"[0, grad_accum_steps={grad_accum_steps})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    global_batch = micro_batch_size * grad_accum_steps * dp_size
    start = step * global_batch + (microbatch_index * dp_size + dp_rank) * micro_batch_size
    return list(range(start, start + micro_batch_size))


def batch_for_step(dataset: GPTDataset, step: int, micro_batch_size: int,
                   microbatch_index: int, grad_accum_steps: int, dp_rank: int = 0,
                   dp_size: int = 1) -> dict[str, torch.Tensor]:
    """The microbatch ``microbatch_index`` of data-parallel rank ``dp_rank`` at ``step``.

    Returns {"tokens": LongTensor[b, s], "labels": LongTensor[b, s]} (and the dataset's document
    masks, [b, s] each), b = micro_batch_size, row j being sample
    ``global_sample_indices(...)[j] % len(dataset)``.
    """
    indices = global_sample_indices(step, micro_batch_size, microbatch_index,
                                    grad_accum_steps, dp_rank, dp_size)
    samples = [dataset[g % len(dataset)] for g in indices]
    return {key: torch.stack([x[key] for x in samples]) for key in samples[0]}


__all__ = ["GPTDataset", "train_valid_split", "resolve_split", "global_sample_indices",
           "batch_for_step", "document_masks"]
