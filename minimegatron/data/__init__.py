"""The data pipeline, from text to the [b, s] batches a training step consumes.

Read the files in this order; each is one concept:

  tokenizer.py        text <-> token ids (ByteTokenizer, BPETokenizer, build_tokenizer)
  indexed_dataset.py  token ids on disk: Megatron's .bin/.idx pair, memory-mapped
  preprocess.py       JSONL -> .bin/.idx (its command line: tools/preprocess_data.py)
  corpus.py           the default corpus: this repository's own text, cached in build/corpus
  gpt_dataset.py      fixed-length samples, shuffling, splits, and which samples each
                      (step, microbatch, data-parallel rank) trains on
  errors.py           DataError, raised for every bad input, naming the file

Typical use::

    from minimegatron.data import (IndexedDataset, GPTDataset, build_default_corpus,
                                   train_valid_split, batch_for_step)
    indexed = IndexedDataset(build_default_corpus())
    train_docs, valid_docs = train_valid_split(indexed, valid_fraction=0.1)
    train = GPTDataset(indexed, seq_length=64, seed=1234, split=train_docs)
    batch = batch_for_step(train, step=0, micro_batch_size=4, microbatch_index=0,
                           grad_accum_steps=1)          # {"tokens": [4, 64], "labels": [4, 64]}
"""


from .errors import DataError
from .gpt_dataset import GPTDataset, batch_for_step, document_masks, global_sample_indices, train_valid_split
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer

from .preprocess import preprocess_jsonl
from .corpus import build_default_corpus

__all__ = ["DataError", "ByteTokenizer", "BPETokenizer", "build_tokenizer", "IndexedDataset", "IndexedDatasetBuilder",
           "preprocess_jsonl", "build_default_corpus", "GPTDataset", "train_valid_split", "global_sample_indices",
           "batch_for_step", "document_masks"]
