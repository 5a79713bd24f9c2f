"""Chapter 08: Hugging Face conversion (minimegatron/convert.py). A trained checkpoint goes to a
Hugging Face folder and back bit for bit; the folder is a LlamaForCausalLM whose logits equal the
book's model's (with transformers installed) and whose tokenizer encodes as the book's; the
imported checkpoint trains from the same weights as the original."""

import dataclasses
import json

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.convert import (byte_tokenizer_json, export_hf, import_hf, load_safetensors, main,
                                  save_safetensors)
from minimegatron.data import build_tokenizer
from minimegatron.dist_checkpoint import load_full_state
from minimegatron.model import GPTModel
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          max_position_embeddings=32)
CFG = TrainConfig(seq_length=16, micro_batch_size=2, train_iters=2, lr=1e-2, lr_warmup_iters=0, eval_interval=0,
                  progress=False, ckpt_format="torch_dist")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert")
    train(MODEL, dataclasses.replace(CFG, save_dir=str(tmp / "ckpt"), out_dir=str(tmp / "out")))
    export_hf(tmp / "ckpt", tmp / "hf")
    import_hf(tmp / "hf", tmp / "back")
    return tmp


def test_book_to_hf_to_book_is_bit_identical(folders):
    before = load_full_state(folders / "ckpt" / "iter_0000002")
    after = load_full_state(folders / "back" / "iter_0000000")
    assert set(before) == set(after)
    for name, t in before.items():
        assert torch.equal(t, after[name]), name


def test_the_folder_holds_what_transformers_reads(folders):
    config = json.loads((folders / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    weights = load_safetensors(folders / "hf" / "model.safetensors")
    # names and shapes of LlamaForCausalLM, written out from its modules' definitions
    a, g, d, h, f, V = 4, 2, 8, 32, 64, 257
    want = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,), "lm_head.weight": (V, h)}
    for i in range(2):
        p = f"model.layers.{i}."
        want |= {p + "self_attn.q_proj.weight": (a * d, h), p + "self_attn.k_proj.weight": (g * d, h),
                 p + "self_attn.v_proj.weight": (g * d, h), p + "self_attn.o_proj.weight": (h, a * d),
                 p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
                 p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    assert {k: tuple(v.shape) for k, v in weights.items()} == want
    safetensors = pytest.importorskip("safetensors.torch")         # the reference reader, when installed
    theirs = safetensors.load_file(str(folders / "hf" / "model.safetensors"))
    assert all(torch.equal(theirs[k], weights[k]) for k in want)


def test_transformers_loads_it_and_its_logits_are_the_books(folders):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folders / "hf")).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    book = GPTModel(MODEL).eval()
    book.load_state_dict(load_full_state(folders / "ckpt" / "iter_0000002"))
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, book(tokens), rtol=1e-4, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folders / "hf"))
    text = "Ranks never hang silently — déjà vu"
    ids = build_tokenizer("byte").encode(text)
    assert tokenizer(text)["input_ids"] == ids and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 256 and tokenizer.decode(ids + [256]) == text + "<eod>"
    # one difference, said in convert.py: written inside a text, "<eod>" is the special token for
    # transformers, five characters for the book (tokenizers keeps encode_special_tokens out of the file)
    assert tokenizer("a<eod>")["input_ids"] == [97, 256]


def test_the_byte_tokenizer_json_maps_each_byte_to_its_value():
    vocab = byte_tokenizer_json()["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and len(set(vocab)) == 256
    assert all(len(symbol) == 1 for symbol in vocab)
    assert vocab["A"] == 65 and vocab["Ġ"] == 32            # GPT-2's byte-level alphabet: a space is Ġ


def test_the_imported_checkpoint_trains_from_the_same_weights(folders):
    one = dataclasses.replace(CFG, train_iters=1, out_dir=str(folders / "out1"))
    original = train(MODEL, dataclasses.replace(one, load_dir=str(folders / "ckpt"), finetune=True)).losses
    imported = train(MODEL, dataclasses.replace(one, load_dir=str(folders / "back"))).losses
    assert imported == original


def test_safetensors_round_trip_and_a_truncated_file_is_named(tmp_path):
    tensors = {"a": torch.randn(3, 4, dtype=torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(0)}
    save_safetensors(tensors, tmp_path / "x.safetensors")
    back = load_safetensors(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    (tmp_path / "y.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:-10])
    with pytest.raises(Exception, match="truncated"):
        load_safetensors(tmp_path / "y.safetensors")


def test_what_cannot_be_converted_is_refused_by_name(tmp_path, capsys):
    from minimegatron.convert import hf_config
    with pytest.raises(ConfigError, match="normalization='LayerNorm'"):
        hf_config(ModelConfig.gpt2(), 256)
    with pytest.raises(ConfigError, match="MixtralForCausalLM: moe_shared_expert_intermediate_size=16"):
        hf_config(dataclasses.replace(MODEL, num_experts=4, moe_shared_expert_intermediate_size=16), 256)
    assert main(["--load", str(tmp_path), "--to-hf", str(tmp_path / "hf")]) == 2
    assert "holds no --ckpt-format torch_dist checkpoint" in capsys.readouterr().err


def test_the_imported_checkpoint_loads_under_tensor_parallelism(folders):
    from minimegatron.launch import spawn
    from tests.workers import reshard as W
    one = dataclasses.replace(CFG, train_iters=1, out_dir=str(folders / "out2"))
    original = train(MODEL, dataclasses.replace(one, load_dir=str(folders / "ckpt"), finetune=True)).losses
    tp2 = dataclasses.replace(one, load_dir=str(folders / "back"), tensor_model_parallel_size=2,
                              sequence_parallel=True)
    losses = spawn(W.train_in_turn, 2, [(MODEL, tp2)], timeout=300)[0][0]
    assert abs(losses[0] - original[0]) < 1e-5, (losses, original)            # float32, another summation order


def test_a_mixture_goes_to_mixtral_and_back(tmp_path):
    """A GPT-MoE of Mixtral's kind: every layer 4 experts, top-2, softmax router. The round trip
    is bit-identical; with transformers, MixtralForCausalLM's logits are the book's."""
    moe = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2)
    train(moe, dataclasses.replace(CFG, save_dir=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "out")))
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back")
    before, after = load_full_state(tmp_path / "ckpt" / "iter_0000002"), load_full_state(tmp_path / "back" / "iter_0000000")
    assert set(before) == set(after) and all(torch.equal(t, after[n]) for n, t in before.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    book = GPTModel(moe).eval()
    book.load_state_dict(before)
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, book(tokens), rtol=1e-4, atol=1e-5)
