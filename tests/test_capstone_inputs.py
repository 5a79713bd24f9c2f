"""Chapter 08's commands on bad input (issue 32, item 4): `python -m minimegatron.convert` and
`python -m minimegatron.generate`, each called in-process through its main(argv). Every refusal
exits 2 with a message naming the flag or field and its value, and no traceback; a conversion
never overwrites a folder without --force; sampling flags that greedy decoding ignores are
named. (The planner's, `python -m minimegatron.plan`, are in tests/test_plan.py.)

Cheap: the checkpoint is an untrained model saved as a release (no training run), converted
once per module; one 2-rank spawn (a NaN under pipeline parallelism). About 50 s in all on a
2-core machine busy with other tests, half of it the spawn."""

import json
import math
import struct

import pytest
import torch

from minimegatron.checkpoint import CheckpointError
from minimegatron.config import ConfigError, ModelConfig, to_dict
from minimegatron.convert import (check_hf_weights, hf_config, load_safetensors, model_config_from_hf,
                                  save_safetensors, to_hf_state)
from minimegatron.convert import main as convert
from minimegatron.dist_checkpoint import save_release
from minimegatron.generate import check_sampling, generate, load_model, next_token
from minimegatron.generate import main as generate_cli
from minimegatron.model import GPTModel

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          max_position_embeddings=32)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A torch_dist checkpoint of MODEL (untrained, seeded) and its Hugging Face folder."""
    tmp = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    save_release(tmp / "ckpt", GPTModel(MODEL).state_dict(), {"model_config": to_dict(MODEL)})
    assert convert(["--load", str(tmp / "ckpt"), "--to-hf", str(tmp / "hf")]) == 0
    return tmp


def _refused(capsys, code: int, *words: str) -> str:
    """Assert exit 2 and that stderr names every word; return stderr."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    return err


def _copy(src, dst, config=None, weights=None):
    """A copy of the Hugging Face folder `src` at `dst`, its config.json edited by `config`
    (dict -> None) and its tensors by `weights` (dict -> None)."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    if weights is not None:
        w = load_safetensors(dst / "model.safetensors")
        weights(w)
        save_safetensors(w, dst / "model.safetensors")
    return dst


# ---------------------------------------------------------------------------------------
# convert: never overwrite silently
# ---------------------------------------------------------------------------------------
def test_convert_refuses_to_overwrite_unless_forced(made, tmp_path, capsys):
    train_dir = tmp_path / "train"                           # what a training run leaves
    (train_dir / "iter_0000040").mkdir(parents=True)
    (train_dir / "latest").write_text("iter_0000040\n")
    args = ["--from-hf", str(made / "hf"), "--save", str(train_dir)]
    _refused(capsys, convert(args), f"--save {train_dir} is not empty", "latest: iter_0000040", "--force")
    assert (train_dir / "latest").read_text() == "iter_0000040\n"
    assert convert(args + ["--force"]) == 0
    assert (train_dir / "latest").read_text().strip() == "iter_0000000"
    from minimegatron.dist_checkpoint import read_common
    assert read_common(train_dir / "iter_0000000")["train_config"] == {"tokenizer": "byte"}

    other = tmp_path / "other"                               # a folder holding another model
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "mistral"}')
    args = ["--load", str(made / "ckpt"), "--to-hf", str(other)]
    _refused(capsys, convert(args), f"--to-hf {other} is not empty", "config.json", "--force")
    assert (other / "config.json").read_text() == '{"model_type": "mistral"}'
    assert convert(args + ["--force"]) == 0
    assert json.loads((other / "config.json").read_text())["model_type"] == "llama"

    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv in (["--load", str(made / "ckpt"), "--to-hf", str(afile), "--force"],
                 ["--from-hf", str(made / "hf"), "--save", str(afile), "--force"]):
        _refused(capsys, convert(argv), f"{afile} is a file")
    assert afile.read_text() == "x"
    _refused(capsys, convert(["--load", str(made / "ckpt"), "--to-hf", "/proc/minimegatron-hf"]),
             "error:", "/proc/minimegatron-hf")


def test_convert_names_a_missing_or_wrong_input(made, tmp_path, capsys):
    _refused(capsys, convert(["--load", str(tmp_path / "nope"), "--to-hf", str(tmp_path / "a")]), "does not exist")
    _refused(capsys, convert(["--load", str(made / "hf"), "--to-hf", str(tmp_path / "b")]),
             "is a Hugging Face folder", "--from-hf")
    _refused(capsys, convert(["--from-hf", str(tmp_path / "nope"), "--save", str(tmp_path / "c")]),
             "--from-hf", "does not exist")
    _refused(capsys, convert(["--from-hf", str(made / "ckpt"), "--save", str(tmp_path / "d")]),
             "config.json does not exist")


# ---------------------------------------------------------------------------------------
# convert --from-hf: what the book cannot express, and malformed folders
# ---------------------------------------------------------------------------------------
def _mixtral_config(c):
    c.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.update(hidden_act="gelu"), ["hidden_act='gelu'", "SwiGLU", "'silu'"]),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["rope_scaling=", "llama3", "unscaled"]),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), ["rope_type='yarn'"]),
    (lambda c: c.update(mlp_bias=True), ["mlp_bias=True", "no biases"]),
    (lambda c: c.update(attention_bias=True), ["attention_bias=True", "no biases"]),
    (lambda c: c.update(sliding_window=16), ["sliding_window=16"]),
    (lambda c: c.update(vocab_size=300), ["vocab_size=300", "model.embed_tokens.weight has 257 rows"]),
    (lambda c: c.pop("hidden_size"), ["lacks hidden_size"]),
    (lambda c: c.update(hidden_size="32"), ["hidden_size='32' is not an integer"]),
    (lambda c: c.update(num_hidden_layers=-1), ["num_hidden_layers", "=-1 must be positive"]),
    (lambda c: c.update(num_hidden_layers=1), ["1 layers", "not in the model 9", "model.layers.1."]),
    (_mixtral_config, ["MixtralForCausalLM", "4 experts, but the weights are dense", "mlp.gate.weight"]),
    (lambda c: c.update(tie_word_embeddings=True), ["lm_head.weight differs", "tie_word_embeddings=true"]),
    (lambda c: c.update(dtype="bfloat16"), ["is float32", "dtype is bfloat16"]),
], ids=["gelu", "rope_scaling", "rope_type", "mlp_bias", "attention_bias", "sliding_window", "vocab_size",
        "missing_key", "mistyped", "negative", "fewer_layers", "mixtral_dense", "tied_differs", "dtype"])
def test_from_hf_refuses_a_config_by_name(made, tmp_path, capsys, edit, words):
    folder = _copy(made / "hf", tmp_path / "hf", config=edit)
    _refused(capsys, convert(["--from-hf", str(folder), "--save", str(tmp_path / "out")]), *words)
    assert not (tmp_path / "out").exists()                   # refused before anything is written


def _header_edit(folder, edit):
    """Rewrite model.safetensors' JSON header through `edit` (dict -> None), keeping the bytes."""
    raw = (folder / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def _nan(w):
    w["model.norm.weight"][3] = math.nan


@pytest.mark.parametrize("broken, words", [
    (lambda f: (f / "config.json").write_text("{not json"), ["config.json is not JSON"]),
    (lambda f: (f / "config.json").write_text("[1, 2]"), ["config.json holds a JSON list"]),
    (lambda f: _header_edit(f, lambda h: h["model.norm.weight"].update(dtype="F8_E4M3")),
     ["model.norm.weight has dtype 'F8_E4M3'", "BF16"]),
    (lambda f: _header_edit(f, lambda h: h["model.norm.weight"].update(shape=[7])),
     ["model.norm.weight of shape [7] and dtype F32 is 28 bytes", "span 128"]),
    (lambda f: _header_edit(f, lambda h: h["model.norm.weight"].update(data_offsets=[10, 2])),
     ["data_offsets [10, 2]"]),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:20]),
     ["runs past the end of the file (20 bytes)"]),
    (lambda f: _header_edit(f, lambda h: h.pop("model.layers.1.mlp.up_proj.weight")),
     ["missing 1: model.layers.1.mlp.up_proj.weight"]),
], ids=["config_not_json", "config_list", "dtype", "shape_vs_bytes", "offsets", "truncated", "missing_tensor"])
def test_from_hf_refuses_a_malformed_folder_by_name(made, tmp_path, capsys, broken, words):
    folder = _copy(made / "hf", tmp_path / "hf")
    broken(folder)
    _refused(capsys, convert(["--from-hf", str(folder), "--save", str(tmp_path / "out")]), *words)


def test_from_hf_refuses_non_finite_weights_and_takes_the_dtype_from_the_weights_when_unsaid(made, tmp_path, capsys):
    folder = _copy(made / "hf", tmp_path / "nan", weights=_nan)
    _refused(capsys, convert(["--from-hf", str(folder), "--save", str(tmp_path / "out")]),
             "model.norm.weight holds 1 non-finite")
    config = json.loads((made / "hf" / "config.json").read_text())
    config.pop("dtype")
    assert model_config_from_hf(config).params_dtype == "float32"
    folder = _copy(made / "hf", tmp_path / "bf16", config=lambda c: c.pop("dtype"),
                   weights=lambda w: w.update({k: v.bfloat16() for k, v in w.items()}))
    assert convert(["--from-hf", str(folder), "--save", str(tmp_path / "back")]) == 0
    from minimegatron.dist_checkpoint import read_common
    assert read_common(tmp_path / "back" / "iter_0000000")["model_config"]["params_dtype"] == "bfloat16"


def test_export_refuses_what_it_would_drop():
    """Biases have no place in the table (to_hf_state would have dropped them), nor has any
    tensor the model does not hold."""
    biased = ModelConfig.llama(**{**to_dict(MODEL), "add_bias_linear": True})
    with pytest.raises(ConfigError, match="add_bias_linear=True"):
        hf_config(biased, 256)
    state = GPTModel(MODEL).state_dict()
    with pytest.raises(CheckpointError, match="no place for: extra.weight"):
        to_hf_state(state | {"extra.weight": torch.zeros(1)}, MODEL)
    state.pop("decoder.final_layernorm.weight")
    with pytest.raises(CheckpointError, match="lacks decoder.final_layernorm.weight"):
        to_hf_state(state, MODEL)
    hf = to_hf_state(GPTModel(MODEL).state_dict(), MODEL)
    check_hf_weights(hf, MODEL)                              # the exact set passes
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[31\]"):
        check_hf_weights(hf | {"model.norm.weight": torch.ones(31)}, MODEL)


# ---------------------------------------------------------------------------------------
# generate: every sampling flag validated, what greedy ignores named
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--max-new-tokens", "-1"], ["--max-new-tokens -1", "at least 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0"]),
    (["--temperature", "nan"], ["--temperature nan"]),
    (["--temperature", "-1"], ["--temperature -1.0", "0 (greedy) or a positive finite number"]),
    (["--temperature", "inf"], ["--temperature inf"]),
    (["--temperature", "1", "--top-p", "0"], ["--top-p 0.0", "(0, 1]"]),
    (["--temperature", "1", "--top-p", "1.5"], ["--top-p 1.5"]),
    (["--temperature", "1", "--top-p", "nan"], ["--top-p nan"]),
    (["--temperature", "1", "--top-k", "0"], ["--top-k 0", "at least 1"]),
    (["--temperature", "1", "--top-k", "-3"], ["--top-k -3"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--seed", str(2**70)], [f"--seed {2**70}"]),
    (["--tensor-model-parallel-size", "0"], ["--tensor-model-parallel-size 0", "at least 1"]),
    (["--max-new-tokens", "40"], ["max_new_tokens (40)", "max_position_embeddings=32", "at most 31 new tokens"]),
    (["--prompt", ""], ["--prompt ''", "at least one token"]),
])
def test_generate_refuses_a_bad_request_by_flag(made, capsys, flags, words):
    argv = ["--load", str(made / "ckpt"), "--prompt", "A", "--max-new-tokens", "4"] + flags
    _refused(capsys, generate_cli(argv), *words)


def test_greedy_generation_names_the_flags_it_ignores(made, capsys):
    base = ["--load", str(made / "ckpt"), "--prompt", "Ranks", "--max-new-tokens", "6"]
    assert generate_cli(base) == 0
    plain = capsys.readouterr()
    assert "note:" not in plain.err
    assert generate_cli(base + ["--top-k", "5", "--top-p", "0.5"]) == 0
    noted = capsys.readouterr()
    assert "--top-k 5 is ignored" in noted.err and "--top-p 0.5 is ignored" in noted.err
    assert noted.out.splitlines()[0] == plain.out.splitlines()[0]         # the same greedy text
    assert check_sampling(4, 0.7, top_k=5, top_p=0.5) == []                  # sampling uses both


def test_generate_names_a_missing_or_wrong_checkpoint(made, tmp_path, capsys):
    for load, words in ((tmp_path / "nope", ["does not exist"]), (made / "hf", ["is a Hugging Face folder"]),
                        (made / "hf" / "config.json", ["is a file"]),
                        (tmp_path, ["holds no --ckpt-format torch_dist"])):
        _refused(capsys, generate_cli(["--load", str(load), "--prompt", "A"]), f"--load {load}", *words)


def test_a_tiny_temperature_samples_the_argmax_and_nan_logits_are_refused(made):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(3, 1)
    # 1e-40 once overflowed logits / temperature to inf, and the softmax to NaN
    assert next_token(logits, 1e-40, generator=torch.Generator().manual_seed(0)).tolist() == [0, 0, 0]
    model, _, _, _ = load_model(str(made / "ckpt"))
    with torch.no_grad():
        model.decoder.final_layernorm.weight[0] = math.nan
    with pytest.raises(ValueError, match="logits at new token 1 are not finite"):
        generate(model, [[65, 66]], 3)


def test_from_hf_keeps_the_folders_tokenizer_and_refuses_one_that_does_not_fit(tmp_path, capsys):
    """A BPE model's folder comes back with its tokenizer: generate once decoded its tokens
    with the byte tokenizer, silently. A tokenizer with more ids than the model is refused."""
    from minimegatron.data import BPETokenizer
    from minimegatron.dist_checkpoint import read_common
    bpe = BPETokenizer.train(["the pipeline bubble shrinks as micro-batches grow"] * 20, 280, tmp_path / "bpe.json")
    model = ModelConfig.llama(**{**to_dict(MODEL), "vocab_size": bpe.vocab_size})
    save_release(tmp_path / "ckpt", GPTModel(model).state_dict(),
                 {"model_config": to_dict(model), "train_config": {"tokenizer": str(tmp_path / "bpe.json")}})
    assert convert(["--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert convert(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back")]) == 0
    spec = read_common(tmp_path / "back" / "iter_0000000")["train_config"]["tokenizer"]
    assert spec == str((tmp_path / "back" / "tokenizer.json").resolve())
    assert BPETokenizer.load(spec).encode("the pipeline") == bpe.encode("the pipeline")
    small = _copy(tmp_path / "hf", tmp_path / "small", config=lambda c: c.update(vocab_size=257),
                  weights=lambda w: w.update({k: v[:257] for k, v in w.items() if v.shape[0] == bpe.vocab_size}))
    _refused(capsys, convert(["--from-hf", str(small), "--save", str(tmp_path / "out")]),
             f"has {bpe.vocab_size} tokens, more than config.json's vocab_size=257")


def _nan_on_every_stage(path) -> str:
    """On each rank of pp 2: NaN in the last stage's final norm, then generate; the error."""
    from minimegatron.dp import unwrap
    model, _, _, layout = load_model(path, pipeline_parallel=2)
    final = getattr(unwrap(model).decoder, "final_layernorm", None)
    if final is not None:
        with torch.no_grad():
            final.weight[0] = math.nan
    try:
        generate(model, [[65, 66]], 3, pp_group=layout.pp_group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_nan_logits_stop_every_pipeline_stage_and_none_hangs(made):
    """Only the last stage sees the logits; the first learns of them from the token broadcast."""
    from minimegatron.launch import spawn
    errors = spawn(_nan_on_every_stage, 2, str(made / "ckpt"), timeout=120)
    assert len(errors) == 2 and all("logits at new token 1 are not finite" in e for e in errors), errors
