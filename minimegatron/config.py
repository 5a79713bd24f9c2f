"""Configuration dataclasses: the model and the training run (its parallel sizes included).

Field names follow Megatron-LM's command-line arguments where one exists
(`--hidden-size` -> `hidden_size`, `--num-query-groups` -> `num_query_groups`, ...),
so a learner can carry a config between the two.

Every config has a `validate()` that raises `ConfigError` (a `ValueError`) naming the
field and the numbers, e.g.

    ConfigError: hidden_size=100 is not divisible by num_attention_heads=3

Validation runs before any process is spawned or any tensor allocated. Every float field
must first be a finite number (`check_finite`): an infinite learning rate or loss weight
used to train to NaN and exit 0, an infinite capacity factor to raise OverflowError deep in
the router.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the fields and the numbers."""


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_finite(cfg: Any) -> None:
    """ConfigError naming the first float field of the dataclass `cfg` that is inf or nan.

    Every range check after this one may then compare numbers as numbers: nan fails every
    comparison (so `nan > 0` is refused as "must be positive", but `not nan < 0` would pass),
    and inf passes every "must be positive" and ">= 0" check while training to NaN."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")


@dataclass
class ModelConfig:
    """A decoder-only transformer: GPT-2 style or LLaMA style.

    GPT-2 style: LayerNorm, GELU MLP, learned absolute positions, biases, tied embeddings.
    LLaMA style: RMSNorm, SwiGLU MLP, rotary positions (RoPE), no biases, grouped-query
    attention (num_query_groups < num_attention_heads), untied embeddings.
    Use `ModelConfig.gpt2(...)` / `ModelConfig.llama(...)` for the presets.
    """

    vocab_size: int = 257                 # byte tokenizer: 256 bytes + <eod>
    # tensor parallelism pads the vocabulary to a multiple of this x tp (Megatron's
    # --make-vocab-size-divisible-by, default 128, pads on one device too; here the
    # single-device model keeps exactly vocab_size rows, and 1 pads only as much as tp needs)
    make_vocab_size_divisible_by: int = 1
    hidden_size: int = 64                 # h
    num_layers: int = 2                   # L
    num_attention_heads: int = 4          # a (query heads)
    num_query_groups: int | None = None   # g (key/value heads); None = a (multi-head attention)
    ffn_hidden_size: int | None = None    # f; None = 4h (GELU) or about 8h/3 (SwiGLU)
    max_position_embeddings: int = 64     # longest sequence the model accepts
    normalization: str = "LayerNorm"      # "LayerNorm" | "RMSNorm"
    activation: str = "gelu"              # "gelu" | "swiglu"
    position_embedding_type: str = "learned_absolute"  # "learned_absolute" | "rope"
    rotary_base: float = 10000.0
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0           # dropout on the residual branches
    attention_dropout: float = 0.0        # dropout on the attention probabilities
    attention_backend: str = "sdpa"       # "sdpa" (fused exact kernel) | "naive" (written out: exercise 0.1)
    seed: int = 1234                      # initial weights depend on (seed, parameter name) only
    params_dtype: str = "float32"         # "float32" | "float64" | "bfloat16" | "float16"
    # mixture of experts (chapter 05); None: a dense MLP everywhere
    num_experts: int | None = None        # E experts in every moe_layer_freq-th layer
    moe_router_topk: int = 2              # k experts per token
    moe_ffn_hidden_size: int | None = None   # an expert's inner width; None = ffn_hidden_size
    moe_layer_freq: int = 1               # layer i is an MoE layer when i % moe_layer_freq == 0
    moe_shared_expert_intermediate_size: int | None = None   # a dense expert every token also takes
    moe_router_score_function: str = "softmax"   # "softmax" | "sigmoid"
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k (else after)
    moe_aux_loss_coeff: float = 0.0       # load-balancing loss (Switch / GShard)
    moe_z_loss_coeff: float = 0.0         # router z-loss (ST-MoE)
    moe_expert_capacity_factor: float | None = None   # None: no capacity, no token dropped
    moe_token_drop_policy: str = "probs"  # "probs" | "position": which tokens an expert keeps
    moe_router_load_balancing_type: str = "aux_loss"   # "aux_loss" (per micro-batch) | "seq_aux_loss" (per sequence)
    moe_router_enable_expert_bias: bool = False   # DeepSeek-V3's bias for the choice (sigmoid scores)
    moe_router_bias_update_rate: float = 1e-3     # the bias's step per training step

    # ---- presets -------------------------------------------------------------------
    @classmethod
    def gpt2(cls, **overrides: Any) -> "ModelConfig":
        base = dict(normalization="LayerNorm", activation="gelu",
                    position_embedding_type="learned_absolute", add_bias_linear=True,
                    untie_embeddings_and_output_weights=False)
        return cls(**{**base, **overrides})

    @classmethod
    def llama(cls, **overrides: Any) -> "ModelConfig":
        base = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                    add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    num_query_groups=2)
        return cls(**{**base, **overrides})

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
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        check_finite(self)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        need(self.num_query_groups is None or self.num_query_groups > 0,
             f"num_query_groups={self.num_query_groups} must be positive (leave it unset for "
             f"multi-head attention, num_query_groups = num_attention_heads)")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size={self.hidden_size} is not divisible by "
             f"num_attention_heads={self.num_attention_heads}")
        need(self.query_groups > 0 and self.num_attention_heads % self.query_groups == 0,
             f"num_attention_heads={self.num_attention_heads} is not divisible by "
             f"num_query_groups={self.query_groups}")
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"normalization={self.normalization!r} is not 'LayerNorm' or 'RMSNorm'")
        need(self.activation in ("gelu", "swiglu"),
             f"activation={self.activation!r} is not 'gelu' or 'swiglu'")
        need(self.position_embedding_type in ("learned_absolute", "rope"),
             f"position_embedding_type={self.position_embedding_type!r} is not "
             f"'learned_absolute' or 'rope'")
        need(self.position_embedding_type != "rope" or self.kv_channels % 2 == 0,
             f"rope needs an even head size, got kv_channels={self.kv_channels} "
             f"(hidden_size={self.hidden_size} / num_attention_heads={self.num_attention_heads})")
        need(self.attention_backend in ("naive", "sdpa"),
             f"attention_backend={self.attention_backend!r} is not 'naive' or 'sdpa'")
        # positive and finite: with a negative epsilon the variance plus epsilon can reach 0
        # or below, a rotary base of 0 makes the frequencies infinite (both train to NaN),
        # and a negative std is no standard deviation (it used to be taken silently)
        for name in ("layernorm_epsilon", "rotary_base", "init_method_std"):
            value = getattr(self, name)
            need(value > 0, f"{name}={value} must be positive")
        for name in ("hidden_dropout", "attention_dropout"):
            need(0.0 <= getattr(self, name) < 1.0, f"{name}={getattr(self, name)} must be in [0, 1)")
        need(self.ffn_size > 0, f"ffn_hidden_size={self.ffn_hidden_size} must be positive")
        if self.num_experts is not None:
            need(self.num_experts >= 1, f"num_experts={self.num_experts} must be at least 1")
            need(1 <= self.moe_router_topk <= self.num_experts,
                 f"moe_router_topk={self.moe_router_topk} must be in [1, num_experts={self.num_experts}]")
            need(self.moe_layer_freq >= 1, f"moe_layer_freq={self.moe_layer_freq} must be at least 1")
            for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor"):
                value = getattr(self, name)
                need(value is None or value > 0, f"{name}={value} must be positive")
            need(self.moe_router_score_function in ("softmax", "sigmoid"),
                 f"moe_router_score_function={self.moe_router_score_function!r} is not 'softmax' or 'sigmoid'")
            need(not self.moe_router_pre_softmax or self.moe_router_score_function == "softmax",
                 "moe_router_pre_softmax applies to moe_router_score_function='softmax' only")
            for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                need(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")
            need(self.moe_token_drop_policy in ("probs", "position"),
                 f"moe_token_drop_policy={self.moe_token_drop_policy!r} is not 'probs' or 'position'")
            need(self.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss"),
                 f"moe_router_load_balancing_type={self.moe_router_load_balancing_type!r} is not 'aux_loss' "
                 f"or 'seq_aux_loss'")
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

    data_path: str | None = None          # prefix of a .bin/.idx pair; None = embedded corpus
    tokenizer: str = "byte"               # "byte" | path to a trained BPE tokenizer .json
    seq_length: int = 64
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    train_iters: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 20
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    adam_impl: str = "default"           # torch's AdamW: "default" (a for-loop on a CPU) | "foreach" | "fused"
    clip_grad: float = 1.0                # 0 disables clipping
    eval_interval: int = 50
    eval_iters: int = 4
    save_interval: int = 0                # 0 = save only at the end (when save_dir is set)
    save_dir: str | None = None
    load_dir: str | None = None
    ckpt_format: str = "torch"            # "torch": one file per rank, the same layout to resume (chapter 00)
                                          # "torch_dist": pieces with global offsets, any layout (chapter 08)
    exit_interval: int | None = None      # stop after an iteration divisible by it, saving first
    no_load_optim: bool = False           # torch_dist: the model only; the optimizer starts fresh
    no_load_rng: bool = False             # torch_dist: the random states are seeded afresh
    finetune: bool = False                # torch_dist: the model only, from iteration 0
    out_dir: str = "runs/latest"          # loss log and plot
    # data parallelism (chapter 01); the data-parallel size is the number of ranks
    zero_stage: int = 0                   # 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters sharded
    ddp_impl: str = "bucketed"            # zero_stage 0: "naive" (one all-reduce per gradient) | "bucketed"
    ddp_bucket_size: int | None = None    # elements per bucket; None = Megatron's default for DDP,
                                          # one bucket per weight-decay group for ZeRO-1/2
    overlap_grad_reduce: bool = False     # ZeRO-1/2: each bucket's reduce-scatter launched from the backward
    overlap_param_gather: bool = False    # ZeRO-1/2: the parameter all-gathers waited in the next forward
    # tensor parallelism (chapter 02): the ranks form a grid, tp fastest; dp = world / tp
    tensor_model_parallel_size: int = 1   # each matrix split over this many ranks
    # pipeline parallelism (chapter 03): pp stages, the slowest dimension; dp = world / (tp pp)
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"       # "gpipe" | "1f1b" | "interleaved"; grad_accum_steps micro-batches
    num_virtual_stages_per_pipeline_rank: int = 1   # model chunks per rank (> 1: interleaved)
    overlap_p2p_comm: bool = False        # post each receive one op ahead, so it arrives during compute (chapter 07)
    # sequence and context parallelism (chapter 04); dp = world / (tp cp pp)
    sequence_parallel: bool = False       # with tp > 1: norms, dropout, residuals hold s/tp tokens
    overlap_sp_backward: bool = False     # SP's backward collectives behind its GEMMs (chapter 07, tp/overlap.py)
    context_parallel_size: int = 1        # cp, ranks each sequence is split over (zig-zag)
    cp_comm_type: str = "p2p"             # "p2p" (ring) | "all_gather" | "a2a" (Ulysses) | "a2a+p2p"
    hierarchical_context_parallel_sizes: tuple[int, int] | None = None   # a2a+p2p: (all-to-all, ring) sizes
    # expert parallelism (chapter 05): the experts' own grid over the same ranks, cp folded away;
    # expert_dp = world / (etp ep pp)
    expert_model_parallel_size: int = 1   # ep, ranks the experts of a layer are spread over
    expert_tensor_parallel_size: int | None = None   # etp, ranks each expert's matrices are cut over; None = tp
    moe_token_dispatcher_type: str = "alltoall"      # "alltoall" | "allgather"
    # mixed precision (chapter 06): 16-bit parameters and activations (the model's params_dtype
    # must say bfloat16 / float16; --bf16 and --fp16 set it), float32 main parameters in the optimizer
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None       # a constant loss scale; None: dynamic with fp16, none with bf16
    initial_loss_scale: float = 2.0 ** 32  # fp16's dynamic scaler (grad_scaler.py), Megatron's defaults
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000         # clean steps in a row before the scale doubles
    hysteresis: int = 2                   # overflows before the scale halves
    accumulate_allreduce_grads_in_fp32: bool = False   # main_grad in float32 (always with bf16, unless:)
    grad_reduce_in_bf16: bool = False     # bf16: accumulate and reduce the gradients in bf16
    # FP8 (chapter 06): the transformer layers' GEMMs in FP8 (fp8/), Megatron's flags
    fp8_format: str | None = None         # None: no FP8 | "hybrid" (e4m3 forward, e5m2 gradients) | "e4m3"
    fp8_recipe: str = "delayed"           # "tensorwise" | "delayed" | "blockwise" | "mxfp8"
    fp8_margin: int = 0                   # delayed: scale = fp8_max / amax / 2^margin
    fp8_amax_history_len: int = 1         # delayed: amaxes remembered per tensor role
    fp8_amax_compute_algo: str = "most_recent"   # delayed: "most_recent" | "max" over the history
    kernels: str = "torch"                # "torch" | "triton" (norms, attention, SwiGLU, loss in Triton) | "compile" (chapter 07)
    # activation recompute (chapter 07, recompute.py), Megatron's flags
    recompute_granularity: str | None = None   # None: keep every activation | "full" | "selective"
    recompute_method: str | None = None   # full: "uniform" (units of recompute_num_layers) | "block"
    recompute_num_layers: int | None = None    # full: layers per unit (uniform), recomputed per chunk (block)
    recompute_modules: tuple[str, ...] = ("core_attn",)   # selective: which parts (recompute.RECOMPUTE_MODULES)
                                                          # (DEFAULT_RECOMPUTE_MODULES)
    # torch.profiler over steps [profile_step_start, profile_step_end) (chapter 07, profiling.py)
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = ()   # the ranks that profile; () = all
    # documents inside a window (chapter 07, data/gpt_dataset.py document_masks), Megatron's switches
    reset_position_ids: bool = False      # positions count from 0 after each <eod>
    reset_attention_mask: bool = False    # a token attends only to its own document
    eod_mask_loss: bool = False           # no loss where the input token is <eod>
    data_seed: int = 1234                 # data order and dropout masks
    device: str = "cpu"                   # "cpu" (gloo, the tested path) | "cuda" (NCCL, one GPU per rank)
    progress: bool = True

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
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        check_finite(self)
        for name in ("seq_length", "micro_batch_size", "grad_accum_steps", "train_iters"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        need(self.lr > 0, f"lr={self.lr} must be positive")
        need(0 <= self.min_lr <= self.lr, f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        need(0 <= self.lr_warmup_iters <= self.train_iters,
             f"lr_warmup_iters={self.lr_warmup_iters} must be in [0, train_iters={self.train_iters}]")
        need(self.clip_grad >= 0, f"clip_grad={self.clip_grad} must be >= 0")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):      # torch.optim.AdamW's own ranges
            need(0.0 <= getattr(self, name) < 1.0, f"{name}={getattr(self, name)} must be in [0, 1)")
        need(self.adam_eps > 0, f"adam_eps={self.adam_eps} must be positive")
        need(self.adam_impl in ("default", "foreach", "fused"),
             f"adam_impl={self.adam_impl!r} is not 'default', 'foreach' or 'fused'")
        need(self.data_seed >= 0, f"data_seed={self.data_seed} must be >= 0 (numpy's generators take no "
                                  f"negative seed)")
        need(self.save_interval >= 0, f"save_interval={self.save_interval} must be >= 0 (0: save at the end only)")
        need(self.ckpt_format in ("torch", "torch_dist"), f"ckpt_format={self.ckpt_format!r} is not 'torch' or "
                                                          f"'torch_dist'")
        need(self.exit_interval is None or self.exit_interval > 0, f"exit_interval={self.exit_interval} must be > 0")
        for name in ("no_load_optim", "no_load_rng", "finetune"):
            need(not getattr(self, name) or self.ckpt_format == "torch_dist",
                 f"{name} with ckpt_format={self.ckpt_format!r}: only a torch_dist checkpoint loads in parts "
                 f"(--ckpt-format torch_dist)")
        need(self.eval_interval >= 0 and self.eval_iters >= 0,
             f"eval_interval={self.eval_interval} and eval_iters={self.eval_iters} must be >= 0")
        need(self.device in ("cpu", "cuda"), f"device={self.device!r} is not 'cpu' or 'cuda'")
        need(self.device != "cuda" or torch.cuda.is_available(),
             "device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False)")
        need(self.zero_stage in (0, 1, 2, 3), f"zero_stage={self.zero_stage} is not 0, 1, 2 or 3")
        need(self.ddp_impl in ("naive", "bucketed"), f"ddp_impl={self.ddp_impl!r} is not 'naive' or 'bucketed'")
        need(not self.overlap_param_gather or self.overlap_grad_reduce,
             "overlap_param_gather needs overlap_grad_reduce (Megatron's rule)")
        need(not (self.overlap_grad_reduce or self.overlap_param_gather) or self.zero_stage in (1, 2),
             f"overlap_grad_reduce / overlap_param_gather with zero_stage={self.zero_stage}: they time ZeRO-1/2's "
             f"reduce-scatters and all-gathers (the bucketed DDP always overlaps its all-reduces; ZeRO-3 gathers per "
             f"unit)")
        need(self.ddp_bucket_size is None or self.ddp_bucket_size > 0,
             f"ddp_bucket_size={self.ddp_bucket_size} must be positive")
        need(self.cp_comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"),
             f"cp_comm_type={self.cp_comm_type!r} is not one of p2p, all_gather, a2a, a2a+p2p")
        need(self.moe_token_dispatcher_type in ("alltoall", "allgather"),
             f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r} is not 'alltoall' or 'allgather'")
        need(self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
             f"expert_tensor_parallel_size={self.expert_tensor_parallel_size} must be >= 1")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "num_virtual_stages_per_pipeline_rank"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(not (self.bf16 and self.fp16), "bf16 and fp16 are both set: choose one")
        need(self.loss_scale is None or self.loss_scale > 0, f"loss_scale={self.loss_scale} must be positive")
        if self.loss_scale is not None:
            need(self.bf16 or self.fp16, f"loss_scale={self.loss_scale:g} without fp16 or bf16: a float32 run has no "
                                         f"loss scaler, and the scale would be ignored (--loss-scale goes with --fp16 "
                                         f"or --bf16)")
            need(is_power_of_two(self.loss_scale),
                 f"--{'fp16' if self.fp16 else 'bf16'} --loss-scale {self.loss_scale:g}: a static loss scale must be a "
                 f"power of 2 (multiplying and dividing by one changes only the exponent, exactly), e.g. "
                 f"{2.0 ** math.floor(math.log2(self.loss_scale)):g} or {2.0 ** math.ceil(math.log2(self.loss_scale)):g}")
        need(0 < self.min_loss_scale <= self.initial_loss_scale,
             f"min_loss_scale={self.min_loss_scale} must be in (0, initial_loss_scale={self.initial_loss_scale}]")
        for name in ("loss_scale_window", "hysteresis"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(not self.grad_reduce_in_bf16 or self.bf16, "grad_reduce_in_bf16 needs bf16")
        need(self.fp8_format in (None, "hybrid", "e4m3"), f"fp8_format={self.fp8_format!r} is not 'hybrid' or 'e4m3'")
        need(self.fp8_recipe in ("tensorwise", "delayed", "blockwise", "mxfp8"),
             f"fp8_recipe={self.fp8_recipe!r} is not one of tensorwise, delayed, blockwise, mxfp8")
        need(self.fp8_margin >= 0, f"fp8_margin={self.fp8_margin} must be >= 0")
        need(self.fp8_amax_history_len >= 1, f"fp8_amax_history_len={self.fp8_amax_history_len} must be >= 1")
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
        need(self.fp8_amax_compute_algo in ("most_recent", "max"),
             f"fp8_amax_compute_algo={self.fp8_amax_compute_algo!r} is not 'most_recent' or 'max'")
        need(self.kernels in ("torch", "triton", "compile"), f"kernels={self.kernels!r} is not 'torch', 'triton' or 'compile'")
        self._validate_recompute(need)
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
                 f"seq_length={self.seq_length} is longer than "
                 f"max_position_embeddings={model.max_position_embeddings}")
            adamw_step_bound(self, model.dtype)
            need(not (self.kernels == "triton" and model.attention_backend == "naive"),
                 "kernels='triton' with attention_backend='naive': the Triton FlashAttention replaces the attention "
                 "core, so the naive one would never run (--kernels triton takes the default --attention-backend sdpa)")
            moe_modules = [m for m in self.recompute_modules if m in ("moe", "moe_act")]
            need(not (self.recompute_granularity == "selective" and moe_modules and model.num_experts is None),
                 f"recompute_modules {', '.join(moe_modules)} on a dense model (num_experts unset): there are no "
                 f"experts to recompute (the dense MLP is 'mlp')")
        return self


    def _validate_recompute(self, need) -> None:
        """Megatron's rules (TransformerConfig.__post_init__, checked on main d98e8a6): full needs
        a method and a number of layers; selective takes neither, and its modules from the list."""
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        need(granularity in (None, "full", "selective"),
             f"recompute_granularity={granularity!r} is not 'full' or 'selective'")
        if granularity == "full":
            need(method in ("uniform", "block"),
                 f"recompute_granularity='full' needs recompute_method 'uniform' or 'block', got {method!r}")
            need(n is not None and n >= 1, f"recompute_granularity='full' needs recompute_num_layers >= 1, got {n}")
        else:
            need(method is None and n is None,
                 f"recompute_method={method!r} and recompute_num_layers={n} are for recompute_granularity='full' "
                 f"(got {granularity!r})")
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


def is_power_of_two(x: float) -> bool:
    """Is the positive finite float x exactly 2^k for an integer k (k < 0 too)?"""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def adamw_step_bound(cfg: TrainConfig, dtype: torch.dtype) -> None:
    """ConfigError when torch's AdamW cannot take cfg.lr for parameters of `dtype`.

    The bound is AdamW's own, not a taste: each step adds exp_avg / denom times the step size
    lr / (1 - adam_beta1^t) to the parameters, and torch raises "value cannot be converted to
    type float without overflow" when that scalar exceeds the largest number of the dtype the
    addition computes in (float32 for float32 and bfloat16 parameters: 3.4e38; float64 for
    float64 ones, where it would instead overflow to an infinite step and NaN). It is largest
    at the first step, t = 1: lr / (1 - adam_beta1). Below the bound a huge lr is accepted; it
    trains to a non-finite loss, which the training loop stops, naming the iteration
    (train.check_finite_step). (Measured with torch 2.13: the weight decay's factor
    1 - lr x weight_decay is not checked; it makes the parameters infinite, caught the same way.)"""
    compute = torch.promote_types(dtype, torch.float32)
    name, biggest = str(compute).replace("torch.", ""), torch.finfo(compute).max
    first_step = cfg.lr / (1.0 - cfg.adam_beta1)
    if not first_step <= biggest:
        raise ConfigError(f"lr={cfg.lr} is too large for AdamW: its first step moves a parameter by up to "
                          f"lr / (1 - adam_beta1={cfg.adam_beta1}) = {first_step:.3g}, more than the largest "
                          f"{name} number {biggest:.3g} (torch raises 'value cannot be converted to type float "
                          f"without overflow'); lr must be at most {biggest * (1.0 - cfg.adam_beta1):.3g}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (stored in checkpoints and logs)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Build a config from a dict, rejecting unknown keys by name."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
    return cls(**values)


__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "to_dict",
           "from_dict", "dtype_from_name", "check_finite", "adamw_step_bound", "is_power_of_two", "DTYPES",
           "DEFAULT_RECOMPUTE_MODULES", "AMAX_HISTORY_LEN_TE"]
