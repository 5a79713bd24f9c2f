"""What packing documents saves on the book's own corpus: padding avoided, and the real tokens a
second one training process gets through, padded against packed (chapter 07).

    python benchmarks/bench_packing.py                  # s 256, h 128, 4 layers, b 4, one thread
    python benchmarks/bench_packing.py --seq 512
    python benchmarks/bench_packing.py --smoke          # tiny sizes, one short window

Two ways to fill rows of s tokens with the training split's documents (each ends with <eod>):

  padded   every document starts a row of its own: a document of n tokens takes ceil(n / s)
           rows, the last one padded (the pads masked out of the loss);
  packed   the documents end to end, rows cut every s tokens (the data pipeline's windows),
           with Megatron's --reset-position-ids --reset-attention-mask --eod-mask-loss so that
           each document still trains alone (data.document_masks, the model's
           document_attention).

The padding and the rows each needs are counted exactly (they depend on the corpus only). The
speed is measured: training steps (forward, backward, AdamW) on rows of each kind, the real
(non-padding) tokens per second of each. Timing as in bench_precision.py: warm-up steps, then
`--repeats` windows of `--steps` steps, the two kinds interleaved; the median window. A
measurement, not a test: nothing asserts a speed. The packed rows pay for a masked attention (a
boolean [s, s] mask per row instead of the kernel's own causal one).

Also counted, exactly, over every packed row of the corpus: the 16 x 16 score tiles the book's
Triton FlashAttention computes per head in its forward when it skips what lies outside each
document (kernels/flash_attention.py attention_tiles, the variable-length kernel's work),
against the causal kernel that visits every tile at or below the diagonal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimegatron.config import ModelConfig, TrainConfig          # noqa: E402
from minimegatron.data import (GPTDataset, IndexedDataset, build_default_corpus, build_tokenizer,  # noqa: E402
                               document_masks, train_valid_split)
from minimegatron.kernels.flash_attention import attention_tiles   # noqa: E402
from minimegatron.model import GPTModel, mean_loss                # noqa: E402
from minimegatron.optim import Optimizer                          # noqa: E402


@dataclass
class PackingResults:
    """What main printed: padding_counts; the tiles {rows, causal, documents}; per kind (padded,
    packed) the median step's seconds and the real tokens/s."""
    exit_code: int = 0
    counts: dict = field(default_factory=dict)
    tiles: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    rates: dict = field(default_factory=dict)


def padding_counts(lengths: np.ndarray, seq: int) -> dict:
    """Rows and padding of the two layouts for documents of `lengths` tokens in rows of `seq`."""
    tokens = int(lengths.sum())
    padded_rows = int(np.ceil(lengths / seq).sum())
    packed_rows = -(-tokens // seq)
    return {"documents": len(lengths), "tokens": tokens, "padded_rows": padded_rows, "packed_rows": packed_rows,
            "padding": 1 - tokens / (padded_rows * seq), "median_length": float(np.median(lengths))}


def padded_batch(dataset: GPTDataset, docs: list[int], seq: int, eod: int) -> dict:
    """One row per document (its first seq tokens), padded with eod, the pads' loss masked."""
    rows, masks = [], []
    for k in docs:
        doc = dataset.indexed.get(int(dataset.doc_order[k]))[:seq + 1].astype(np.int64)
        row = np.full(seq + 1, eod, dtype=np.int64)
        row[:len(doc)] = doc
        mask = np.zeros(seq, dtype=np.float32)
        mask[:len(doc) - 1] = 1.0
        rows.append(row)
        masks.append(mask)
    rows = torch.from_numpy(np.stack(rows))
    return {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.from_numpy(np.stack(masks))}


def packed_batch(dataset: GPTDataset, first: int, batch: int, seq: int, eod: int) -> dict:
    """`batch` consecutive windows of the document stream, with the three switches' masks."""
    windows = torch.stack([torch.from_numpy(dataset.stream((first + i) * seq, seq + 1)) for i in range(batch)])
    tokens = windows[:, :-1]
    return {"tokens": tokens, "labels": windows[:, 1:],
            **document_masks(tokens, eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)}


def step(model: GPTModel, optimizer: Optimizer, batch: dict) -> None:
    losses = model(batch["tokens"], position_ids=batch.get("position_ids"), labels=batch["labels"],
                   document_ids=batch.get("document_ids"))
    mean_loss(losses, batch.get("loss_mask")).backward()
    optimizer.step()
    optimizer.zero_grad()


def main(argv=None) -> PackingResults:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one short window (what the tests run)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seq, args.hidden, args.layers, args.batch, args.steps, args.repeats, args.warmup = 64, 32, 2, 2, 1, 1, 0
    torch.set_num_threads(1)
    torch.manual_seed(0)

    tokenizer = build_tokenizer("byte")
    indexed = IndexedDataset(build_default_corpus())
    train_docs, _ = train_valid_split(indexed, valid_fraction=0.1)
    dataset = GPTDataset(indexed, args.seq, seed=1234, split=train_docs)
    lengths = indexed.sequence_lengths[dataset.doc_order].astype(np.int64)
    c = padding_counts(lengths, args.seq)
    print(f"the book's corpus (training split, byte tokens): {c['documents']} documents, {c['tokens']:,} tokens, "
          f"median length {c['median_length']:.0f}")
    print(f"rows of s {args.seq}: padded {c['padded_rows']:,} rows ({c['padding']:.1%} of their tokens padding), "
          f"packed {c['packed_rows']:,} rows: {c['padded_rows'] / c['packed_rows']:.2f} x fewer rows packed")
    full_rows = (c["tokens"] - 1) // args.seq                      # every window of s + 1 tokens the stream holds
    ids = packed_batch(dataset, 0, full_rows, args.seq, tokenizer.eod)["document_ids"]
    causal, documents = attention_tiles(None, full_rows, args.seq), attention_tiles(ids, full_rows, args.seq)
    out = PackingResults(counts=c, tiles=dict(rows=full_rows, causal=causal, documents=documents))
    print(f"FlashAttention's 16 x 16 score tiles over the {full_rows:,} packed rows, per head: causal {causal:,}, "
          f"within documents {documents:,} ({1 - documents / causal:.1%} skipped)")

    model_cfg = ModelConfig.llama(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
                                  vocab_size=tokenizer.vocab_size, max_position_embeddings=args.seq)
    model = GPTModel(model_cfg)
    optimizer = Optimizer([model], TrainConfig(lr=1e-4, clip_grad=0.0, train_iters=10**6))
    docs = [k for k in range(len(lengths)) if lengths[k] > 1][:args.batch]
    batches = {"padded": padded_batch(dataset, docs, args.seq, tokenizer.eod),
               "packed": packed_batch(dataset, 0, args.batch, args.seq, tokenizer.eod)}
    # real tokens a row: the corpus's average over its padded rows; a packed row has no padding
    per_row = {"padded": c["tokens"] / c["padded_rows"], "packed": float(args.seq)}
    for _ in range(args.warmup):
        for batch in batches.values():
            step(model, optimizer, batch)
    windows = {kind: [] for kind in batches}
    for _ in range(args.repeats):
        for kind, batch in batches.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, optimizer, batch)
            windows[kind].append((time.perf_counter() - start) / args.steps)
    rates = out.rates
    for kind in batches:
        seconds = out.seconds[kind] = statistics.median(windows[kind])
        rates[kind] = per_row[kind] * args.batch / seconds
        print(f"  {kind:<7} {seconds * 1e3:8.1f} ms a step of {args.batch} rows, {per_row[kind]:6.1f} real tokens a "
              f"row on average: {rates[kind]:9,.0f} real tokens/s")
    print(f"packed / padded: {rates['packed'] / rates['padded']:.2f} x the real tokens/s (h {args.hidden}, "
          f"{args.layers} layers, one thread, this machine)")
    return out


if __name__ == "__main__":
    sys.exit(main().exit_code)
