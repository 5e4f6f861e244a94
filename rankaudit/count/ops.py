"""Registry: op family -> its counting rule, its shape rule and what the bound needs, for every spelling it has."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The rules live by kind in op_counting and op_shapes; the registry below is the one place that names each family's.
from rankaudit.count.op_counting import (
    Counting,
    Role,
    count_add,
    count_aten_conv_transpose,
    count_attention,
    count_cat,
    count_conv,
    count_conv_transpose,
    count_convolution,
    count_linear,
    count_matmul,
    count_non_injective,
    count_reduction,
    count_resampler,
    count_scale,
    count_script_module,
    count_slice,
    count_transparent,
    count_unmodelled,
)
from rankaudit.count.op_shapes import (
    addmm_shape,
    attention_shape,
    broadcast_shape,
    cat_shape,
    conv_shape,
    conv_transpose_shape,
    linear_shape,
    lp_pool_shape,
    matmul_shape,
    reduction_shape,
    resampler_shape,
    same_shape,
    unmodelled_shape,
)
from rankaudit.trace.records import OpFacts


@dataclass(frozen=True)
class OpFamily:
    key: str
    handler: Callable[[OpFacts], Counting]
    # (target, args, kwargs) -> output shape, or None to let the tracer run the op on meta; target is the
    # module, function or method name called. Meta kernels of many ops are Python and import half of torch
    # on first use (about a second); a formula costs microseconds.
    shape: Callable[[Any, tuple, dict], tuple | None] | None = None
    # method.md: the bound: does the op's local Jacobian depend (smoothly) on its forward input? Then the backward pass
    # through it reads the forward tensor, and the bound's flow network gets an edge t -> δ(in). Linear maps
    # with fixed weights and piecewise-linear maps (ReLU, max-pool) do not; unknown ops are assumed to (sound).
    input_dependent_jacobian: bool = False


FAMILIES: dict[str, OpFamily] = {}  # key -> family: what a NodeRecord's `family` names
MODULES: dict[type, OpFamily] = {}
FUNCTIONS: dict[Any, OpFamily] = {}
METHODS: dict[str, OpFamily] = {}
ATEN: dict[str, OpFamily] = {}


def register(
    key: str,
    handler: Callable[[OpFacts], Counting],
    *,
    shape=None,
    input_dependent_jacobian=False,
    modules=(),
    functions=(),
    methods=(),
    aten=(),
):
    """Declare one op family with every spelling it has in fx (modules, functions, methods) and export (aten)."""
    family = OpFamily(key, handler, shape, input_dependent_jacobian)
    FAMILIES[key] = family
    for module_type in modules:
        MODULES[module_type] = family
    for function in functions:
        FUNCTIONS[function] = family
    for method in methods:
        METHODS[method] = family
    for packet in aten:
        ATEN[packet] = family
    return family


# ---- the families -------------------------------------------------------------------------------------

register(
    "linear",
    count_linear,
    shape=linear_shape,
    modules=(nn.Linear, nn.LazyLinear),
    functions=(F.linear,),
    aten=("linear",),
)
register(
    "conv",
    count_conv,
    shape=conv_shape,
    modules=(nn.Conv1d, nn.Conv2d, nn.Conv3d),
    functions=(F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d),
    aten=("conv1d", "conv2d", "conv3d"),
)
register(
    "conv_transpose",
    count_conv_transpose,
    shape=conv_transpose_shape,
    modules=(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    functions=(F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
)
register(
    "aten_conv_transpose", count_aten_conv_transpose, aten=("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
)
register(
    "convolution",
    count_convolution,
    aten=("convolution", "_convolution"),
)
register(
    "resampler",
    count_resampler,
    shape=resampler_shape,
    modules=(
        nn.AvgPool1d,
        nn.AvgPool2d,
        nn.AvgPool3d,
        nn.MaxPool1d,
        nn.MaxPool2d,
        nn.MaxPool3d,
        nn.AdaptiveAvgPool1d,
        nn.AdaptiveAvgPool2d,
        nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d,
        nn.AdaptiveMaxPool3d,
        nn.Upsample,
        nn.UpsamplingNearest2d,
        nn.UpsamplingBilinear2d,
        nn.PixelShuffle,
        nn.PixelUnshuffle,
    ),
    functions=(
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.max_pool1d,
        F.max_pool2d,
        F.max_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
        F.adaptive_max_pool3d,
        F.interpolate,
        F.upsample,
        F.pixel_shuffle,
        F.pixel_unshuffle,
        torch.avg_pool1d,
        torch.max_pool1d,
        torch.max_pool2d,
        torch.max_pool3d,
        torch.pixel_shuffle,
        torch.pixel_unshuffle,
    ),
    aten=(
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "_adaptive_avg_pool2d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "upsample_bilinear2d",
        "upsample_linear1d",
        "upsample_bicubic2d",
        "upsample_trilinear3d",
        "pixel_shuffle",
        "pixel_unshuffle",
    ),
)
# (Σ x^p)^(1/p) over each window: a pooling whose Jacobian depends on the window's values (unlike max or mean).
register(
    "lp_pool",
    count_resampler,
    shape=lp_pool_shape,
    input_dependent_jacobian=True,
    modules=(nn.LPPool1d, nn.LPPool2d, *((nn.LPPool3d,) if hasattr(nn, "LPPool3d") else ())),
    functions=(F.lp_pool1d, F.lp_pool2d, *((F.lp_pool3d,) if hasattr(F, "lp_pool3d") else ())),
)
register(
    "slice",
    count_slice,
    functions=(operator.getitem,),
    methods=("narrow",),
    aten=("slice", "select", "narrow", "index", "getitem"),
)
register(
    "reshape",
    count_transparent,
    modules=(
        nn.Flatten,
        nn.Unflatten,
        nn.Identity,
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.AlphaDropout,
        nn.FeatureAlphaDropout,
        nn.ZeroPad1d,
        nn.ZeroPad2d,
        nn.ZeroPad3d,
        nn.ConstantPad1d,
        nn.ConstantPad2d,
        nn.ConstantPad3d,
    ),
    functions=(
        torch.flatten,
        torch.reshape,
        torch.permute,
        torch.transpose,
        torch.squeeze,
        torch.unsqueeze,
        torch.t,
        torch.movedim,
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.pad,
        torch.clone,
    ),
    methods=(
        "view",
        "reshape",
        "flatten",
        "permute",
        "transpose",
        "contiguous",
        "squeeze",
        "unsqueeze",
        "t",
        "movedim",
        "view_as",
        "reshape_as",
        "clone",
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "type_as",
        "unflatten",
    ),
    aten=(
        "view",
        "_unsafe_view",
        "reshape",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "squeeze",
        "unsqueeze",
        "contiguous",
        "clone",
        "dropout",
        "alias",
        "_to_copy",
        "to",
        "constant_pad_nd",
        "pad",
        "movedim",
        "lift_fresh_copy",
        "detach",
    ),
)
register(
    "monotonic",
    count_transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.LeakyReLU, nn.PReLU, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Softplus),
    functions=(F.leaky_relu, F.elu, F.softplus, torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, F.prelu, torch.prelu),
    methods=("sigmoid", "tanh", "sigmoid_", "tanh_"),
    aten=(
        "leaky_relu",
        "leaky_relu_",
        "elu",
        "elu_",
        "softplus",
        "sigmoid",
        "sigmoid_",
        "tanh",
        "tanh_",
        "prelu",
        "_prelu_kernel",
    ),
)
# Hardsigmoid = relu6(x + 3) / 6: a clamp, piecewise linear (MobileNetV3's and LCNet's squeeze-excitation gate).
register(
    "relu_family",
    count_non_injective,
    shape=same_shape,
    modules=(nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid),
    functions=(F.relu, torch.relu, F.relu6, F.hardtanh, F.relu_, torch.relu_, torch.clamp, torch.clip, F.hardsigmoid),
    methods=("relu", "relu_", "clamp", "clamp_", "clip"),
    aten=(
        "relu",
        "relu_",
        "relu6",
        "hardtanh",
        "hardtanh_",
        "clamp",
        "clamp_",
        "clamp_min",
        "clip",
        "hardsigmoid",
        "hardsigmoid_",
    ),
)
register(
    "norm",
    count_transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.GroupNorm,
    ),
    functions=(F.batch_norm, F.instance_norm, F.group_norm),
    aten=(
        "batch_norm",
        "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit",
        "native_batch_norm",
        "_batch_norm_with_update",
        "_batch_norm_no_update",
        "instance_norm",
        "group_norm",
        "native_group_norm",
    ),
)
register(
    "add",
    count_add,
    shape=broadcast_shape,
    functions=(operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub),
    methods=("add", "add_", "sub", "sub_"),
    aten=("add", "add_", "sub", "sub_"),
)
register(
    "scale",
    count_scale,
    shape=broadcast_shape,
    functions=(
        operator.mul,
        operator.imul,
        operator.truediv,
        operator.itruediv,
        operator.neg,
        torch.mul,
        torch.div,
        torch.neg,
    ),
    methods=("mul", "mul_", "div", "div_", "neg"),
    aten=("mul", "mul_", "div", "div_", "neg"),
)
register(
    "cat", count_cat, shape=cat_shape, functions=(torch.cat, torch.concat, torch.concatenate), aten=("cat", "concat")
)
register("stack", count_cat, functions=(torch.stack,), aten=("stack",))
register(
    "attention",
    count_attention,
    shape=attention_shape,
    input_dependent_jacobian=True,
    functions=(F.scaled_dot_product_attention,),
    aten=(
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
    ),
)

register(
    "embedding",
    count_unmodelled,
    input_dependent_jacobian=False,
    modules=(nn.Embedding, nn.EmbeddingBag),
    functions=(F.embedding, F.embedding_bag),
    aten=("embedding", "embedding_bag", "_embedding_bag"),
)
register(
    "layer_norm",
    count_unmodelled,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.LayerNorm, nn.LocalResponseNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())),
    functions=(
        F.layer_norm,
        torch.layer_norm,
        F.local_response_norm,
        *((F.rms_norm,) if hasattr(F, "rms_norm") else ()),
    ),
    aten=("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"),
)
register(
    "smooth_activation",
    count_unmodelled,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Hardswish,
        nn.Softmax,
        nn.LogSoftmax,
        nn.Softmin,
        nn.Softmax2d,
        nn.Tanhshrink,
        nn.Softshrink,
        nn.Hardshrink,
    ),
    functions=(
        F.gelu,
        F.silu,
        F.mish,
        F.hardswish,
        F.softmax,
        F.log_softmax,
        F.softmin,
        torch.softmax,
        torch.log_softmax,
        F.tanhshrink,
    ),
    methods=("softmax", "log_softmax"),
    aten=(
        "gelu",
        "gelu_",
        "silu",
        "silu_",
        "mish",
        "mish_",
        "hardswish",
        "hardswish_",
        "_softmax",
        "softmax",
        "_log_softmax",
        "log_softmax",
        "_safe_softmax",
    ),
)
register(
    "monotonic_smooth",
    count_transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.SELU, nn.CELU, nn.Softsign, nn.LogSigmoid),
    functions=(F.selu, F.celu, F.softsign, F.logsigmoid),
    aten=("selu", "selu_", "celu", "celu_", "log_sigmoid_forward"),
)
register(
    "matmul",
    count_matmul,
    shape=matmul_shape,
    input_dependent_jacobian=True,
    functions=(torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.einsum, torch.baddbmm),
    methods=("matmul", "bmm", "mm", "__matmul__"),
    aten=("matmul", "bmm", "mm", "einsum", "baddbmm"),
)
register("addmm", count_matmul, shape=addmm_shape, functions=(torch.addmm,), methods=("addmm",), aten=("addmm",))
# x @ W with a parameter W: the matmul family's calls that turn out to be Linear layers (constant Jacobian).
register("matmul_param", count_matmul)
# A scaling that turned out to divide by a traced tensor (1 / x, c / x): its Jacobian depends on that tensor.
register("divide_by_data", count_scale, input_dependent_jacobian=True)
# Copies of entries (broadcast, repeat_kv in grouped-query attention): no new unknowns, a constant Jacobian.
register(
    "replicate",
    count_transparent,
    functions=(torch.broadcast_to, torch.tile, torch.repeat_interleave),
    methods=("expand", "expand_as", "repeat", "repeat_interleave", "tile", "broadcast_to"),
    aten=("expand", "expand_as", "repeat", "repeat_interleave", "tile", "broadcast_to"),
)
# Several views of one tensor; each piece picked from the tuple is a row-free view too.
register(
    "split",
    count_transparent,
    functions=(torch.split, torch.chunk, torch.unbind, torch.tensor_split),
    methods=("split", "chunk", "unbind", "tensor_split"),
    aten=("split", "split_with_sizes", "chunk", "unbind", "tensor_split"),
)
register(
    "reduction",
    count_reduction,
    shape=reduction_shape,
    functions=(torch.mean, torch.sum),
    methods=("mean", "sum"),
    aten=("mean", "sum"),
)

# TorchScript modules (torch.jit.script, torch.jit.trace; their classes derive from ScriptModule): one leaf call of
# unknown structure, run on meta as compiled; the Jacobian is assumed to depend on the input (sound).
register("script_module", count_script_module, input_dependent_jacobian=True, modules=(torch.jit.ScriptModule,))

UNMODELLED = OpFamily("not_modelled", count_unmodelled, shape=unmodelled_shape, input_dependent_jacobian=True)
FAMILIES[UNMODELLED.key] = UNMODELLED


def family_of(kind: str, target: Any) -> OpFamily:
    """The family for a call: kind is "module" (target: the module), "function", "method" or "aten"."""
    if kind == "module":
        family = MODULES.get(type(target))
        if family is None:
            # A subclass of a registered module (timm's LayerNorm2d), else another library's norm or activation.
            family = next((MODULES[base] for base in type(target).__mro__[1:] if base in MODULES), None)
        if family is None:
            family = {"norm": FAMILIES["layer_norm"], "activation": FAMILIES["smooth_activation"]}.get(
                atomic_kind(target), UNMODELLED
            )
        return family
    if kind == "function":
        return FUNCTIONS.get(target, UNMODELLED)
    if kind == "method":
        return METHODS.get(target, UNMODELLED)
    if kind == "aten":
        return ATEN.get(target, UNMODELLED)
    return UNMODELLED


_ACTIVATION_SUFFIXES = ("activation", "gelu", "silu", "swish", "mish", "quickgelu")


def atomic_kind(module: nn.Module) -> str | None:
    """'norm' or 'activation' for another library's normalisation or activation module (LlamaRMSNorm,
    T5LayerNorm, NewGELUActivation), told by its class name: a module without submodules whose name ends in
    Norm, or a parameter-free one whose name ends in Activation, GELU, SiLU, Swish or Mish. The tracer treats
    it as one op: its pow/mean/rsqrt inside are the norm, not layers of their own."""
    if type(module).__module__.startswith("torch.nn.") or next(module.children(), None) is not None:
        return None
    name = type(module).__name__.lower()
    if name.endswith("norm"):
        return "norm"
    if name.endswith(_ACTIVATION_SUFFIXES) and next(module.parameters(), None) is None:
        return "activation"
    return None


def refine_family(family: OpFamily, counting: Counting) -> OpFamily:
    """A product that turned out to read a weight matrix (x @ W) is a Linear: its Jacobian does not depend on x."""
    reads_weights = counting.role is Role.LAYER and (counting.weights or counting.frozen_params)
    if family.key in ("matmul", "addmm") and reads_weights:
        return FAMILIES["matmul_param"]
    if family.key == "addmm":
        return FAMILIES["matmul"]
    if counting.input_dependent_jacobian and not family.input_dependent_jacobian:
        return FAMILIES["divide_by_data"] if family.key == "scale" else UNMODELLED
    return family
