"""Chapter 08: generation with a KV cache (minimegatron/generate.py). Greedy decoding with the
cache equals decoding each prompt alone by running the whole sequence at every step (the
definition), for a batch of prompts of different lengths; sampling is seeded and the same with
or without the cache; the cache holds its formula's bytes; under tensor and pipeline
parallelism every rank produces the single-device tokens; and the converted model's greedy output in transformers
is the book's."""


import pytest
import torch

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.generate import generate, kv_cache_bytes, load_model, main, next_token
from minimegatron.launch import spawn
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          max_position_embeddings=64, params_dtype="float64")
PROMPTS = [[84, 104, 101, 32, 112, 105, 112, 101], [65], [82, 97, 110, 107, 115]]     # "The pipe", "A", "Ranks"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    train(MODEL, TrainConfig(seq_length=32, micro_batch_size=4, train_iters=20, lr=1e-2, lr_warmup_iters=0,
                             eval_interval=0, progress=False, ckpt_format="torch_dist", save_dir=str(tmp / "ckpt"),
                             out_dir=str(tmp / "out")))
    return tmp / "ckpt"


def _alone(model, prompt, n):
    """The definition: the whole sequence through the model at every step, one prompt, no padding."""
    seq, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            token = model(seq)[:, -1].argmax(-1)
            out.append(int(token))
            seq = torch.cat([seq, token[:, None]], 1)
    return out


def test_greedy_with_the_cache_is_each_prompt_decoded_alone(checkpoint):
    model, cfg, _, _ = load_model(checkpoint)
    cached, info = generate(model, PROMPTS, 10)
    assert cached == [_alone(model, p, 10) for p in PROMPTS]
    uncached, plain = generate(model, PROMPTS, 10, use_cache=False)
    assert uncached == cached
    P = max(map(len, PROMPTS))
    assert info["positions"] == P + 9                                  # the prompt once, then one a step
    assert plain["positions"] == sum(P + t for t in range(10))         # every step the whole sequence
    assert info["kv_cache_bytes"] == kv_cache_bytes(2, 3, P + 10, 2, 8, 8)


def test_sampling_is_seeded_and_the_cache_does_not_change_it(checkpoint):
    model, _, _, _ = load_model(checkpoint)
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)
    first, _ = generate(model, PROMPTS, 10, **kw)
    assert generate(model, PROMPTS, 10, **kw)[0] == first
    assert generate(model, PROMPTS, 10, use_cache=False, **kw)[0] == first
    assert generate(model, PROMPTS, 10, **(kw | {"seed": 6}))[0] != first
    assert generate(model, PROMPTS, 10, temperature=1.0, top_k=1)[0] == generate(model, PROMPTS, 10)[0]


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).log_softmax(-1).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(next_token(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)                                       # 0.61, 0.22, 0.14, 0.03, 0.004
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert set(next_token(logits, 1.0, top_p=0.8, generator=g).tolist()) == {0, 1}   # the smallest set reaching 0.8
    assert set(next_token(logits, 1.0, top_p=0.5, generator=g).tolist()) == {0}


def _parallel_generate(path) -> list:
    """On each of 4 ranks: the tokens under tp 2 x pp 2, then under pp 2 (two replicas), with
    and without the cache."""
    out = []
    for tp, pp in ((2, 2), (1, 2)):
        model, _, _, layout = load_model(path, tensor_parallel=tp, pipeline_parallel=pp)
        for use_cache in (True, False):
            out.append(generate(model, PROMPTS, 10, tp_group=layout.tp_group, vocab_size=257, use_cache=use_cache,
                                pp_group=layout.pp_group)[0])
    return out


def test_under_tensor_and_pipeline_parallelism_every_rank_generates_the_single_device_tokens(checkpoint):
    """Every rank, first stage or last, ends with the tokens one process generates: the last
    stage chooses them and broadcasts them over the pipeline."""
    model, _, _, _ = load_model(checkpoint)
    want, _ = generate(model, PROMPTS, 10)
    assert spawn(_parallel_generate, 4, checkpoint, timeout=300) == [[want] * 4] * 4


def test_transformers_generates_the_same_greedy_tokens(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    from minimegatron.convert import export_hf
    export_hf(checkpoint, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64).eval()
    model, _, _, _ = load_model(checkpoint)
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert out[0, len(prompt):].tolist() == generate(model, [prompt], 10)[0][0]


def test_bad_requests_are_refused_by_name(checkpoint, tmp_path, capsys):
    assert main(["--load", str(tmp_path), "--prompt", "x"]) == 2
    assert "holds no --ckpt-format torch_dist checkpoint" in capsys.readouterr().err
    model, _, _, _ = load_model(checkpoint)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        generate(model, PROMPTS, 60)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], 3)
