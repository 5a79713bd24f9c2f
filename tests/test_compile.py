"""Chapter 07's --kernels compile: each transformer layer through torch.compile (Inductor writes
C++ on this CPU), the collectives left eager between the compiled pieces. On one device and
under tp 2 + SP the compiled run equals the single-device eager run within float32's
summation-order tolerance, and sends exactly the eager run's messages. Compiling costs about
15 s a process here, so the checks share one single-device run and one 2-rank world."""

import dataclasses
import os

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.parallelize import validate_layout
from minimegatron.testing import RunRecord, Tolerance, compare_runs, make_batches, single_device_run
from tests.workers import compile as W

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          vocab_size=64, max_position_embeddings=32, params_dtype="float32")
# AdamW eps 1e-3: see tests/test_kernels.py (a float32 rounding of a near-zero gradient would flip a step)
BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=2, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, adam_eps=1e-3)
FLOAT32 = Tolerance(loss=1e-5, rtol=1e-3, atol=1e-5)     # Inductor's fused float32 against eager's, summation order


@pytest.fixture(scope="module")
def one_device():
    batches = make_batches(MODEL, 2, 4, 16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = single_device_run(MODEL, batches, dataclasses.replace(BASE, kernels="compile"), grad_accum_steps=2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return single_device_run(MODEL, batches, BASE, grad_accum_steps=2), compiled, graphs, batches


def test_the_compiled_model_trains_as_the_eager_one(one_device):
    eager, compiled, graphs, _ = one_device
    assert graphs >= 1, "nothing was compiled"
    report = compare_runs(eager, compiled, torch.float32, FLOAT32)
    assert report.ok, str(report)


def test_under_tp_and_sp_the_compiled_layers_equal_one_device_and_send_the_same_messages(one_device):
    eager_one, _, _, _ = one_device
    cfg = dataclasses.replace(BASE, tensor_model_parallel_size=2, sequence_parallel=True)
    ranks = spawn(W.eager_and_compiled, 2, MODEL, cfg, 1, make_batches(MODEL, 2, 4, 16), timeout=600)
    for rank in ranks:
        compiled = rank["compiled"]
        report = compare_runs(eager_one, RunRecord(compiled["losses"], compiled["grads"], compiled["params"]),
                              torch.float32, FLOAT32)
        assert report.ok, str(report)
        assert compiled["messages"] and compiled["messages"] == rank["eager"]["messages"]


@pytest.mark.parametrize("model_kw, fields, message", [
    (dict(hidden_dropout=0.1), {}, "hidden_dropout=0.1: Inductor draws its own random numbers"),
    ({}, dict(recompute_granularity="selective"), "recompute_granularity='selective'"),
    (dict(params_dtype="bfloat16"), dict(fp8_format="hybrid", bf16=True), "fp8_format='hybrid'"),
])
def test_what_the_compile_path_does_not_take_is_named(model_kw, fields, message):
    with pytest.raises(ConfigError, match=f"kernels='compile' with {message}"):
        validate_layout(dataclasses.replace(MODEL, **model_kw), dataclasses.replace(BASE, kernels="compile", **fields), 1)


def test_the_compile_switch_is_kernels_compile():
    from minimegatron.arguments import parse_command_line
    assert parse_command_line(["--compile"])[1].kernels == "compile"


def test_each_aten_cpu_capability_compiles_into_a_cache_folder_of_its_own(monkeypatch, tmp_path):
    # Inductor's cache key leaves out the ISA that ATEN_CPU_CAPABILITY picks (torch 2.13): code
    # generated for AVX-512 and fetched under "default" fails to compile ('at::vec' has not been declared)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from minimegatron.kernels import compile_cache_for_this_capability
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    compile_cache_for_this_capability()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    for capability in ("default", "avx2"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # as a parent's first compile leaves it
        compile_cache_for_this_capability()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{default_cache_dir()}-aten_{capability}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))                 # the user's own folder stays
    compile_cache_for_this_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
