"""minimegatron's training step against Hugging Face transformers' LlamaForCausalLM, on the CPU.

    pip install -r requirements-bench.txt                    # transformers: this script only
    python benchmarks/bench_vs_hf.py                         # s = 256 and 1024, one thread
    python benchmarks/bench_vs_hf.py --seq 256 --repeats 9
    python benchmarks/bench_vs_hf.py --compile               # also both under torch.compile
    python benchmarks/bench_vs_hf.py --attention-backend naive   # the written-out attention
    python benchmarks/bench_vs_hf.py --smoke                 # tiny sizes: checks that it runs

The model a learner would otherwise train is `transformers.LlamaForCausalLM`. Both sides run
the same LLaMA network (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output layer;
by default h 256, 4 layers, 8 heads, 2 key/value heads, b 8, V 8192, float32), each AS
SHIPPED, i.e. with its default settings:

  minimegatron   GPTModel(ModelConfig.llama(...)), its default attention backend, one step of
                 `minimegatron.train.train_step` (forward, loss, backward, gradient clipping
                 to 1.0, AdamW from minimegatron.optim) on a single device
  transformers   LlamaForCausalLM(LlamaConfig(...)), its default attention implementation,
                 `model(input_ids, labels=..., shift_labels=labels).loss` (the library's own
                 causal-LM loss; given already shifted labels, it averages the same b s
                 tokens as minimegatron instead of b (s - 1)), backward,
                 torch.nn.utils.clip_grad_norm_(1.0), torch.optim.AdamW

Before timing, transformers' model is loaded with minimegatron's initial weights (the grouped
QKV and [gate; up] layouts translated), and the script prints both parameter counts and the
largest logit difference on one batch: the two compute the same function. It refuses to time
models that differ by more than --logits-tolerance.

Timing: --warmup untimed steps each, then --repeats windows of --steps steps, the two
implementations interleaved window by window, so a busy moment of a shared machine slows
both. Reported per implementation: steps/s and tokens/s of the median window (and the best);
the ratio is minimegatron / transformers of the median windows (>= 1 means minimegatron is
at least as fast). With --compile, minimegatron also runs as --kernels compile (each layer
through torch.compile) and transformers' model wrapped in torch.compile (default inductor
backend), all four timed in the same interleaved windows after their compile-time warm-ups,
which are printed; the ratios include the compiled path against transformers as shipped.
Last, one profiled eager step of minimegatron says where its time goes: the matrix products,
the attention kernel and everything else, the only part compiling can fuse.

This is a measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.kernels import apply_kernels
from minimegatron.model import GPTModel
from minimegatron.optim import Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.train import train_step
from machine import cpu_model, load_average  # benchmarks/machine.py

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:                                     # an optional benchmark dependency
    transformers = None


def hf_config(cfg: ModelConfig) -> "LlamaConfig":
    """transformers' LlamaConfig for the network `cfg` describes (defaults otherwise)."""
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups, head_dim=cfg.kv_channels, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
        attention_dropout=cfg.attention_dropout, use_cache=False, dtype=torch.float32)


@torch.no_grad()
def copy_weights(hf: nn.Module, ours: GPTModel, cfg: ModelConfig) -> None:
    """Load our weights into LlamaForCausalLM. Ours: linear_qkv [(a + 2g) d, h] group by group
    (the a/g query heads of a group, then its k, then its v); linear_fc1 = [gate; up]."""
    p = dict(ours.named_parameters())
    a, g, d, h, f = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size, cfg.ffn_size
    n = a // g
    for i, layer in enumerate(hf.model.layers):
        pre = f"decoder.layers.{i}."
        qkv = p[pre + "self_attention.linear_qkv.weight"].view(g, n + 2, d, h)
        layer.self_attn.q_proj.weight.copy_(qkv[:, :n].reshape(a * d, h))
        layer.self_attn.k_proj.weight.copy_(qkv[:, n].reshape(g * d, h))
        layer.self_attn.v_proj.weight.copy_(qkv[:, n + 1].reshape(g * d, h))
        layer.self_attn.o_proj.weight.copy_(p[pre + "self_attention.linear_proj.weight"])
        fc1 = p[pre + "mlp.linear_fc1.weight"]
        layer.mlp.gate_proj.weight.copy_(fc1[:f])
        layer.mlp.up_proj.weight.copy_(fc1[f:])
        layer.mlp.down_proj.weight.copy_(p[pre + "mlp.linear_fc2.weight"])
        layer.input_layernorm.weight.copy_(p[pre + "input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(p[pre + "pre_mlp_layernorm.weight"])
    hf.model.embed_tokens.weight.copy_(p["embedding.word_embeddings.weight"])
    hf.model.norm.weight.copy_(p["decoder.final_layernorm.weight"])
    hf.lm_head.weight.copy_(ours.output_weight())


@dataclass
class VsHfResults:
    """What main printed, one entry a sequence length: {seq, pairs (bench_seq's ratio rows),
    compile_speedup ({minimegatron, transformers}, with --compile), shares (step_shares)}."""
    exit_code: int = 0
    seqs: list = field(default_factory=list)


@dataclass
class Runner:
    name: str
    model: nn.Module
    step: Callable[[], float]            # one training step; returns the loss


def our_runner(cfg: ModelConfig, train_cfg: TrainConfig, batch: dict, compiled: bool) -> Runner:
    """compiled: the book's --kernels compile (kernels.apply_kernels: each layer through
    torch.compile, the collectives eager; here there are none)."""
    model = GPTModel(cfg)
    opt = Optimizer([model], train_cfg)
    if compiled:
        apply_kernels(model, "compile")

    def step() -> float:
        loss, _ = train_step([model], opt, [batch], Layout(), train_cfg.lr)
        return loss
    return Runner("minimegatron" + (" (compiled)" if compiled else ""), model, step)


def hf_runner(cfg: ModelConfig, train_cfg: TrainConfig, batch: dict, ours: GPTModel, compiled: bool) -> Runner:
    model = LlamaForCausalLM(hf_config(cfg)).train()
    copy_weights(model, ours, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=train_cfg.adam_eps)
    forward = torch.compile(model) if compiled else model
    tokens, labels = batch["tokens"], batch["labels"]

    def step() -> float:
        loss = forward(input_ids=tokens, labels=labels, shift_labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return Runner("transformers" + (" (compiled)" if compiled else ""), model, step)


@torch.no_grad()
def logits_difference(ours: GPTModel, hf: nn.Module, tokens: torch.Tensor) -> float:
    ours.eval(), hf.eval()
    diff = (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    ours.train(), hf.train()
    return diff


def step_shares(runner: Runner) -> dict[str, float]:
    """The shares of one profiled step's operator self time: matrix products (aten::mm, addmm,
    bmm), the attention kernel (SDPA's CPU kernels, forward and backward), the rest."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    return {"gemm": gemm / total, "attention": attention / total, "rest": (total - gemm - attention) / total}


def time_windows(runners: list[Runner], warmup: int, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per window of `steps` steps, implementations interleaved window by window."""
    for r in runners:
        start = time.perf_counter()
        for _ in range(warmup):
            r.step()
        print(f"   warm-up  {r.name:<26} {warmup} steps in {time.perf_counter() - start:6.1f} s", flush=True)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(repeats):
        for r in runners:
            start = time.perf_counter()
            for _ in range(steps):
                r.step()
            times[r.name].append(time.perf_counter() - start)
    return times


def bench_seq(seq: int, args: argparse.Namespace) -> dict:
    """One sequence length's comparison: VsHfResults.seqs' entry."""
    cfg = ModelConfig.llama(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                            num_attention_heads=args.heads, num_query_groups=args.query_groups,
                            max_position_embeddings=seq, params_dtype="float32",
                            **({"attention_backend": args.attention_backend} if args.attention_backend else {})
                            ).validate()
    train_cfg = TrainConfig(seq_length=seq, micro_batch_size=args.batch, lr=1e-4, clip_grad=1.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=gen)
    batch = {"tokens": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}

    print(f"\n== LLaMA h={cfg.hidden_size} L={cfg.num_layers} a={cfg.num_attention_heads} g={cfg.query_groups} "
          f"d={cfg.kv_channels} f={cfg.ffn_size} V={cfg.vocab_size} s={seq} b={args.batch} float32, "
          f"load average {load_average()}", flush=True)
    ours = our_runner(cfg, train_cfg, batch, compiled=False)
    hf = hf_runner(cfg, train_cfg, batch, ours.model, compiled=False)
    n_ours = sum(p.numel() for p in ours.model.parameters())
    n_hf = sum(p.numel() for p in hf.model.parameters())
    diff = logits_difference(ours.model, hf.model, batch["tokens"])
    print(f"   minimegatron: attention_backend={cfg.attention_backend!r}   "
          f"transformers: attn_implementation={hf.model.config._attn_implementation!r}")
    print(f"   parameters: minimegatron {n_ours:,}   transformers {n_hf:,}   "
          f"largest |logit difference| {diff:.1e} (tolerance {args.logits_tolerance:.0e})")
    if n_ours != n_hf or not diff <= args.logits_tolerance:
        raise SystemExit(f"not the same model: parameters {n_ours:,} vs {n_hf:,}, logits differ by {diff:.1e} "
                         f"(> --logits-tolerance {args.logits_tolerance:.0e}); nothing timed")

    runners = [ours, hf]
    if args.compile:
        c_ours = our_runner(cfg, train_cfg, batch, compiled=True)
        runners += [c_ours, hf_runner(cfg, train_cfg, batch, c_ours.model, compiled=True)]
    times = time_windows(runners, args.warmup, args.steps, args.repeats)     # all interleaved, window by window
    tokens = args.steps * args.batch * seq
    print(f"   {'':<26} {'steps/s':>8} {'tokens/s':>9}   (median of {args.repeats} windows; best in brackets)")
    for r in runners:
        med, best = statistics.median(times[r.name]), min(times[r.name])
        print(f"   {r.name:<26} {args.steps / med:>8.3f} {tokens / med:>9,.0f}   "
              f"({args.steps / best:.3f} steps/s, {tokens / best:,.0f} tokens/s)")
    rows = []
    pairs = [(ours, hf)] + ([(runners[2], hf), (runners[2], runners[3])] if args.compile else [])
    for a, b in pairs:
        ratio = statistics.median(times[b.name]) / statistics.median(times[a.name])
        ratio_best = min(times[b.name]) / min(times[a.name])
        per_window = sorted(tb / ta for ta, tb in zip(times[a.name], times[b.name]))
        print(f"   ratio {a.name} / {b.name}: {ratio:.2f}x (median windows), {ratio_best:.2f}x (best windows); "
              f"window by window {per_window[0]:.2f}x .. {per_window[-1]:.2f}x", flush=True)
        rows.append(dict(seq=seq, ours=a.name, theirs=b.name, ratio_median=ratio, ratio_best=ratio_best,
                         ours_tokens_per_s=tokens / statistics.median(times[a.name]),
                         theirs_tokens_per_s=tokens / statistics.median(times[b.name])))
    found = dict(seq=seq, pairs=rows, compile_speedup=None)
    if args.compile:                     # compiled vs eager, each library against itself
        speedup = lambda c, e: statistics.median(times[e.name]) / statistics.median(times[c.name])  # noqa: E731
        up = found["compile_speedup"] = {"minimegatron": speedup(runners[2], ours),
                                         "transformers": speedup(runners[3], hf)}
        print(f"   torch.compile speed-up (median windows): minimegatron {up['minimegatron']:.2f}x, "
              f"transformers {up['transformers']:.2f}x")
    shares = found["shares"] = step_shares(ours)
    print(f"   where minimegatron's eager step goes (torch.profiler, one step, operators' own time): matrix products "
          f"{shares['gemm']:.0%}, the attention kernel {shares['attention']:.0%}, everything else "
          f"{shares['rest']:.0%}; with everything else free a step would be at most {1 / (1 - shares['rest']):.2f}x "
          f"faster", flush=True)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="sequence lengths s (default 256 1024)")
    p.add_argument("--hidden", type=int, default=256, help="h (default 256)")
    p.add_argument("--layers", type=int, default=4, help="L (default 4)")
    p.add_argument("--heads", type=int, default=8, help="a, query heads (default 8)")
    p.add_argument("--query-groups", type=int, default=2, help="g, key/value heads (default 2)")
    p.add_argument("--vocab", type=int, default=8192, help="V (default 8192)")
    p.add_argument("--batch", type=int, default=8, help="b, sequences per step (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation (default 2)")
    p.add_argument("--steps", type=int, default=1, help="steps per timed window (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per implementation (default 7)")
    p.add_argument("--compile", action="store_true", help="also time both under torch.compile")
    p.add_argument("--attention-backend", choices=["sdpa", "naive"], default=None,
                   help="minimegatron's attention (default: as shipped, ModelConfig's default); "
                        "'naive' reproduces the book before issue 11")
    p.add_argument("--logits-tolerance", type=float, default=1e-5,
                   help="largest |logit difference| accepted as the same model (default 1e-5)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one short window: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.query_groups, args.vocab = 32, 2, 4, 2, 64
        args.seq, args.batch, args.warmup, args.steps, args.repeats = [16], 2, 1, 1, 1
    return args


def main(argv: list[str] | None = None) -> VsHfResults:
    args = parse_args(argv)
    if transformers is None:
        print("bench_vs_hf.py needs transformers, an optional benchmark dependency: "
              "pip install -r requirements-bench.txt", file=sys.stderr)
        return VsHfResults(exit_code=2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()}, CPU: {cpu_model()}")
    print(f"timing: {args.warmup} warm-up steps each, then {args.repeats} interleaved windows of {args.steps} "
          f"step(s); ratio = minimegatron / transformers speed, of the median windows")
    out = VsHfResults(seqs=[bench_seq(seq, args) for seq in args.seq])
    print("\nsummary (minimegatron / transformers, median windows):")
    for r in (r for found in out.seqs for r in found["pairs"]):
        print(f"   s={r['seq']:<5} {r['ours']:<26} {r['ours_tokens_per_s']:>9,.0f} tokens/s   "
              f"{r['theirs']:<26} {r['theirs_tokens_per_s']:>9,.0f} tokens/s   ratio {r['ratio_median']:.2f}x")
    return out


if __name__ == "__main__":
    sys.exit(main().exit_code)
