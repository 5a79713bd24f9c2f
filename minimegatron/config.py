"""Configuration dataclasses: the model and the training run (its parallel sizes included).

Each field is declared once, with its command line (`opt`): the --help group, a one-line
help, Megatron-LM's flag spelling where it is not the field's name (`hidden_size` ->
`--hidden-size`), and its own rule (> 0, one of ...); arguments.py builds the parser of
`python -m minimegatron.train` from them.

Every config has a `validate()` that raises `ConfigError` (a `ValueError`) naming the
field and the numbers, e.g.

    ConfigError: hidden_size=100 is not divisible by num_attention_heads=3

Validation runs before any process is spawned or any tensor allocated: first every float
field finite, then each field's own rule (`check_fields`), then the rules that relate fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the fields and the numbers."""


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def opt(default: Any, group: str, help: str = "", *, flags: Sequence[str] = (),
        switches: Sequence[tuple[str, Any, str]] = (), ok: tuple | None = None, one_of: Sequence[str] = ()) -> Any:
    """A dataclass field with its command line (arguments.command_line reads it): the --help
    `group`; `help`, one line with the unit (--help appends the default); `flags` taking a value,
    Megatron's spelling first, by default the field's name (--hidden-size); `switches`, more
    (switch, value stored, help). A bool with a `help` is a switch setting it True. The value's
    own rule (check_fields): `ok`, (test, "must be ..."), or `one_of` the choices."""
    return dataclasses.field(default=default, metadata={"flags": tuple(flags), "group": group, "help": help,
                                                        "switches": tuple(switches), "ok": ok, "one_of": one_of})


POSITIVE = (lambda v: v > 0, "must be positive")
AT_LEAST_0 = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_1 = (lambda v: v >= 1, "must be >= 1")
IN_0_1 = (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")


def check_fields(cfg: Any) -> None:
    """ConfigError naming the first float field of the dataclass `cfg` that is inf or nan (checked
    first: nan fails every comparison, and inf passes every "> 0"), else the first field whose value
    (unless unset, None) breaks its own rule (opt's `ok` or `one_of`); validate then relates fields."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")
    for f in dataclasses.fields(cfg):
        if getattr(cfg, f.name) is not None and f.metadata["ok"]:
            need_each(cfg, (f.name,), *f.metadata["ok"])
        if getattr(cfg, f.name) is not None and f.metadata["one_of"]:
            need_one_of(cfg, f.name, *f.metadata["one_of"])


def need(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless cond."""
    if not cond:
        raise ConfigError(msg)


def need_each(cfg: Any, names: Sequence[str], ok: Callable[[Any], bool], rule: str) -> None:
    """ConfigError "name=value rule" for the first of the fields `names` whose value fails `ok`."""
    for name in names:
        need(ok(getattr(cfg, name)), f"{name}={getattr(cfg, name)} {rule}")


def need_one_of(cfg: Any, name: str, *choices: str) -> None:
    """ConfigError "name='x' is not 'a' or 'b'" (four or more: "is not one of a, b, c, d")."""
    listed = (f"one of {', '.join(choices)}" if len(choices) > 3 else
              ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}")
    need(getattr(cfg, name) in choices, f"{name}={getattr(cfg, name)!r} is not {listed}")


@dataclass
class ModelConfig:
    """A decoder-only transformer: GPT-2 style or LLaMA style.

    GPT-2 style: LayerNorm, GELU MLP, learned absolute positions, biases, tied embeddings.
    LLaMA style: RMSNorm, SwiGLU MLP, rotary positions (RoPE), no biases, grouped-query
    attention (num_query_groups < num_attention_heads), untied embeddings.
    Use `ModelConfig.gpt2(...)` / `ModelConfig.llama(...)` for the presets.
    """

    vocab_size: int = opt(257, "model", "rows of the embedding table, in tokens (>= the tokenizer's size)", ok=POSITIVE)
    # tensor parallelism pads the vocabulary to a multiple of this x tp (Megatron's
    # --make-vocab-size-divisible-by, default 128, pads on one device too; here the
    # single-device model keeps exactly vocab_size rows, and 1 pads only as much as tp needs)
    make_vocab_size_divisible_by: int = opt(1, "model", (
        "with TP, pad the vocabulary to a multiple of this x tp (Megatron: 128, padding on one device too)"),
        ok=POSITIVE)
    hidden_size: int = opt(64, "model", "h, the width of the residual stream", ok=POSITIVE)
    num_layers: int = opt(2, "model", "L, transformer layers", ok=POSITIVE)
    num_attention_heads: int = opt(4, "model", "a, query heads", ok=POSITIVE)
    num_query_groups: int | None = opt(None, "model", "g, key/value heads (grouped-query attention); unset: g = a")
    ffn_hidden_size: int | None = opt(None, "model", "f, the MLP's inner width; unset: 4h (GELU), about 8h/3 (SwiGLU)")
    max_position_embeddings: int = opt(64, "model", "longest sequence the model accepts, tokens", ok=POSITIVE)
    normalization: str = opt("LayerNorm", "model", "LayerNorm or RMSNorm", one_of=("LayerNorm", "RMSNorm"))
    activation: str = opt("gelu", "model", (
        "the MLP's activation, gelu or swiglu (the book's; Megatron: --swiglu)"),
        switches=[("--swiglu", "swiglu", "SwiGLU MLP, the same as --activation swiglu")], one_of=("gelu", "swiglu"))
    position_embedding_type: str = opt("learned_absolute", "model", "learned_absolute or rope",
        one_of=("learned_absolute", "rope"))
    rotary_base: float = opt(10000.0, "model", "RoPE's base theta, > 0", ok=POSITIVE)
    untie_embeddings_and_output_weights: bool = opt(False, "model", switches=[
        ("--untie-embeddings-and-output-weights", True, "a separate output layer instead of the embedding's transpose"),
        ("--tie-embeddings-and-output-weights", False, "the output layer is the embedding's transpose (the book's)")])
    add_bias_linear: bool = opt(True, "model", switches=[
        ("--disable-bias-linear", False, "no biases in the linear layers"),
        ("--add-bias-linear", True, "biases in the linear layers (the book's)")])
    # > 0: with a negative epsilon the variance plus epsilon can reach 0 or below, a rotary base
    # of 0 makes the frequencies infinite (both train to NaN); a negative std is no deviation
    layernorm_epsilon: float = opt(1e-5, "model", (
        "epsilon added to the variance in LayerNorm / RMSNorm, > 0"), flags=("--norm-epsilon", "--layernorm-epsilon"),
        ok=POSITIVE)
    init_method_std: float = opt(0.02, "model", "standard deviation of the normal initial weights, > 0", ok=POSITIVE)
    hidden_dropout: float = opt(0.0, "model", "dropout probability on the residual branches, in [0, 1)", ok=IN_0_1)
    attention_dropout: float = opt(0.0, "model", "dropout probability on the attention probabilities, in [0, 1)",
        ok=IN_0_1)
    attention_backend: str = opt("sdpa", "model", (
        "how attention is computed (the book's implementations, see minimegatron/model)"), one_of=("naive", "sdpa"))
    seed: int = opt(1234, "model", (
        "initial weights: each parameter is a function of (seed, its name); Megatron's --seed also seeds data and "
        "dropout, here --data-seed does"))
    params_dtype: str = opt("float32", "model", (
        "dtype of parameters and activations: float32, float64, bfloat16 or float16, plain (no float32 main copies: "
        "--bf16 / --fp16 are mixed precision) (the book's)"))
    # mixture of experts (chapter 05); None: a dense MLP everywhere
    num_experts: int | None = opt(None, "moe", (
        "E, experts in each MoE layer; unset: a dense MLP everywhere (chapter 05)"))
    moe_router_topk: int = opt(2, "moe", "k, experts each token is routed to")
    moe_ffn_hidden_size: int | None = opt(None, "moe", "an expert's inner width; unset: --ffn-hidden-size")
    moe_layer_freq: int = opt(1, "moe", "every n-th layer (layer i with i % n == 0) is an MoE layer")
    moe_shared_expert_intermediate_size: int | None = opt(None, "moe", (
        "inner width of a shared expert every token also takes; unset: none"))
    moe_router_score_function: str = opt("softmax", "moe", "softmax or sigmoid")
    moe_router_pre_softmax: bool = opt(False, "model", (
        "softmax over all experts before the top-k (default: over the chosen k after it)"))
    moe_aux_loss_coeff: float = opt(0.0, "moe", "weight of the load-balancing loss, >= 0")
    moe_z_loss_coeff: float = opt(0.0, "moe", "weight of the router z-loss, >= 0")
    moe_expert_capacity_factor: float | None = opt(None, "moe", (
        "slots per expert = ceil(tokens x k / E x factor), the rest dropped; unset: no capacity"))
    moe_token_drop_policy: str = opt("probs", "moe", (
        "which tokens a full expert keeps: probs (the largest weights) or position (the first)"))
    moe_router_load_balancing_type: str = opt("aux_loss", "moe", (
        "aux_loss (over the micro-batch's tokens) or seq_aux_loss (per sequence, averaged)"))
    moe_router_enable_expert_bias: bool = opt(False, "model", (
        "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias for the choice, updated after each step "
        "(needs sigmoid scores)"))
    moe_router_bias_update_rate: float = opt(1e-3, "moe", (
        "with --moe-router-enable-expert-bias: the bias's step per training step"))

    # ---- presets -------------------------------------------------------------------
    @classmethod
    def gpt2(cls, **overrides: Any) -> "ModelConfig":
        return cls(**overrides)           # the defaults are GPT-2's

    @classmethod
    def llama(cls, **overrides: Any) -> "ModelConfig":
        llama = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True)
        return cls(**llama | overrides)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def kv_channels(self) -> int:
        """d: the size of one attention head (Megatron's --kv-channels)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """g: number of key/value heads (= a without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """f: the MLP's inner width."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            # 2/3 of 4h keeps the parameter count of a 4h GELU MLP (the LLaMA paper's choice);
            # rounded up to a multiple of 8 here (LLaMA rounds to 256, Megatron's --swiglu to 64).
            return ((8 * self.hidden_size // 3) + 7) // 8 * 8
        return 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        """An expert's inner width (Megatron's moe_ffn_hidden_size; default the dense f)."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Does global layer `layer_number` hold experts (Megatron's integer moe_layer_freq)?"""
        return self.num_experts is not None and layer_number % self.moe_layer_freq == 0

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.params_dtype)

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> "ModelConfig":
        check_fields(self)
        need(self.num_query_groups is None or self.num_query_groups > 0,
             f"num_query_groups={self.num_query_groups} must be positive (leave it unset for multi-head attention, "
             f"num_query_groups = num_attention_heads)")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}")
        need(self.query_groups > 0 and self.num_attention_heads % self.query_groups == 0,
             f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups={self.query_groups}")
        need(self.position_embedding_type != "rope" or self.kv_channels % 2 == 0,
             f"rope needs an even head size, got kv_channels={self.kv_channels} "
             f"(hidden_size={self.hidden_size} / num_attention_heads={self.num_attention_heads})")
        need(self.ffn_size > 0, f"ffn_hidden_size={self.ffn_hidden_size} must be positive")
        if self.num_experts is not None:
            need(self.num_experts >= 1, f"num_experts={self.num_experts} must be at least 1")
            need(1 <= self.moe_router_topk <= self.num_experts,
                 f"moe_router_topk={self.moe_router_topk} must be in [1, num_experts={self.num_experts}]")
            need(self.moe_layer_freq >= 1, f"moe_layer_freq={self.moe_layer_freq} must be at least 1")
            need_each(self, ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                             "moe_expert_capacity_factor"), lambda v: v is None or v > 0, "must be positive")
            need_one_of(self, "moe_router_score_function", "softmax", "sigmoid")
            need(not self.moe_router_pre_softmax or self.moe_router_score_function == "softmax",
                 "moe_router_pre_softmax applies to moe_router_score_function='softmax' only")
            need_each(self, ("moe_aux_loss_coeff", "moe_z_loss_coeff"), lambda v: v >= 0, "must be >= 0")
            need_one_of(self, "moe_token_drop_policy", "probs", "position")
            need_one_of(self, "moe_router_load_balancing_type", "aux_loss", "seq_aux_loss")
            need(not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
                 "moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (as in Megatron-Core)")
            need(self.moe_router_bias_update_rate >= 0,
                 f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} must be >= 0")
        dtype_from_name(self.params_dtype)
        return self


@dataclass
class TrainConfig:
    """One training run. Batch arithmetic follows Megatron:

    global_batch_size = micro_batch_size * grad_accum_steps * data_parallel_size

    so adding data-parallel ranks at a fixed micro-batch size grows the global batch. (On the
    command line, Megatron's --global-batch-size sets grad_accum_steps from the other two.)
    """

    data_path: str | None = opt(None, "data", (
        "prefix of a .bin/.idx pair (python tools/preprocess_data.py); unset: this repository's text, tokenized"))
    tokenizer: str = opt("byte", "data", "byte, or the path of a BPE tokenizer .json (the book's)")
    seq_length: int = opt(64, "data", "s, tokens per sequence", ok=POSITIVE)
    micro_batch_size: int = opt(4, "training", "b, sequences per micro-batch on one data-parallel rank", ok=POSITIVE)
    grad_accum_steps: int = opt(1, "training", (
        "M, micro-batches per step on each data-parallel rank (the book's name; Megatron derives M from "
        "--global-batch-size)"), ok=POSITIVE)
    train_iters: int = opt(200, "training", "optimizer steps", ok=POSITIVE)
    lr: float = opt(3e-3, "training", "peak learning rate, reached at the end of warm-up", ok=POSITIVE)
    min_lr: float = opt(3e-4, "training", "learning rate at the end of the cosine decay")
    lr_warmup_iters: int = opt(20, "training", "steps of linear warm-up to --lr")
    weight_decay: float = opt(0.1, "training", "AdamW's decoupled weight decay on matrices, >= 0", ok=AT_LEAST_0)
    adam_beta1: float = opt(0.9, "training", "Adam's first-moment decay, in [0, 1)", ok=IN_0_1)
    adam_beta2: float = opt(0.95, "training", "Adam's second-moment decay, in [0, 1)", ok=IN_0_1)
    adam_eps: float = opt(1e-8, "training", "Adam's epsilon in the denominator, > 0", ok=POSITIVE)
    adam_impl: str = opt("default", "training", (
        "torch's AdamW kernels: default (a loop over the tensors on a CPU), foreach (each op over all tensors at "
        "once) or fused (one kernel; Megatron uses Transformer Engine's or Apex's FusedAdam) (the book's)"),
        one_of=("default", "foreach", "fused"))
    clip_grad: float = opt(1.0, "training", "clip the global gradient L2 norm to this; 0: no clipping", ok=AT_LEAST_0)
    eval_interval: int = opt(50, "training", "steps between validation runs; 0: never")
    eval_iters: int = opt(4, "training", "validation batches per validation run")
    save_interval: int = opt(0, "checkpointing", "steps between checkpoints; 0: at the end only")
    save_dir: str | None = opt(None, "checkpointing", (
        "directory to save checkpoints to; unset: no checkpoints"), flags=("--save", "--save-dir"))
    load_dir: str | None = opt(None, "checkpointing", (
        "directory to resume from (its `latest`); without a checkpoint there: a "
        "warning, then a fresh start"), flags=("--load", "--load-dir"))
    ckpt_format: str = opt("torch", "checkpointing", (
        "torch: a file per rank, resumed under the same layout only (the book's default); torch_dist: each piece "
        "with its global offsets, resumed under any layout (Megatron's default; chapter 08)"),
        one_of=("torch", "torch_dist"))
    exit_interval: int | None = opt(None, "checkpointing", "stop after an iteration divisible by it, saving first")
    no_load_optim: bool = opt(False, "training", "torch_dist: load the model only; the optimizer starts fresh")
    no_load_rng: bool = opt(False, "training", "torch_dist: do not restore the random states; seed them afresh")
    finetune: bool = opt(False, "training", (
        "torch_dist: load the model only and start from iteration 0 (no optimizer, random states or history)"))
    out_dir: str = opt("runs/latest", "checkpointing", "directory of the loss log and plot (the book's)")
    # data parallelism (chapter 01); the data-parallel size is the number of ranks
    zero_stage: int = opt(0, "parallelism", (
        "ZeRO stage over data parallelism: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters sharded "
        "(chapter 01; the book's)"),
        switches=[("--use-distributed-optimizer", 1, "Megatron's distributed optimizer: the book's --zero-stage 1")])
    ddp_impl: str = opt("bucketed", "parallelism", (
        "with --zero-stage 0: naive (an all-reduce per gradient) or bucketed (overlapped with backward) (the book's)"),
        one_of=("naive", "bucketed"))
    ddp_bucket_size: int | None = opt(None, "parallelism", (
        "elements per gradient bucket; unset: Megatron's max(4e7, 1e6 x dp)"), ok=POSITIVE)
    overlap_grad_reduce: bool = opt(False, "training", (
        "ZeRO-1/2: launch each bucket's reduce-scatter from the backward as soon as it is complete (the bucketed DDP "
        "always overlaps its all-reduces; chapter 07)"))
    overlap_param_gather: bool = opt(False, "training", (
        "ZeRO-1/2: the parameter all-gathers launched after the step, waited module by module in the next forward "
        "(needs --overlap-grad-reduce; chapter 07)"))
    # tensor parallelism (chapter 02): the ranks form a grid, tp fastest; dp = world / tp
    tensor_model_parallel_size: int = opt(1, "parallelism", "tp, ranks each matrix is split over (chapter 02)",
        ok=AT_LEAST_1)
    # pipeline parallelism (chapter 03): pp stages, the slowest dimension; dp = world / (tp pp)
    pipeline_model_parallel_size: int = opt(1, "parallelism", (
        "pp, pipeline stages (chapter 03); dp = world size / (tp x pp)"), ok=AT_LEAST_1)
    pipeline_schedule: str = opt("1f1b", "parallelism", (
        "gpipe, 1f1b or interleaved (the book's; Megatron runs 1F1B, interleaved with virtual stages)"))
    num_virtual_stages_per_pipeline_rank: int = opt(1, "parallelism", (
        "model chunks per pipeline rank; > 1 with --pipeline-schedule interleaved"), ok=AT_LEAST_1)
    overlap_p2p_comm: bool = opt(False, "training", switches=[
        ("--overlap-p2p-communication", True, "with pp > 1: each receive posted one op ahead, so it arrives while the "
                                              "stage computes (chapter 07) (the book's; Megatron has only "
                                              "--no-overlap-p2p-communication, overlapping by default)"),
        ("--no-overlap-p2p-communication", False, "receives posted when needed (the book's default; Megatron "
                                                  "overlaps by default with interleaving)")])
    # sequence and context parallelism (chapter 04); dp = world / (tp cp pp)
    sequence_parallel: bool = opt(False, "training", (
        "with tp > 1: norms, dropout and residuals hold s/tp tokens per rank; all-gather / reduce-scatter replace "
        "the all-reduces (chapter 04)"))
    overlap_sp_backward: bool = opt(False, "training", (
        "with --sequence-parallel: the column-parallel backward's all-gather and reduce-scatter run behind its "
        "GEMMs, as Megatron's layer always does, with no flag (chapter 07) (the book's)"))
    context_parallel_size: int = opt(1, "parallelism", (
        "cp, ranks each sequence is split over (chapter 04); dp = world size / (tp x cp x pp)"), ok=AT_LEAST_1)
    cp_comm_type: str = opt("p2p", "parallelism", (
        "how attention reaches the other cp ranks' keys: p2p (ring), all_gather, a2a (Ulysses) or a2a+p2p "
        "(hierarchical) (chapter 04)"), one_of=("p2p", "all_gather", "a2a", "a2a+p2p"))
    hierarchical_context_parallel_sizes: tuple[int, int] | None = opt(None, "parallelism", (
        "with --cp-comm-type a2a+p2p: the all-to-all size and the ring size, product cp; unset: 2 and cp / 2"))
    # expert parallelism (chapter 05): the experts' own grid over the same ranks, cp folded away;
    # expert_dp = world / (etp ep pp)
    expert_model_parallel_size: int = opt(1, "parallelism", (
        "ep, ranks the experts of a layer are spread over (chapter 05); expert dp = world size / (etp x ep x pp)"),
        ok=AT_LEAST_1)
    expert_tensor_parallel_size: int | None = opt(None, "parallelism", (
        "etp, ranks each expert's matrices are cut over (chapter 05); unset: tp"), ok=AT_LEAST_1)
    moe_token_dispatcher_type: str = opt("alltoall", "moe", (
        "how tokens reach the ranks of their experts: alltoall or allgather"), one_of=("alltoall", "allgather"))
    # mixed precision (chapter 06): 16-bit parameters and activations (the model's params_dtype
    # must say bfloat16 / float16; --bf16 and --fp16 set it), float32 main parameters in the optimizer
    bf16: bool = opt(False, "mixed precision", (
        "bfloat16 mixed precision: bf16 parameters and activations, float32 main parameters and gradients in the "
        "optimizer (sets --params-dtype bfloat16; chapter 06)"))
    fp16: bool = opt(False, "mixed precision", (
        "float16 mixed precision with loss scaling: fp16 parameters and activations, float32 main parameters (sets "
        "--params-dtype float16; chapter 06)"))
    loss_scale: float | None = opt(None, "mixed precision", (
        "a constant loss scale (a power of 2); unset: dynamic with --fp16, none with --bf16 (chapter 06)"),
        ok=POSITIVE)
    initial_loss_scale: float = opt(2.0 ** 32, "mixed precision", "--fp16's dynamic loss scale to start from")
    min_loss_scale: float = opt(1.0, "mixed precision", "the dynamic loss scale never drops below this")
    loss_scale_window: int = opt(1000, "mixed precision", (
        "clean steps in a row after which the dynamic loss scale doubles"), ok=AT_LEAST_1)
    hysteresis: int = opt(2, "mixed precision", (
        "overflowing steps before the dynamic loss scale halves (refilled only when it grows)"), ok=AT_LEAST_1)
    accumulate_allreduce_grads_in_fp32: bool = opt(False, "mixed precision", (
        "accumulate and reduce the gradients in float32 (always with --bf16)"))
    grad_reduce_in_bf16: bool = opt(False, "mixed precision", (
        "with --bf16: accumulate and reduce the gradients in bfloat16 instead"))
    # FP8 (chapter 06): the transformer layers' GEMMs in FP8 (fp8/), Megatron's flags
    fp8_format: str | None = opt(None, "mixed precision", (
        "the transformer layers' GEMMs in FP8: hybrid (e4m3 forward, e5m2 output gradients) or e4m3; unset: no FP8 "
        "(chapter 06)"), one_of=("hybrid", "e4m3"))
    fp8_recipe: str = opt("delayed", "mixed precision", (
        "how FP8 tensors are scaled: tensorwise, delayed, blockwise or mxfp8"),
        one_of=("tensorwise", "delayed", "blockwise", "mxfp8"))
    fp8_margin: int = opt(0, "mixed precision", "delayed scaling: scale = fp8_max / amax / 2^margin", ok=AT_LEAST_0)
    fp8_amax_history_len: int = opt(1, "mixed precision", (
        "delayed scaling: amaxes remembered per tensor role (at most 1024, Transformer Engine's default, or the "
        "run's train_iters x grad_accum_steps)"), ok=AT_LEAST_1)
    fp8_amax_compute_algo: str = opt("most_recent", "mixed precision", (
        "delayed scaling: the scale from the latest amax (most_recent) or the history's max"),
        one_of=("most_recent", "max"))
    kernels: str = opt("torch", "training", (
        "torch; triton: the norms, FlashAttention-2, SwiGLU and the loss as Triton kernels (interpreted on a CPU: "
        "for reading, not speed); compile: each layer through torch.compile (chapter 07) (the book's)"),
        switches=[("--compile", "compile", "each transformer layer through torch.compile, the same as --kernels "
                                           "compile (chapter 07) (the book's)")], one_of=("torch", "triton", "compile"))
    # activation recompute (chapter 07, recompute.py), Megatron's flags
    recompute_granularity: str | None = opt(None, "training", (
        "activation recompute (chapter 07): full (whole layers, in units) or selective (the parts "
        "--recompute-modules names); unset: none"),
        switches=[("--recompute-activations", "selective", "selective recompute of --recompute-modules (Megatron's "
                                                           "older switch)")], one_of=("full", "selective"))
    recompute_method: str | None = opt(None, "training", (
        "full recompute: uniform (every --recompute-num-layers layers one unit) or block (the first "
        "--recompute-num-layers layers of each chunk)"))
    recompute_num_layers: int | None = opt(None, "training", (
        "full recompute: layers per unit (uniform) or recomputed layers per chunk (block)"))
    recompute_modules: tuple[str, ...] = opt(("core_attn",), "training", (
        "selective recompute: any of core_attn, mlp, moe, moe_act, layernorm"))
    # torch.profiler over steps [profile_step_start, profile_step_end) (chapter 07, profiling.py)
    profile: bool = opt(False, "training", (
        "torch.profiler over --profile-step-start .. --profile-step-end: a Chrome trace per rank in "
        "<out-dir>/torch_profile/ and rank 0's top operators (chapter 07)"))
    profile_step_start: int = opt(10, "logging", "with --profile: the first step recorded, counted from 0 (chapter 07)")
    profile_step_end: int = opt(12, "logging", "with --profile: the step the recording stops before")
    profile_ranks: tuple[int, ...] = opt((), "logging", "with --profile: the ranks that profile; unset: all")
    # documents inside a window (chapter 07, data/gpt_dataset.py document_masks), Megatron's switches
    reset_position_ids: bool = opt(False, "training", "positions count from 0 after each <eod> (chapter 07)")
    reset_attention_mask: bool = opt(False, "training", (
        "each token attends only to the tokens of its own document (chapter 07)"))
    eod_mask_loss: bool = opt(False, "training", "no loss where the input token is <eod> (chapter 07)")
    data_seed: int = opt(1234, "data", "seeds the data order and the dropout masks, >= 0 (the book's)")
    device: str = opt("cpu", "training", "cpu (gloo, the tested path) or cuda (NCCL, one GPU per rank) (the book's)",
        one_of=("cpu", "cuda"))
    progress: bool = opt(True, "training", switches=[
        ("--no-progress", False, "no progress bar (the book's)"),
        ("--progress", True, "a progress bar on rank 0 (the book's)")])

    @property
    def etp(self) -> int:
        """The expert tensor-parallel size: expert_tensor_parallel_size, by default the dense tp
        (Megatron's default)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def main_grads_dtype(self):
        """The dtype gradients are accumulated and reduced in: float32 with bf16 (unless
        grad_reduce_in_bf16) or with accumulate_allreduce_grads_in_fp32; else the parameters'
        (None). Megatron's rule (megatron/training/arguments.py, checked on main d98e8a6)."""
        if (self.bf16 and not self.grad_reduce_in_bf16) or (self.fp16 and self.accumulate_allreduce_grads_in_fp32):
            return torch.float32
        return None

    def validate(self, model: ModelConfig | None = None) -> "TrainConfig":
        """ConfigError naming the field and the numbers for any value that cannot train; with
        the `model`, also what depends on it (the sequence length, the largest learning rate
        AdamW can take in the model's dtype: adamw_step_bound)."""
        check_fields(self)
        need(0 <= self.min_lr <= self.lr, f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        need(0 <= self.lr_warmup_iters <= self.train_iters,
             f"lr_warmup_iters={self.lr_warmup_iters} must be in [0, train_iters={self.train_iters}]")
        need(self.data_seed >= 0, f"data_seed={self.data_seed} must be >= 0 (numpy's generators take no negative seed)")
        need(self.save_interval >= 0, f"save_interval={self.save_interval} must be >= 0 (0: save at the end only)")
        need(self.exit_interval is None or self.exit_interval > 0, f"exit_interval={self.exit_interval} must be > 0")
        for name in ("no_load_optim", "no_load_rng", "finetune"):
            need(not getattr(self, name) or self.ckpt_format == "torch_dist",
                 f"{name} with ckpt_format={self.ckpt_format!r}: only a torch_dist checkpoint loads in parts "
                 f"(--ckpt-format torch_dist)")
        need(self.eval_interval >= 0 and self.eval_iters >= 0,
             f"eval_interval={self.eval_interval} and eval_iters={self.eval_iters} must be >= 0")
        need(self.device != "cuda" or torch.cuda.is_available(),
             "device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False)")
        need(self.zero_stage in (0, 1, 2, 3), f"zero_stage={self.zero_stage} is not 0, 1, 2 or 3")
        need(not self.overlap_param_gather or self.overlap_grad_reduce,
             "overlap_param_gather needs overlap_grad_reduce (Megatron's rule)")
        need(not (self.overlap_grad_reduce or self.overlap_param_gather) or self.zero_stage in (1, 2),
             f"overlap_grad_reduce / overlap_param_gather with zero_stage={self.zero_stage}: they time "
             f"ZeRO-1/2's reduce-scatters and all-gathers (the bucketed DDP always overlaps its all-reduces; ZeRO-3 "
             f"gathers per unit)")
        need(not (self.bf16 and self.fp16), "bf16 and fp16 are both set: choose one")
        if self.loss_scale is not None:
            need(self.bf16 or self.fp16, f"loss_scale={self.loss_scale:g} without fp16 or bf16: a float32 run has no "
                                         f"loss scaler, and the scale would be ignored (--loss-scale goes with --fp16 "
                                         f"or --bf16)")
            need(math.frexp(self.loss_scale)[0] == 0.5,             # 2^k exactly: the mantissa is 1/2
                 f"--{'fp16' if self.fp16 else 'bf16'} --loss-scale {self.loss_scale:g}: a static loss scale must be a "
                 f"power of 2 (multiplying and dividing by one changes only the exponent, exactly), e.g. "
                 f"{2.0 ** math.floor(math.log2(self.loss_scale)):g} or {2.0 ** math.ceil(math.log2(self.loss_scale)):g}")
        need(0 < self.min_loss_scale <= self.initial_loss_scale,
             f"min_loss_scale={self.min_loss_scale} must be in (0, initial_loss_scale={self.initial_loss_scale}]")
        need(not self.grad_reduce_in_bf16 or self.bf16, "grad_reduce_in_bf16 needs bf16")
        need(self.fp8_format is not None or self.fp8_recipe == "delayed",
             f"fp8_recipe={self.fp8_recipe!r} without fp8_format: no FP8 at all, the run would train in "
             f"{'bf16' if self.bf16 else 'fp16' if self.fp16 else 'float32'} (add --fp8-format hybrid or e4m3)")
        recorded = self.train_iters * self.grad_accum_steps        # amaxes one tensor role records in the run
        need(self.fp8_amax_history_len <= max(AMAX_HISTORY_LEN_TE, recorded),
             f"fp8_amax_history_len={self.fp8_amax_history_len} is longer than Transformer Engine's default history "
             f"({AMAX_HISTORY_LEN_TE}) and than the amaxes this run records per tensor role (train_iters="
             f"{self.train_iters} x grad_accum_steps={self.grad_accum_steps} = {recorded}): the entries past those "
             f"are never written, and each costs 4 bytes per role of every FP8 layer "
             f"({4 * self.fp8_amax_history_len / 2 ** 20:,.0f} MiB a role here)")
        self._validate_recompute()
        if self.profile:
            need(0 <= self.profile_step_start < self.profile_step_end <= self.train_iters,
                 f"profile: profile_step_start={self.profile_step_start} and profile_step_end={self.profile_step_end} "
                 f"must satisfy 0 <= start < end <= train_iters={self.train_iters} (steps counted from 0)")
        # how the sizes combine with the model and the world: parallelize.validate_layout
        if model is not None:
            wanted = "bfloat16" if self.bf16 else "float16" if self.fp16 else None
            need(wanted is None or model.params_dtype == wanted,
                 f"{'bf16' if self.bf16 else 'fp16'} needs the model's params_dtype={wanted!r}, not "
                 f"{model.params_dtype!r} (--{'bf16' if self.bf16 else 'fp16'} sets both)")
            need(self.seq_length <= model.max_position_embeddings,
                 f"seq_length={self.seq_length} is longer than max_position_embeddings={model.max_position_embeddings}")
            adamw_step_bound(self, model.dtype)
            need(not (self.kernels == "triton" and model.attention_backend == "naive"),
                 "kernels='triton' with attention_backend='naive': the Triton FlashAttention replaces the attention "
                 "core, so the naive one would never run (--kernels triton takes the default --attention-backend sdpa)")
            moe_modules = [m for m in self.recompute_modules if m in ("moe", "moe_act")]
            need(not (self.recompute_granularity == "selective" and moe_modules and model.num_experts is None),
                 f"recompute_modules {', '.join(moe_modules)} on a dense model (num_experts unset): there are no "
                 f"experts to recompute (the dense MLP is 'mlp')")
        return self

    def _validate_recompute(self) -> None:
        """Megatron's rules (TransformerConfig.__post_init__, checked on main d98e8a6): full needs
        a method and a number of layers; selective takes neither, and its modules from the list."""
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity == "full":
            need(method in ("uniform", "block"),
                 f"recompute_granularity='full' needs recompute_method 'uniform' or 'block', got {method!r}")
            need(n is not None and n >= 1, f"recompute_granularity='full' needs recompute_num_layers >= 1, got {n}")
        else:
            need(method is None and n is None, f"recompute_method={method!r} and recompute_num_layers={n} are for "
                                               f"recompute_granularity='full' (got {granularity!r})")
        need(granularity == "selective" or tuple(self.recompute_modules) == DEFAULT_RECOMPUTE_MODULES,
             f"recompute_modules={list(self.recompute_modules)} with recompute_granularity={granularity!r}: the modules "
             f"are for recompute_granularity='selective', and would be ignored (--recompute-granularity selective)")
        if granularity == "selective":
            megatron_only = {"mla_up_proj", "shared_experts", "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc"}
            for name in self.recompute_modules:
                need(name not in megatron_only, f"recompute_modules: {name!r} is Megatron's, not in this book "
                                                f"(here: core_attn, mlp, moe, moe_act, layernorm)")
                need(name in ("core_attn", "mlp", "moe", "moe_act", "layernorm"),
                     f"recompute_modules: {name!r} is not one of core_attn, mlp, moe, moe_act, layernorm")
            need(len(self.recompute_modules) > 0, "recompute_granularity='selective' with no recompute_modules")


DEFAULT_RECOMPUTE_MODULES = ("core_attn",)     # TrainConfig.recompute_modules' default, Megatron's
# Transformer Engine's DelayedScaling keeps 1024 amaxes per tensor role by default; a longer
# --fp8-amax-history-len is refused unless the run records that many (TrainConfig.validate)
AMAX_HISTORY_LEN_TE = 1024


def adamw_step_bound(cfg: TrainConfig, dtype: torch.dtype) -> None:
    """ConfigError when torch's AdamW cannot take cfg.lr for parameters of `dtype`: its step size
    lr / (1 - adam_beta1^t), largest at t = 1, must not exceed the largest number of the dtype the
    update computes in (float32 for float32 and bfloat16 parameters, float64 for float64), or
    torch raises "value cannot be converted to type float without overflow" (torch 2.13). A huge
    lr below the bound trains to a non-finite loss, which nonfinite.check_finite_step stops."""
    compute = torch.promote_types(dtype, torch.float32)
    name, biggest = str(compute).replace("torch.", ""), torch.finfo(compute).max
    first_step = cfg.lr / (1.0 - cfg.adam_beta1)
    if not first_step <= biggest:
        raise ConfigError(f"lr={cfg.lr} is too large for AdamW: its first step moves a parameter by up to "
                          f"lr / (1 - adam_beta1={cfg.adam_beta1}) = {first_step:.3g}, more than the largest "
                          f"{name} number {biggest:.3g} (torch raises 'value cannot be converted to type float "
                          f"without overflow'); lr must be at most {biggest * (1.0 - cfg.adam_beta1):.3g}")


to_dict = dataclasses.asdict            # a config as a plain dict (stored in checkpoints and logs)


__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "to_dict",
           "dtype_from_name", "check_fields", "adamw_step_bound", "DTYPES",
           "DEFAULT_RECOMPUTE_MODULES", "AMAX_HISTORY_LEN_TE"]
