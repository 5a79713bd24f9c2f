"""Tokenize a JSONL corpus into an indexed dataset (PREFIX.bin + PREFIX.idx): the command line
over minimegatron.data.preprocess_jsonl, where Megatron-LM keeps its own (tools/preprocess_data.py).

    # byte tokenizer: nothing to train
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer byte --append-eod

    # byte-level BPE: --train-bpe VOCAB first trains a tokenizer with VOCAB ids on the same
    # JSONL and saves it at the --tokenizer path, then tokenizes with it
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer out/bpe.json --train-bpe 1024 --append-eod

    # later runs reuse the saved tokenizer: --tokenizer out/bpe.json without --train-bpe

Then train on it: python -m minimegatron.train --data-path out/corpus --tokenizer byte ...
Exit status 1, with the file and line named, for a line that is not a JSON object with a
string "text"; nothing is written then.
"""

from __future__ import annotations

import argparse
import sys

from minimegatron.data import BPETokenizer, DataError, IndexedDataset, build_tokenizer, preprocess_jsonl
from minimegatron.data.preprocess import iter_jsonl_texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/preprocess_data.py",
        description="Tokenize a JSONL corpus ({\"text\": ...} per line) into PREFIX.bin/.idx.")
    parser.add_argument("--input", required=True, help="JSONL file, one {\"text\": ...} per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or the path of a BPE tokenizer JSON")
    parser.add_argument("--train-bpe", type=int, metavar="VOCAB", default=None,
                        help="first train a byte-level BPE with VOCAB ids on --input and save it at the --tokenizer path")
    parser.add_argument("--append-eod", action="store_true", help="append the <eod> id after every document")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    try:
        if args.train_bpe is not None:
            if args.tokenizer == "byte":
                parser.error("--train-bpe needs --tokenizer PATH.json (where to save it)")
            tok = BPETokenizer.train(iter_jsonl_texts(args.input), args.train_bpe, args.tokenizer)
            print(f"trained {tok!r}")
        else:
            tok = build_tokenizer(args.tokenizer)
        prefix = preprocess_jsonl(args.input, args.output_prefix, tok, append_eod=args.append_eod,
                                  progress=not args.no_progress)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ds = IndexedDataset(prefix)
    print(f"wrote {prefix}.bin and {prefix}.idx: {len(ds)} documents, {ds.num_tokens} tokens "
          f"({ds.dtype}, vocab_size {tok.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
