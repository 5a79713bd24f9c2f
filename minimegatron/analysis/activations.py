"""Activation memory: the tensors autograd keeps from the forward pass for the backward pass.

Shape legend (the one of model/gpt.py):
  b micro-batch size     s sequence length     h hidden size        V vocabulary size
  a query heads          g key/value heads     d head size (h / a)  f MLP inner size
  L layers               e bytes per element of the model dtype
  c bytes per element of the "compute" dtype of norms, softmax and loss:
    c = 4 for 16-bit models (they run in fp32), c = e otherwise

Why activations are saved: backward of y = op(x) needs some of op's inputs or outputs.
A linear layer y = x W^T needs x (for dW = dy^T x); a norm needs its input and its
statistics; softmax needs its output; GELU needs its input; a product u * w needs both
factors. Adding saves nothing. Everything an op saves stays alive until its backward has run,
so at the end of the forward pass all of it is held at once: this is what grows with b and s
and what activation recomputation (chapter 06) and sequence parallelism (chapter 04) attack.

This module counts, op by op, what OUR implementation saves (the book's "naive" attention,
and PyTorch's fused "sdpa" for comparison: its s^2 terms are gone), and measures it
(`measure_saved_activation_bytes`) with `torch.autograd.graph.saved_tensors_hooks`; the two
agree to the byte, in fp32, fp64 and bf16, with and without dropout. Korthikanti et al.
2022's well-known 16-bit count is `korthikanti_activation_memory`, for comparison.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from .memory import as_dtype, bytes_per_element

INDEX_BYTES = 8  # token ids, labels and positions are int64


def attention_operands_share_qkv_output(config: ModelConfig, batch: int, seq: int, tp: int = 1
                                         ) -> tuple[bool, bool, bool]:
    """Are the q, k, v that attention saves VIEWS of the fused QKV output (or new tensors)?

    A saved view keeps the whole storage it points into alive; for q, k, v that storage is
    the QKV output [b, s, (a + 2g) d], kept once however many views share it. A new tensor
    costs its own b a s d elements. Which one happens depends on the code path:

      - RoPE (on q and k) produces new tensors. So does the query reshape
        [b, s, g, (a/g) d] -> [b, s, a, d] when it merges real groups (g > 1 and a/g > 1).
      - The "naive" backend copies k and v of grouped-query attention to a heads
        (`repeat_interleave`): new tensors. The "sdpa" backend hands the kernel the g
        key/value heads as they are (enable_gqa=True), so v is always a slice, and k is one
        unless RoPE rotated it.
      - Otherwise q, k, v are strided slices of the QKV output. The "sdpa" kernel saves them
        as they are: views.
      - The "naive" backend's `q @ k^T` and `probs @ v` are 4-D matmuls: torch folds
        [b, a, s, d] into [b a, s, d] for `bmm`, and saves the folded operands. Folding b and
        a of a strided slice is a free view only in degenerate cases (b = 1 or a = 1, or
        s = 1 with plain multi-head attention); in general it is a fresh copy.

    Returns (q_is_view, k_is_view, v_is_view). With the naive backend and b, s, a > 1 all
    three are False: q, k, v are saved as three new [b a, s, d] tensors, 3 b s h elements.
    tp: the heads of one tensor-parallel rank (a / tp and g / tp) decide it.
    """
    a, g = config.num_attention_heads // tp, config.query_groups // tp
    per_group = a // g
    rope = config.position_embedding_type == "rope"
    q_slice = not rope and (g == 1 or per_group == 1)      # q still points into the QKV output
    k_slice = not rope and per_group == 1
    v_slice = per_group == 1
    if config.attention_backend == "sdpa":                  # k, v of g heads, never repeated
        return q_slice, not rope, True
    folds_freely = batch == 1 or a == 1
    return (q_slice and (folds_freely or (per_group == 1 and seq == 1)),
            k_slice and (folds_freely or seq == 1),
            v_slice and (folds_freely or seq == 1))


def _norm_bytes(config: ModelConfig, b: int, s: int, e: int, c: int) -> int:
    """What one norm (LayerNorm or RMSNorm) saves, its output excluded (the next op saves it).

    LayerNorm (F.layer_norm):  input x [b, s, h] (in c), mean and rstd [b, s, 1] (in c)
        = b s h c + 2 b s c
    RMSNorm (written out in linear.py: x.pow(2), rsqrt, x * rstd, y * weight):
        input x [b, s, h], rstd [b, s, 1], normalised y [b, s, h], all in c
        = 2 b s h c + b s c
    16-bit models run norms in fp32: x.to(fp32) is a new tensor (what the norm saves), and so
    are weight.to(fp32) (and bias.to(fp32)): 4h bytes each, saved although not activations.
    """
    h = config.hidden_size
    sixteen_bit = e == 2
    if config.normalization == "LayerNorm":
        return b * s * h * c + 2 * b * s * c + (2 * 4 * h if sixteen_bit else 0)
    return 2 * b * s * h * c + b * s * c + (4 * h if sixteen_bit else 0)


def activation_memory(config: ModelConfig, batch: int, seq: int,
                      dtype: torch.dtype | str | None = None, *, training: bool = True,
                      dropout_mask_itemsize: int | None = None, recompute_granularity: str | None = None,
                      recompute_method: str | None = None, recompute_num_layers: int | None = None,
                      recompute_modules: tuple[str, ...] = ("core_attn",), tp: int = 1,
                      sequence_parallel: bool = False) -> dict:
    """Bytes autograd saves for backward in one forward pass of our GPTModel (with labels).

    dtype: the model's dtype (default config.params_dtype); e = its bytes per element.
    training: dropout runs (model.train()); with False, or p = 0, dropout saves nothing.
    dropout_mask_itemsize: m, bytes per element of a dropout mask. On CPU, PyTorch's dropout
      multiplies by a scaled Bernoulli tensor of the input's dtype and saves it: m = e (the
      default). On CUDA the fused kernel saves a bool mask: pass 1 to model a GPU.

    Per layer, op by op (each line: the op that saves, what it saves, the bytes):

      "input_norm"          input_layernorm                   see `_norm_bytes`
      "qkv_input"           linear_qkv saves its input        b s h e
      "qkv_output"          kept when q, k or v is a view of it (see
                            `attention_operands_share_qkv_output`)   b s (a + 2g) d e
      "query"               q, unless a view                  b a s d e
      "key"                 k, unless a view: naive (repeated to a heads)   b a s d e
                                              sdpa (g heads, enable_gqa)   b g s d e
      "value"               v, unless a view: the same as k
     naive backend (attention.py's `causal_attention`):
      "causal_mask"         masked_fill saves the mask        s s        (bool)
      "softmax_output"      softmax saves its output          b a s s c
      "attention_dropout_mask"  dropout on the probabilities  b a s s m  (p > 0)
      "attention_probs"     probs @ v saves the probabilities b a s s e
                            when they are a new tensor: the dropout output, or the 16-bit
                            cast of the fp32 softmax; otherwise they are the softmax output
     sdpa backend (CPU flash attention; its dropout is not modelled):
      "softmax_logsumexp"   the softmax statistics per row    b a s c
      (it also saves its output, which linear_proj saves again: counted in "proj_input")
      "proj_input"          linear_proj saves its input       b s h e
      "attention_residual_dropout_mask"                       b s h m    (p > 0)
      "pre_mlp_norm"        pre_mlp_layernorm                 see `_norm_bytes`
      "fc1_input"           linear_fc1 saves its input        b s h e
      "activation"          GELU saves its input (fc1 output) b s f e
                            SwiGLU: silu saves gate and the product saves silu(gate) and
                            up; gate and up are views of one fc1 output: 2 b s f e + b s f e
      "fc2_input"           linear_fc2 saves its input        b s f e
      "mlp_residual_dropout_mask"                             b s h m    (p > 0)

    Summed, for a GPT-2 style layer (LayerNorm, GELU, f = 4h) in fp32 or fp64 (c = e),
    naive attention, no dropout, b, s, a > 1:

        b s h e (2 + 1 + 3 + 1 + 1 + 4 + 4) + 4 b s e + b a s^2 e + s^2
                 norms, qkv input, q k v, proj input, fc1 input, GELU input, fc2 input
      = e s b h (16 + a s / h) + 4 b s e + s^2

    the fp32 counterpart of Korthikanti's s b h (34 + 5 a s / h) (see
    `korthikanti_activation_memory` for why the two differ).

    Once per model ("outside_layers"):

      "tokens"              the word embedding saves the ids  b s 8      (int64)
      "position_ids"        learned positions: the ids        s 8
      "embedding_dropout_mask"                                b s h m    (p > 0)
      "rope_tables"         RoPE's cos and sin [s, d], shared by every layer: 2 s d e
      "final_norm"          see `_norm_bytes`
      "output_input"        the logits matmul saves its input b s h e
      "log_softmax"         the loss saves the log-probabilities   b s V c
      "labels"              the loss saves the targets        b s 8   (model.gpt.CrossEntropy)

    The logits themselves (b s V e) are not saved: log-softmax keeps only its own output.
    Parameters are not activations and are excluded, even where an op saves one.
    tokens and labels are counted as separate tensors (as `measure_saved_activation_bytes`
    sees them when they do not share a storage).

    With activation recompute (chapter 07, recompute.py; the arguments are TrainConfig's):

      full                  a recomputed unit keeps only its input, b s h e (the RoPE tables it
                            also keeps are the ones counted once outside the layers): "uniform"
                            L / recompute_num_layers units (rounded up), "block" the first
                            recompute_num_layers layers one unit each, the others whole
      selective             each layer without what its recomputed parts keep inside them:
        "core_attn"         naive: the mask, the softmax output, the dropout mask and the
                            probabilities (Korthikanti's 5 a s^2 b), and q, k, v are kept as they
                            enter (g heads of k and v, views of the QKV output where sdpa's would
                            be: the copies to a heads are made inside); sdpa: only the log-sum-exp,
                            which is why Megatron warns that a fused attention needs no core_attn
                            recompute
        "mlp"               the activation's and fc2's inputs (the MLP keeps its input only)
        "layernorm"         each norm keeps its input in the model's dtype, b s h e

    Under tensor parallelism of size t (tp; chapter 02), on one rank: q, k, v, the attention and
    the MLP's inner activations hold a / t heads, g / t groups and f / t features, and linear_proj
    saves its [b, s, h / t] input; the norms, the inputs of linear_qkv and linear_fc1 and the
    residual dropouts stay whole. With sequence parallelism (chapter 04) those hold s / t tokens:
    a column-parallel linear saves only its own tokens and gathers them again in the backward.
    Outside the layers, the vocabulary-parallel embedding keeps its local ids and the mask of the
    ids it does not own (b s 8 + b s), the output layer its input (s / t tokens under SP), and the
    vocabulary-parallel loss its softmax over V / t ids in c, the local labels and the mask of
    the labels it does not own (b s (V / t) c + b s 8 + b s) instead of the log-probabilities
    and the labels. Korthikanti et al.'s s b h (10 + 24 / t + 5 a s / (h t)) and, with SP,
    s b h (34 + 5 a s / h) / t are the same division (korthikanti_activation_memory).

    Returns {"per_layer": {component: bytes, ..., "total"}, "layers": the L layers' bytes (L x the
    per-layer total without full recompute), "outside_layers": {component: bytes, ..., "total"},
    "total": layers + outside}.
    """
    config.validate()
    if config.num_experts is not None:           # the dense formulas would be silently wrong
        raise ValueError(f"activation_memory counts dense layers only; num_experts={config.num_experts}: the "
                         f"mixture-of-experts accounting comes with chapter 05")
    dtype = config.dtype if dtype is None else as_dtype(dtype)
    e = bytes_per_element(dtype)
    c = 4 if e == 2 else e
    m = e if dropout_mask_itemsize is None else dropout_mask_itemsize
    b, s, h, V, L = batch, seq, config.hidden_size, config.vocab_size, config.num_layers
    t = tp
    a, g, d, f = config.num_attention_heads // t, config.query_groups // t, config.kv_channels, config.ffn_size // t
    s_sp = s // t if sequence_parallel else s            # tokens of the norms, dropouts and column inputs
    p_attn = config.attention_dropout if training else 0.0
    p_hidden = config.hidden_dropout if training else 0.0
    naive = config.attention_backend == "naive"
    if not naive and p_attn > 0:
        raise ValueError("activation_memory does not model the sdpa backend with attention_dropout > 0")

    q_view, k_view, v_view = attention_operands_share_qkv_output(config, b, s, t)
    head_tensor = b * a * s * d * e                       # one of q, k, v: [b, a, s, d]
    kv_tensor = head_tensor if naive else b * g * s * d * e   # sdpa: k, v keep their g heads
    scores = b * a * s * s                                # elements of one [b, a, s, s] matrix
    per_layer = {
        "input_norm": _norm_bytes(config, b, s_sp, e, c),
        "qkv_input": b * s_sp * h * e,
        "qkv_output": b * s * (a + 2 * g) * d * e if (q_view or k_view or v_view) else 0,
        "query": 0 if q_view else head_tensor,
        "key": 0 if k_view else kv_tensor,
        "value": 0 if v_view else kv_tensor,
    }
    if naive:
        per_layer.update({
            "causal_mask": s * s,
            "softmax_output": scores * c,
            "attention_dropout_mask": scores * m if p_attn > 0 else 0,
            "attention_probs": scores * e if (p_attn > 0 or e == 2) else 0,
        })
    else:
        per_layer["softmax_logsumexp"] = b * a * s * c
    per_layer.update({
        "proj_input": b * s * a * d * e,
        "attention_residual_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
        "pre_mlp_norm": _norm_bytes(config, b, s_sp, e, c),
        "fc1_input": b * s_sp * h * e,
        "activation": 3 * b * s * f * e if config.activation == "swiglu" else b * s * f * e,
        "fc2_input": b * s * f * e,
        "mlp_residual_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
    })
    if recompute_granularity == "selective":
        if "core_attn" in recompute_modules:
            for name in ("causal_mask", "softmax_output", "attention_dropout_mask", "attention_probs",
                         "softmax_logsumexp"):
                per_layer.pop(name, None)
            # the unit keeps q, k, v as they enter it: g heads of k and v, views of the QKV output
            # where the fused kernel's operands would be (sdpa's rule: the repeat happens inside)
            q_in, k_in, v_in = attention_operands_share_qkv_output(dataclasses.replace(config, attention_backend="sdpa"),
                                                                  b, s, t)
            per_layer.update(qkv_output=b * s * (a + 2 * g) * d * e if (q_in or k_in or v_in) else 0,
                             query=0 if q_in else head_tensor, key=0 if k_in else b * g * s * d * e,
                             value=0 if v_in else b * g * s * d * e)
        if "mlp" in recompute_modules:
            per_layer["activation"] = per_layer["fc2_input"] = 0
        if "layernorm" in recompute_modules:
            per_layer["input_norm"] = per_layer["pre_mlp_norm"] = b * s_sp * h * e
    per_layer["total"] = sum(per_layer.values())

    outside = {
        "tokens": b * s * INDEX_BYTES,
        "position_ids": s * INDEX_BYTES if config.position_embedding_type == "learned_absolute" else 0,
        "embedding_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
        "rope_tables": 2 * s * d * e if config.position_embedding_type == "rope" else 0,
        "final_norm": _norm_bytes(config, b, s_sp, e, c),
        "output_input": b * s_sp * h * e,
        "log_softmax": b * s * V * c,
        "labels": b * s * INDEX_BYTES,
    }
    if t > 1:                     # the vocabulary-parallel embedding and loss (tp/layers.py, tp/cross_entropy.py)
        outside.update(tokens=b * s * INDEX_BYTES + b * s, log_softmax=b * s * (-(-V // t)) * c,
                       labels=b * s * INDEX_BYTES + b * s)
    outside["total"] = sum(outside.values())
    layers = L * per_layer["total"]
    if recompute_granularity == "full":                  # a unit keeps its input [b, s, h] only
        n = recompute_num_layers
        units = -(-L // n) if recompute_method == "uniform" else min(n, L)
        whole = 0 if recompute_method == "uniform" else L - units
        layers = units * b * s_sp * h * e + whole * per_layer["total"]
    return {"per_layer": per_layer, "layers": layers, "outside_layers": outside,
            "total": layers + outside["total"]}


def korthikanti_activation_memory(config: ModelConfig, batch: int, seq: int, tp: int = 1,
                                  sequence_parallel: bool = False) -> dict:
    """Korthikanti et al. 2022's activation bytes per layer and rank: s b h (34 + 5 a s / h);
    with tensor parallelism of size t (Section 4.2.1) s b h (10 + 24/t + 5 a s / (h t)): the
    10 s b h of the norms' inputs and the two dropouts after attention and the MLP stay
    replicated; with sequence parallelism too (Section 4.2.2) s b h (34/t + 5 a s / (h t)).

    "Reducing Activation Recomputation in Large Transformer Models", Section 4.1, for a
    GPT-2 style layer in 16-bit with dropout (1-byte masks) and no parallelism:

      attention  11 s b h + 5 a s^2 b:
                 QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, dropout mask as^2b,
                 dropout output 2as^2b, V 2sbh, projection input 2sbh, dropout mask sbh
      MLP        19 s b h:  fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, dropout mask sbh
      norms       4 s b h:  two LayerNorm inputs, 2sbh each
      total      s b h (34 + 5 a s / h)

    Returns {"per_layer": ..., "total": L x per_layer} (the paper's per-layer count; it leaves
    out the embedding, the final norm and the loss).

    Why `activation_memory` differs for the same shapes, even in bf16 with dropout:
      - our norms run in fp32 and save an fp32 copy of their input (4 bytes, not 2), plus
        mean/rstd and fp32 copies of their weights; RMSNorm also saves its normalised output;
      - our softmax runs in fp32 and saves its fp32 output (4 a s^2 b, not 2 a s^2 b), and
        without attention dropout the bf16 cast of it is a second, saved tensor;
      - the causal mask (s^2 bools per layer) is a saved tensor;
      - on CPU a dropout mask has the dtype of its input (2 bytes in bf16, 4 in fp32);
      - in fp32 every term doubles; without dropout the mask terms vanish;
      - SwiGLU saves 4 b s f e (fc1 output 2f, silu output f, fc2 input f) where GELU saves
        2 b s f e, and the SwiGLU width f ~ 8h/3 makes that about 21 s b h in bf16, not 16;
      - GQA does not shrink what attention saves: k and v are repeated to a heads first.
    """
    b, s, h, a, t = batch, seq, config.hidden_size, config.num_attention_heads, tp
    if sequence_parallel:
        per_layer = (34 * s * b * h + 5 * a * s * s * b) // t
    else:
        per_layer = 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t
    return {"per_layer": per_layer, "total": config.num_layers * per_layer}


def measure_saved_activation_bytes(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                                   position_ids: torch.Tensor | None = None) -> int:
    """Run model(tokens, position_ids=position_ids, labels=labels) and return the bytes autograd
    saved for backward (under tensor, sequence or context parallelism: this rank's, and the
    forward's collectives run, so every rank of the groups must call it).

    Every tensor an op saves passes through the `pack` hook of
    `torch.autograd.graph.saved_tensors_hooks`. We count storages, not tensors:
      - a saved view keeps its whole storage alive, so the storage's bytes are what it costs
        (tokens and labels sliced from one [b, s+1] tensor therefore count as that tensor:
        8 b bytes fewer than two separate [b, s] tensors; the formula assumes separate ones);
      - the same storage saved twice (by two ops, or as two views) is counted once;
      - storages of the model's parameters are skipped: weights are not activations, and
        they are in memory anyway (a parameter cast to another dtype is a new storage and
        does count: it exists only for backward).
    Nothing is run backward; the graph is freed before returning. The model's mode decides
    whether dropout runs (model.train()) or not (model.eval()).
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved.setdefault(storage.data_ptr(), storage)   # holding it keeps its address unique
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        extra = {} if position_ids is None else {"position_ids": position_ids}
        losses = model(tokens, labels=labels, **extra)
    del losses                                              # frees the graph
    return sum(storage.nbytes() for storage in saved.values())


__all__ = ["activation_memory", "korthikanti_activation_memory", "measure_saved_activation_bytes",
           "attention_operands_share_qkv_output", "INDEX_BYTES"]
