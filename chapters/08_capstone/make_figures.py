"""The numbers chapter 08 quotes (it has no figure yet).

    python chapters/08_capstone/make_figures.py     # prints what `make numbers CH=08` records

RUNS and measure() are what `make numbers CH=08` (python -m booktools.measured record 08)
reruns and records in measured.json; tests/test_measured.py checks the README's quoted numbers
against it:

  reshard        chapters/08_capstone/demo.py: six layout pairs saved and resumed with
                 --ckpt-format torch_dist, against the uninterrupted single-device run, and
                 what each checkpoint holds against the formula
  plan-llama70b  the planner on Llama 3 70B, 1,024 H100s, s 8192, 1,024 sequences a step
  plan-mixtral   the planner on Mixtral 8x7B, 64 H100s, s 4096, 512 sequences a step
  generate       benchmarks/bench_generate.py: tokens/s with and without the KV cache (timed)
  plan-measured  chapters/08_capstone/plan_vs_measured.py: the planner's bytes and memory against
                 seven layouts trained on 4 ranks here
  plan-gpt3, plan-deepseek (and -published: the published layout pinned)   the planner against
                 GPT-3 175B's layout of Narayanan et al. 2021 and DeepSeek-V3's
"""

from __future__ import annotations

import sys

from booktools.measured import RoundOff, claim

PLAN = "python -m minimegatron.plan --cluster h100-sxm --top 3"
GPT3 = ("python -m minimegatron.plan --cluster a100-80gb --model gpt3-175b --gpus 1536 --seq-length 2048 "
        "--global-batch-size 1536")
DEEPSEEK = ("python -m minimegatron.plan --cluster h100-sxm --model deepseek-v3 --gpus 2048 --seq-length 4096 "
            "--global-batch-size 15360")
RUNS = {
    "reshard": "python chapters/08_capstone/demo.py",
    "plan-llama70b": f"{PLAN} --model llama3-70b --gpus 1024 --seq-length 8192 --global-batch-size 1024",
    "plan-mixtral": f"{PLAN} --model mixtral-8x7b --gpus 64 --seq-length 4096 --global-batch-size 512",
    "generate": "python benchmarks/bench_generate.py",                          # timed
    "plan-measured": "python chapters/08_capstone/plan_vs_measured.py",
    # published layouts: GPT-3 175B on 1,536 A100s (Narayanan et al. 2021, Table 2: tp 8, pp 12,
    # dp 16, micro-batch 1, batch 1,536); DeepSeek-V3 on 2,048 GPUs (its report, section 3.2: pp 16,
    # ep 64, ZeRO-1 dp, no tp; sequences of 4K, batch 15,360)
    "plan-gpt3": f"{GPT3} --top 3",
    "plan-gpt3-published": f"{GPT3} --top 1 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 12 "
                           "--context-parallel-size 1",
    "plan-deepseek": f"{DEEPSEEK} --top 3",
    "plan-deepseek-published": f"{DEEPSEEK} --top 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 "
                               "--expert-model-parallel-size 64",
}
MACHINE_DEPENDENT = ()
EXPECTED_EXIT = {"plan-deepseek-published": 1}     # the planner exits 1 when no layout fits


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    v, reshard = {}, results["reshard"]
    claim(reshard["verdict"].startswith("MATCH"), "the reshard grid matches")
    v["reshard_pairs"] = len(reshard["pairs"])
    v["reshard_loss"] = RoundOff(max(p["loss_diff"] for p in reshard["pairs"]))
    v["reshard_param"] = RoundOff(max(p["param_diff"] for p in reshard["pairs"]))
    sizes = {c["layout"]: c for c in reshard["checkpoints"]}
    claim(all(c["tensors"] == c["formula"] for c in sizes.values()), "every checkpoint holds exactly the formula's bytes")
    v["size_tp2_tensors"], v["size_tp2_disk"] = sizes["tp=2 dp=2"]["tensors"], sizes["tp=2 dp=2"]["disk"]
    v["size_dp4_tensors"] = sizes["dp=4 zero=1"]["tensors"]
    v["size_overhead_max"] = max(round(100 * (c["disk"] / c["tensors"] - 1), 1) for c in sizes.values())
    dims = ("tp", "cp", "pp", "v", "ep", "etp", "dp", "zero")
    for key in ("llama70b", "mixtral"):
        plan = results[f"plan-{key}"]
        v[f"{key}_flops"], v[f"{key}_searched"], v[f"{key}_fit"] = plan["flops"], plan["searched"], plan["fit"]
        top = plan["top"][0]
        v |= {f"{key}_top_{name}": top[{"v": "vp"}.get(name, name)] for name in dims}
        v[f"{key}_top_gib"], v[f"{key}_top_step_s"], v[f"{key}_top_mfu"] = top["gib"], top["step_s"], top["mfu_pct"]
    claim(v["llama70b_top_tp"] <= 8, "the planner keeps tensor parallelism within a node")
    gen = results["generate"]
    v["gen_cached_tps"], v["gen_uncached_tps"] = gen["tokens_per_s"]["cached"], gen["tokens_per_s"]["uncached"]
    v["gen_cached_positions"], v["gen_uncached_positions"] = gen["positions"]["cached"], gen["positions"]["uncached"]
    v["gen_speedup"] = gen["speedup"]
    claim(gen["cache_bytes"] == gen["cache_formula"], "the cache holds the formula's bytes")
    v["gen_cache_bytes"] = gen["cache_bytes"]
    claim(v["gen_speedup"] > 1, "the cache makes generation faster")
    for key in ("gpt3", "gpt3-published", "deepseek"):
        top, name = results[f"plan-{key}"]["top"][0], key.replace("-", "_")
        v |= {f"{name}_{dim}": top[{"v": "vp"}.get(dim, dim)] for dim in dims}
        v[f"{name}_step_s"], v[f"{name}_mfu"] = top["step_s"], top["mfu_pct"]
    claim(results["plan-gpt3-published"]["fit"] > 0, "the published GPT-3 layout fits")
    published = "\n".join(outputs["plan-deepseek-published"])
    claim("NO layout fits" in published and "num_layers=61 is not divisible by pipeline_model_parallel_size=16"
          in published, "DeepSeek-V3's pp 16 is refused: 61 layers do not split evenly")
    v["deepseek_fit"] = results["plan-deepseek"]["fit"]
    pm = results["plan-measured"]["layouts"].values()
    claim(results["plan-measured"]["exit_code"] == 0, "the planner agrees with the measured runs")
    claim(all(layout["failed"] == 0 for layout in pm), "no planned number differs")
    v["pm_layouts"] = len(pm)
    v["pm_byte_lines"] = sum(sum(layout["bytes"].values()) for layout in pm)
    v["pm_state_worst_pct"] = max(layout["off_pct"]["state"] for layout in pm)
    v["pm_act_worst_pct"] = max(layout["off_pct"]["activations"] for layout in pm)
    v["pm_moe_act_pct"] = next(layout["off_pct"]["activations"] for layout in pm if layout["mean_over_ranks"])
    v["pm_etp_pad_pct"] = next(layout["etp_padding_pct"] for layout in pm if layout["etp_padding_pct"] is not None)
    return v


def main() -> int:
    print(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
