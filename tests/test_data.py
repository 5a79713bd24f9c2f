"""Tests of minimegatron.data: tokenizers, the .bin/.idx format, preprocessing, samples, batches.

Expected values come from outside the code under test: UTF-8 itself, Megatron-LM's documented
index layout (parsed here with ``struct``), streams rebuilt here from the raw documents, and
Megatron's sampler arithmetic worked out by hand.
"""

import json
import os
import pickle
from pathlib import Path
import struct

import numpy as np
import pytest
import torch

from minimegatron.data import (BPETokenizer, ByteTokenizer, DataError, GPTDataset,
                               IndexedDataset, IndexedDatasetBuilder, batch_for_step,
                               build_default_corpus, build_tokenizer, global_sample_indices,
                               preprocess_jsonl, train_valid_split)
from minimegatron.data import corpus as corpus_module

TEXT = "Grüße, 世界! naïve café — emoji 🙂 and tabs\tand\nnewlines <eod> literal"

# ----------------------------------------------------------------------------- tokenizers


def _load_tool():
    """tools/preprocess_data.py, the command line (not a package module: loaded by path)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "tools" / "preprocess_data.py"
    spec = importlib.util.spec_from_file_location("preprocess_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_data = _load_tool()


def test_byte_tokenizer_is_utf8_plus_eod():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eod == 256
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))      # the definition: ids are the UTF-8 bytes
    assert tok.decode(ids) == TEXT
    assert 256 not in ids                         # "<eod>" written in text is not the eod id
    assert tok.decode([104, 256, 105]) == "h<eod>i"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"   # a cut-off 3-byte character is replaced
    with pytest.raises(ValueError, match="257"):
        tok.decode([257])
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_bpe_train_save_load_round_trip(tmp_path):
    corpus = ["the quick brown fox jumps over the lazy dog. " * 4,
              "tokenizers merge frequent byte pairs into new tokens. " * 4,
              "the model reads the tokens, the model predicts the next token. " * 4] * 5
    path = tmp_path / "tok" / "bpe.json"
    trained = BPETokenizer.train(corpus, vocab_size=320, path=path)
    assert path.is_file()
    loaded = BPETokenizer.load(path)
    assert isinstance(build_tokenizer(str(path)), BPETokenizer)
    assert 257 < loaded.vocab_size <= 320          # merges were learned, none beyond the target
    assert loaded.vocab_size == trained.vocab_size and loaded.eod == trained.eod
    for text in corpus[:3] + [TEXT, "", "unseen ∑ symbols ✓"]:
        ids = loaded.encode(text)
        assert ids == trained.encode(text)
        assert all(0 <= i < loaded.vocab_size for i in ids)
        assert loaded.decode(ids) == text          # byte-level: every string round-trips
        assert loaded.eod not in ids               # even the literal text "<eod>"
    # merges compress the text they were trained on
    assert len(loaded.encode(corpus[0])) < len(corpus[0].encode("utf-8")) / 2
    assert loaded.decode([loaded.eod]) == "<eod>"


def test_bpe_errors(tmp_path):
    with pytest.raises(DataError, match="missing.json"):
        BPETokenizer.load(tmp_path / "missing.json")
    with pytest.raises(DataError, match="nope.json"):
        build_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ this is not a tokenizer")
    with pytest.raises(DataError, match="bad.json"):
        BPETokenizer.load(bad)
    with pytest.raises(ValueError, match="257"):
        BPETokenizer.train(["abc"], vocab_size=100, path=tmp_path / "small.json")

# ----------------------------------------------------------------------- indexed dataset


def random_docs(rng, n, high, max_len=300):
    lengths = [0, 1] + list(rng.integers(1, max_len, size=n - 2))
    return [rng.integers(0, high, size=int(n_)).tolist() for n_ in lengths]


def write_dataset(prefix, docs, dtype):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for d in docs:
            builder.add_document(d)
    return str(prefix)


@pytest.mark.parametrize("dtype,high,code", [(np.uint16, 65500, 8), (np.int32, 1_000_000, 4)])
def test_indexed_dataset_round_trip_and_megatron_layout(tmp_path, dtype, high, code):
    docs = random_docs(np.random.default_rng(0), 12, high)
    prefix = write_dataset(tmp_path / "sub" / "ds", docs, dtype)
    assert sorted(os.listdir(tmp_path / "sub")) == ["ds.bin", "ds.idx"]   # no temporaries left

    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds[-1].tolist() == docs[-1]
    assert len(pickle.dumps(ds)) < 500            # pickles as its prefix, not its tokens
    assert pickle.loads(pickle.dumps(ds))[3].tolist() == docs[3]
    assert ds.get(5, 2, 3).tolist() == docs[5][2:5]
    assert ds.get(5, 4).tolist() == docs[5][4:]
    with pytest.raises(IndexError):
        ds[len(docs)]
    with pytest.raises(IndexError):
        ds.get(1, 0, 2)                           # document 1 has one token

    # The .idx layout of Megatron-LM's _IndexWriter, parsed independently of the reader.
    raw = open(f"{prefix}.idx", "rb").read()
    magic, version, dtype_code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version, dtype_code) == (b"MMIDIDX\x00\x00", 1, code)
    assert n_seq == len(docs) and n_doc == len(docs) + 1
    off = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off + 4 * n_seq)
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off + 12 * n_seq)
    assert len(raw) == off + 12 * n_seq + 8 * n_doc
    itemsize = np.dtype(dtype).itemsize
    assert list(lengths) == [len(d) for d in docs]
    assert list(pointers) == [itemsize * sum(len(d) for d in docs[:i]) for i in range(n_seq)]
    assert list(doc_idx) == list(range(n_seq + 1))
    # .bin: the documents back to back, little-endian, nothing else
    fmt = {np.uint16: "H", np.int32: "i"}[dtype]
    flat = [t for d in docs for t in d]
    assert open(f"{prefix}.bin", "rb").read() == struct.pack(f"<{len(flat)}{fmt}", *flat)


def test_builder_rejects_ids_that_do_not_fit_and_aborts_cleanly(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder:
            builder.add_document([1, 2, 3])
            builder.add_document([70_000])
    assert os.listdir(tmp_path) == []             # aborted: neither final nor temporary files


@pytest.fixture
def small_pair(tmp_path):
    return write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5], [6, 7, 8, 9]], np.uint16)


def test_token_ids_beyond_the_vocabulary_are_refused_when_the_dataset_is_opened(tmp_path):
    """A .bin tokenized with a larger vocabulary than the model's: refused at open, naming the
    file, the id, its document and the vocabulary (the embedding would raise IndexError later)."""
    prefix = tmp_path / "big"
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([1, 2, 256])            # fits a byte-level vocabulary of 257
        builder.add_document([])                     # an empty document does not shift the count
        builder.add_document([5, 300, 7])            # 300 does not
    with pytest.raises(DataError, match=r"big\.bin: token id 300 \(document 2\) is outside the model's "
                                        r"vocabulary \[0, 257\)") as info:
        IndexedDataset(prefix, vocab_size=257)
    assert "vocab_size >= 301" in str(info.value)
    assert IndexedDataset(prefix, vocab_size=301).num_tokens == 6     # 301 rows hold id 300
    assert IndexedDataset(prefix).num_tokens == 6                     # no vocabulary: no check


def test_missing_files(small_pair):
    for ext in ("bin", "idx"):
        os.rename(f"{small_pair}.{ext}", f"{small_pair}.{ext}.away")
        with pytest.raises(DataError, match=rf"ds\.{ext}.*not found"):
            IndexedDataset(small_pair)
        os.rename(f"{small_pair}.{ext}.away", f"{small_pair}.{ext}")
    IndexedDataset(small_pair)


def patch_bytes(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_magic_and_version(small_pair):
    idx = f"{small_pair}.idx"
    original = open(idx, "rb").read()
    patch_bytes(idx, 0, b"NOTMAGIC!")
    with pytest.raises(DataError, match=r"ds\.idx.*magic"):
        IndexedDataset(small_pair)
    open(idx, "wb").write(original)
    patch_bytes(idx, 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"ds\.idx.*version 2"):
        IndexedDataset(small_pair)


def test_truncated_files(small_pair):
    bin_, idx = f"{small_pair}.bin", f"{small_pair}.idx"
    original_idx = open(idx, "rb").read()
    open(idx, "wb").write(original_idx[:-8])
    with pytest.raises(DataError, match=r"ds\.idx.*truncated"):
        IndexedDataset(small_pair)
    open(idx, "wb").write(original_idx[:20])
    with pytest.raises(DataError, match=r"ds\.idx.*truncated"):
        IndexedDataset(small_pair)
    open(idx, "wb").write(original_idx)
    os.truncate(bin_, os.path.getsize(bin_) - 2)  # one uint16 token short
    with pytest.raises(DataError, match=r"ds\.bin.*truncated"):
        IndexedDataset(small_pair)

# ---------------------------------------------------------------------------- preprocess


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_preprocess_jsonl(tmp_path):
    texts = ["first document", "zweites Dokument: äöü", "", "4th: 世界"]
    src = write_jsonl(tmp_path / "c.jsonl",
                      [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)] + [""])
    tok = ByteTokenizer()
    ds = IndexedDataset(preprocess_jsonl(src, tmp_path / "out" / "c", "byte"))
    assert len(ds) == len(texts) and ds.dtype == np.uint16    # the blank line is skipped
    for i, t in enumerate(texts):
        assert ds[i].tolist() == list(t.encode("utf-8")) + [256]
    ds = IndexedDataset(preprocess_jsonl(src, tmp_path / "noeod", tok, append_eod=False))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in texts]


@pytest.mark.parametrize("bad_line,problem", [
    ('{"text": "ok"', "invalid JSON"),
    ('{"body": "no text here"}', 'missing "text"'),
    ('{"text": 42}', "must be a string"),
    ('["text"]', "JSON object"),
])
def test_preprocess_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    src = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', "", bad_line, '{"text": "b"}'])
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: .*{problem}"):
        preprocess_jsonl(src, tmp_path / "out", "byte")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]      # nothing half-written


def test_preprocess_cli_with_bpe_training(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl",
                      [json.dumps({"text": f"document {i}: the cat sat on the mat. " * 3})
                       for i in range(30)])
    tok_path, prefix = tmp_path / "bpe.json", tmp_path / "out" / "c"
    argv = ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(tok_path),
            "--train-bpe", "300", "--append-eod", "--no-progress"]
    assert preprocess_data.main(argv) == 0
    assert "30 documents" in capsys.readouterr().out
    tok = BPETokenizer.load(tok_path)
    ds = IndexedDataset(prefix)
    assert tok.decode(ds[7].tolist()) == "document 7: the cat sat on the mat. " * 3 + "<eod>"
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', "{oops"])
    assert preprocess_data.main(["--input", str(bad), "--output-prefix", str(prefix),
                                   "--no-progress"]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err

# --------------------------------------------------------------------------- GPT dataset


@pytest.fixture
def unique_tokens(tmp_path):
    """Documents whose tokens are all distinct (token = its position in the file), so a
    window's first token tells where in a stream it came from."""
    lengths = [5, 17, 1, 40, 9, 0, 23, 12, 31, 8, 3, 50]
    starts = np.cumsum([0] + lengths)
    docs = [list(range(starts[i], starts[i + 1])) for i in range(len(lengths))]
    return IndexedDataset(write_dataset(tmp_path / "u", docs, np.int32)), docs


def test_gpt_samples_are_windows_of_the_shuffled_stream(unique_tokens):
    indexed, docs = unique_tokens
    s = 7
    ds = GPTDataset(indexed, seq_length=s, seed=3)
    assert sorted(ds.doc_order.tolist()) == list(range(len(docs)))
    stream = [t for d in ds.doc_order for t in docs[d]]
    assert stream != sorted(stream)                       # the documents were shuffled
    assert len(ds) == (len(stream) - 1) // s              # windows of s+1 sharing one token
    windows = []
    for i in range(len(ds)):
        x = ds[i]
        assert x["tokens"].dtype == torch.int64 and x["tokens"].shape == (s,)
        assert torch.equal(x["labels"][:-1], x["tokens"][1:])
        p = stream.index(int(x["tokens"][0]))
        assert p % s == 0
        assert x["tokens"].tolist() == stream[p:p + s]
        assert x["labels"].tolist() == stream[p + 1:p + s + 1]
        windows.append(p // s)
    assert sorted(windows) == list(range(len(ds)))        # every window exactly once
    assert windows != sorted(windows)                     # ... in a shuffled order


def test_gpt_dataset_is_seeded(unique_tokens):
    indexed, _ = unique_tokens

    def all_tokens(seed):
        ds = GPTDataset(indexed, seq_length=5, seed=seed)
        return torch.stack([ds[i]["tokens"] for i in range(len(ds))])

    assert torch.equal(all_tokens(11), all_tokens(11))
    assert not torch.equal(all_tokens(11), all_tokens(12))


def test_splits(unique_tokens):
    indexed, docs = unique_tokens
    (t0, t1), (v0, v1) = train_valid_split(indexed, valid_fraction=0.25)
    assert (t0, t1, v0, v1) == (0, 9, 9, 12)              # the last quarter of 12 documents
    valid = GPTDataset(indexed, seq_length=4, seed=0, split=(v0, v1))
    assert sorted(valid.doc_order.tolist()) == [9, 10, 11]
    valid_tokens = {t for d in docs[9:] for t in d}
    for i in range(len(valid)):
        assert set(valid[i]["tokens"].tolist()) <= valid_tokens
    half = GPTDataset(indexed, seq_length=4, seed=0, split=(0.0, 0.5))
    assert sorted(half.doc_order.tolist()) == list(range(6))
    with pytest.raises(DataError, match="seq_length=64"):
        GPTDataset(indexed, seq_length=64, seed=0, split=(9, 11))   # 11 tokens
    with pytest.raises(DataError, match="11 tokens"):
        GPTDataset(indexed, seq_length=64, seed=0, split=(9, 11))
    with pytest.raises(ValueError):
        GPTDataset(indexed, seq_length=4, seed=0, split=(5, 5))

# ------------------------------------------------------------------------ batch_for_step


def test_global_sample_indices_follow_megatron_sampler():
    # step 1 with b=2, M=2 microbatches, D=2 ranks: G=8, the step owns samples 8..15; each
    # microbatch takes b*D=4 of them in order, and rank r the r-th slice of b within that.
    expected = {(0, 0): [8, 9], (0, 1): [10, 11], (1, 0): [12, 13], (1, 1): [14, 15]}
    for (m, r), indices in expected.items():
        assert global_sample_indices(1, 2, m, 2, dp_rank=r, dp_size=2) == indices
    with pytest.raises(ValueError, match="dp_rank=2"):
        global_sample_indices(0, 2, 0, 2, dp_rank=2, dp_size=2)


def test_batch_for_step_dp_and_accumulation_union_to_global_batch(unique_tokens):
    indexed, _ = unique_tokens
    ds = GPTDataset(indexed, seq_length=4, seed=5)
    b, M, D = 2, 2, 2
    G = b * M * D
    for step in (0, 1, 3, 7):                             # step 7 wraps past the first epoch
        single = batch_for_step(ds, step, micro_batch_size=G, microbatch_index=0,
                                grad_accum_steps=1)
        parts = [batch_for_step(ds, step, b, m, M, dp_rank=r, dp_size=D)
                 for m in range(M) for r in range(D)]
        assert parts[0]["tokens"].shape == (b, 4)
        for key in ("tokens", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), single[key])


def test_batch_for_step_epochs(unique_tokens):
    indexed, _ = unique_tokens
    ds = GPTDataset(indexed, seq_length=4, seed=5)
    n = len(ds)
    rows = [batch_for_step(ds, g, 1, 0, 1)["tokens"][0] for g in range(2 * n)]
    first_epoch = {tuple(r.tolist()) for r in rows[:n]}
    assert len(first_epoch) == n                           # each sample once per epoch
    for g in range(n):                                     # then the next epoch starts over
        assert torch.equal(rows[g], rows[g + n])
    # resuming at step k needs no history: a fresh dataset object gives the same batch
    again = GPTDataset(indexed, seq_length=4, seed=5)
    assert torch.equal(batch_for_step(again, 9, 1, 0, 1)["tokens"][0], rows[9])

# -------------------------------------------------------------------------------- corpus


def test_default_corpus_builds_and_is_cached(tmp_path, monkeypatch):
    prefix = build_default_corpus(tmp_path / "corpus")
    ds = IndexedDataset(prefix)
    assert ds.num_tokens > 20_000 and len(ds) > 50
    assert all(ds[i][-1] == 256 for i in range(len(ds)))   # every document ends with <eod>
    text = ByteTokenizer().decode(ds[0].tolist())
    assert text.endswith("<eod>") and "\n\n" not in text   # one paragraph per document
    stamps = {ext: os.stat(f"{prefix}.{ext}").st_mtime_ns for ext in ("bin", "idx")}

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(corpus_module, "preprocess_jsonl", must_not_run)
    assert build_default_corpus(tmp_path / "corpus") == prefix
    assert stamps == {ext: os.stat(f"{prefix}.{ext}").st_mtime_ns for ext in ("bin", "idx")}


def test_corpus_sources_order_paragraphs_and_rebuild(tmp_path):
    root = tmp_path / "repo"
    files = {"minimegatron/b.py": "import os\n\n\ndef f():\n    return 1\n",
             "chapters/01/README.md": "# One\n\nPara two\nline two.\n   \nPara three.\n",
             "README.md": "Top.\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "minimegatron" / "notes.txt").write_text("not a source")
    frozen = corpus_module.freeze_corpus(root, tmp_path / "frozen.jsonl.gz")
    prefix = build_default_corpus(tmp_path / "cache", frozen=frozen)
    lines = [json.loads(x) for x in open(f"{prefix}.jsonl")]
    # sorted by relative path: "README.md" < "chapters/..." < "minimegatron/..."
    assert [(x["source"], x["text"]) for x in lines] == [
        ("README.md", "Top."),
        ("chapters/01/README.md", "# One"),
        ("chapters/01/README.md", "Para two\nline two."),
        ("chapters/01/README.md", "Para three."),
        ("minimegatron/b.py", "import os"),
        ("minimegatron/b.py", "def f():\n    return 1"),
    ]
    assert IndexedDataset(prefix)[1].tolist() == list(b"# One") + [256]
    (root / "README.md").write_text("Changed.\n")            # a source changed: the snapshot did not
    build_default_corpus(tmp_path / "cache", frozen=frozen)
    assert IndexedDataset(prefix)[0].tolist() == list(b"Top.") + [256]
    corpus_module.freeze_corpus(root, frozen)                # a new snapshot: rebuilt
    build_default_corpus(tmp_path / "cache", frozen=frozen)
    assert IndexedDataset(prefix)[0].tolist() == list(b"Changed.") + [256]


def test_the_default_corpus_is_the_frozen_snapshot_not_the_live_files(tmp_path, monkeypatch):
    """Editing a chapter must not move the losses the book records: the default corpus reads
    only book_corpus.jsonl.gz, never the repository's files."""
    def must_not_read(*args, **kwargs):
        raise AssertionError("the default corpus read the live sources")

    monkeypatch.setattr(corpus_module, "corpus_sources", must_not_read)
    prefix = build_default_corpus(tmp_path / "corpus")
    sources = {json.loads(x)["source"] for x in open(f"{prefix}.jsonl")}
    assert "chapters/00_single_device/README.md" in sources and "minimegatron/model/gpt.py" in sources
