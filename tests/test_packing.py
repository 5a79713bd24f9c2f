"""Documents packed into one window (chapter 07): Megatron's --reset-position-ids,
--reset-attention-mask and --eod-mask-loss (data/gpt_dataset.py document_masks, the model's
document_attention, model.mean_loss). With all three a document trains as if it were alone: its
logits equal the model's on that document by itself. Every layout the switches run on equals
one device with them."""

import dataclasses

import pytest
import torch

from minimegatron.arguments import parse_command_line
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.data import document_masks
from minimegatron.launch import spawn
from minimegatron.model import GPTModel, mean_loss
from minimegatron.parallelize import validate_layout
from minimegatron.testing import RunRecord, compare_runs, make_batches, single_device_run
from tests.workers import precision as W

EOD = 63
PACKED = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def test_the_masks_are_megatrons():
    """Worked by hand from Megatron's loop (_get_ltor_masks_and_position_ids): after the eod at
    input position i, positions restart at 0 and the keys up to i are masked; the loss is
    masked where the input is the eod."""
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, 1, 2, 3, 4, 5]])
    got = document_masks(tokens, EOD, **PACKED)
    assert got["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert got["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    assert got["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1]]
    assert set(document_masks(tokens, EOD, reset_position_ids=True)) == {"position_ids"}


def test_the_loss_is_the_mean_over_the_tokens_kept():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    assert mean_loss(losses).item() == 3.5
    assert mean_loss(losses, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])).item() == (1 + 3 + 6) / 3
    assert mean_loss(losses, torch.zeros(2, 3)).item() == 0.0


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_packed_document_is_computed_as_if_it_were_alone(style):
    cfg = getattr(ModelConfig, style)(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=64, vocab_size=64, max_position_embeddings=32,
                                      params_dtype="float64")
    model = GPTModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(0, EOD, (n - 1,), generator=g), torch.tensor([EOD])]) for n in (5, 7, 4)]
    packed = torch.cat(docs).unsqueeze(0)                                     # [1, 16]
    masks = document_masks(packed, EOD, reset_position_ids=True, reset_attention_mask=True)
    together = model(packed, position_ids=masks["position_ids"], document_ids=masks["document_ids"])[0]
    start = 0
    for doc in docs:
        alone = model(doc.unsqueeze(0))[0]                                    # positions 0.., nothing else
        torch.testing.assert_close(together[start:start + len(doc)], alone, rtol=0, atol=1e-12)
        start += len(doc)
    unpacked = model(packed)[0]                                               # Megatron's default: they mix
    assert not torch.allclose(unpacked[5:12], model(docs[1].unsqueeze(0))[0], atol=1e-6)


def test_the_switches_are_megatrons():
    _, cfg, _ = parse_command_line(["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"], world_size=1)
    assert (cfg.reset_position_ids, cfg.reset_attention_mask, cfg.eod_mask_loss) == (True, True, True)


def test_the_dataset_adds_the_masks_and_the_batches_carry_them(tmp_path):
    from minimegatron.data import GPTDataset, IndexedDataset, IndexedDatasetBuilder, batch_for_step
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix)
    for n in (5, 9, 3, 12, 7):
        builder.add_document(list(range(1, n)) + [EOD])
    builder.finalize()
    dataset = GPTDataset(IndexedDataset(prefix), 8, seed=0, eod=EOD, **PACKED)
    batch = batch_for_step(dataset, 0, 2, 0, 1)
    assert set(batch) == {"tokens", "labels", "position_ids", "document_ids", "loss_mask"}
    want = document_masks(batch["tokens"], EOD, **PACKED)
    for key, value in want.items():
        assert torch.equal(batch[key], value), key
    with pytest.raises(ValueError, match="need the tokenizer's eod id"):
        GPTDataset(IndexedDataset(prefix), 8, seed=0, reset_position_ids=True)


# ---------------------------------------------------------------------------------------
# every layout with packed documents equals one device with them
# ---------------------------------------------------------------------------------------
def _packed_batches(model, steps, rows, seq):
    out = []
    for batch in make_batches(model, steps, rows, seq, seed=1):
        tokens = batch["tokens"].clone()
        tokens[:, 5::7] = EOD                                                 # documents of 7 tokens
        labels = torch.cat([tokens[:, 1:], batch["labels"][:, -1:]], dim=1)
        out.append({"tokens": tokens, "labels": labels, **document_masks(tokens, EOD, **PACKED)})
    return out


def _layout(name, tp=1, pp=1, dp=1, sp=False, style="llama", cp=1, cp_comm_type="p2p"):
    model = getattr(ModelConfig, style)(hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
                                        ffn_hidden_size=64, vocab_size=64, max_position_embeddings=16,
                                        params_dtype="float64")
    cfg = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=2, lr=1e-2, lr_warmup_iters=0,
                      eval_interval=0, progress=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      sequence_parallel=sp, context_parallel_size=cp, cp_comm_type=cp_comm_type, **PACKED)
    return name, model, cfg, dp, _packed_batches(model, 2, 2 * 2 * dp, 16)


LAYOUTS = [_layout("tp2 + SP x dp2", tp=2, sp=True, dp=2), _layout("tp2 x pp2, GPT-2", tp=2, pp=2, style="gpt2"),
           _layout("pp2 x dp2", pp=2, dp=2),
           # context parallelism: every rank's attention masks the keys of all ranks by their documents
           _layout("cp2 ring x dp2", cp=2, dp=2), _layout("tp2 + SP x cp2 all_gather", tp=2, sp=True, cp=2,
                                                          cp_comm_type="all_gather"),
           _layout("cp2 a2a x pp2, GPT-2", cp=2, pp=2, cp_comm_type="a2a", style="gpt2"),
           _layout("cp4 a2a+p2p", cp=4, cp_comm_type="a2a+p2p")]


@pytest.fixture(scope="module")
def trained():
    return spawn(W.train_layouts, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_layout_with_packed_documents_equals_one_device(trained, index):
    name, model, cfg, dp, batches = LAYOUTS[index]
    reference = single_device_run(model, batches, dataclasses.replace(cfg, tensor_model_parallel_size=1,
                                                                      pipeline_model_parallel_size=1,
                                                                      context_parallel_size=1,
                                                                      sequence_parallel=False),
                                  grad_accum_steps=cfg.grad_accum_steps * dp)
    run = trained[0][index]
    report = compare_runs(reference, RunRecord(run["losses"], run["grads"], run["params"]), torch.float64)
    assert report.ok, f"{name}\n{report}"
