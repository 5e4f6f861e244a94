"""GDBR (Zhang, Chow and Li): a batch's label counts from one hidden layer's weight gradient via a gradient bridge."""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import AttackUnsupported, finite

__all__ = [
    "CLASS_DISTRIBUTIONS",
    "ESTIMATORS",
    "GDBRUnsupported",
    "BridgeLink",
    "GDBRResult",
    "victim_batch",
    "held_out_images",
    "init_like_paper",
    "client_gradient",
    "bridge_path",
    "gdbr_attack",
    "largest_remainder",
    "ins_acc",
    "cls_acc",
    "run_gdbr",
]

CLASS_DISTRIBUTIONS = ("random", "uniform", "single", "imbalanced")
# "diagonal" is Eq. 14/17 as printed; "rank_one" fits all of ∇W̄ Wᵀ (see _activation_gradient).
ESTIMATORS = ("rank_one", "diagonal")

# The paper samples 1,000 auxiliary inputs (Sec. V-A); dummies follow the same count.
DEFAULT_DUMMIES = 1000
# Table I leaves "imbalanced" unspecified; halving each next class's weight gives a clearly skewed batch.
_IMBALANCE_RATIO = 0.5
# The attacker's auxiliary data is the held-out share of load_digits, never seen in a victim batch.
_HELD_OUT_FRACTION = 0.3
_DIGITS_SPLIT_SEED = 0
_FORWARD_CHUNK = 256

_RELU_FUNCTIONS = {F.relu, torch.relu, F.leaky_relu, torch.relu_, F.relu_, F.leaky_relu_}
_RELU_METHODS = {"relu", "relu_"}
_PASS_MODULES = (
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Unflatten,
)
_PASS_FUNCTIONS = {torch.flatten, torch.reshape, F.dropout}
_PASS_METHODS = {"view", "reshape", "flatten", "contiguous"}
_SHAPE_QUERIES = {"size", "dim", "numel"}


class GDBRUnsupported(AttackUnsupported):
    """The gradient bridge cannot reach the logits from the shared layer; ``layer`` names what stops it."""


@dataclass(frozen=True)
class BridgeLink:
    """One op between the shared layer and the logits: a Linear to invert, a ReLU, or a reshape."""

    kind: str  # "linear" | "relu" | "reshape"
    name: str
    slope: float = 0.0  # LeakyReLU's negative slope; 0 for ReLU


@dataclass
class GDBRResult:
    """Medians over the trials, the median trial's counts, and every trial's record."""

    shared_layer: str
    batch_size: int
    ins_acc: float
    cls_acc: float
    trials: int
    seconds: float
    recovered: dict[int, int]
    true: dict[int, int]
    per_trial: list[dict] = field(default_factory=list)
    class_dist: str = "random"
    estimator: str = "rank_one"
    features_from: str = "dummy"  # "dummy" N(0,1) inputs or "aux" data
    device: str = "cpu"


# --------------------------------------------------------------------------- victim data


@functools.lru_cache(maxsize=1)
def _digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    cut = len(labels) - int(len(labels) * _HELD_OUT_FRACTION)
    return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]


def _to_model_shape(images_8x8: torch.Tensor, input_shape: tuple[int, ...]) -> torch.Tensor:
    channels, height, width = (int(s) for s in input_shape)
    resized = F.interpolate(images_8x8.unsqueeze(1), size=(height, width), mode="bilinear", align_corners=False)
    return resized.clamp(0.0, 1.0).expand(-1, channels, -1, -1).contiguous()


def _class_counts(class_dist: str, n_classes: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    if class_dist == "uniform":
        counts = torch.full((n_classes,), batch_size // n_classes, dtype=torch.long)
        counts[torch.randperm(n_classes, generator=gen)[: batch_size % n_classes]] += 1
        return counts
    if class_dist == "single":
        counts = torch.zeros(n_classes, dtype=torch.long)
        counts[int(torch.randint(n_classes, (1,), generator=gen))] = batch_size
        return counts
    if class_dist == "imbalanced":
        weights = torch.empty(n_classes, dtype=torch.float64)
        weights[torch.randperm(n_classes, generator=gen)] = _IMBALANCE_RATIO ** torch.arange(
            n_classes, dtype=torch.float64
        )
        draws = torch.multinomial(weights, batch_size, replacement=True, generator=gen)
        return torch.bincount(draws, minlength=n_classes)
    raise ValueError(f"class_dist must be one of {CLASS_DISTRIBUTIONS}, got {class_dist!r}")


def _draw(pool: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    if count <= len(pool):
        return pool[torch.randperm(len(pool), generator=gen)[:count]]
    return pool[torch.randint(len(pool), (count,), generator=gen)]


def victim_batch(
    n_classes: int, input_shape: tuple[int, int, int], batch_size: int, class_dist: str = "random", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A labelled batch of real digits (scikit-learn's 8x8 ``load_digits``) resized to ``input_shape``.

    Images are bilinearly resized to H x W, lie in [0, 1] and are copied into every channel.
    Labels use classes ``0 .. min(n_classes, 10) - 1``. ``class_dist`` follows Table I of the paper:
    ``random`` draws images uniformly (any class mix), ``uniform`` gives every class the same count
    (the remainder to random classes), ``single`` one random class only, ``imbalanced`` draws classes
    with geometric weights 1, 1/2, 1/4, ... over a random class order. Images come from the victim
    share of the data set; :func:`held_out_images` returns the disjoint rest.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if class_dist not in CLASS_DISTRIBUTIONS:
        raise ValueError(f"class_dist must be one of {CLASS_DISTRIBUTIONS}, got {class_dist!r}")
    images, labels, _, _ = _digits_split()
    n_used = min(int(n_classes), 10)
    if n_used < 1:
        raise ValueError(f"n_classes must be positive, got {n_classes}")
    gen = torch.Generator().manual_seed(int(seed))
    allowed = torch.nonzero(labels < n_used).squeeze(1)
    if class_dist == "random":
        chosen = _draw(allowed, batch_size, gen)
    else:
        counts = _class_counts(class_dist, n_used, batch_size, gen)
        parts = [_draw(torch.nonzero(labels == c).squeeze(1), int(k), gen) for c, k in enumerate(counts.tolist()) if k]
        chosen = torch.cat(parts)
        chosen = chosen[torch.randperm(len(chosen), generator=gen)]
    return _to_model_shape(images[chosen], input_shape), labels[chosen].clone()


def held_out_images(input_shape: tuple[int, int, int], n_classes: int = 10) -> torch.Tensor:
    """The attacker's auxiliary data: the held-out digits (about 54 per class), never in a victim batch."""
    _, _, images, labels = _digits_split()
    return _to_model_shape(images[labels < min(int(n_classes), 10)], input_shape)


# --------------------------------------------------------------------------- model set-up and client


def init_like_paper(model: nn.Module, bottom_layers: list[str], seed: int | None = None) -> nn.Module:
    """Weights of ``bottom_layers`` ~ U(0.01, 0.2) and their bias 0, as in Sec. V-A; returns ``model``.

    Positive weights on non-negative inputs keep every unit of these layers active, which is what
    Theorem 1's ReLU steps and the division by ã assume.
    """
    gen = None if seed is None else torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name in bottom_layers:
            layer = model.get_submodule(name)
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise ValueError(f"{name} has no weight to initialise")
            fresh = torch.empty(weight.shape, dtype=weight.dtype).uniform_(0.01, 0.2, generator=gen)
            weight.copy_(fresh)
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
    return model


def client_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a FedSGD client shares: the gradient of the batch-mean cross-entropy (eval mode, so dropout is off)."""
    was_training = model.training
    model.eval()
    try:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

        def output_and_loss():
            output = model(images)
            return output, F.cross_entropy(output, labels)

        with torch.enable_grad():
            output, loss = output_and_loss()
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        # Label counts read off a NaN gradient are not a result: refuse, naming the op that made it.
        finite.require_finite(
            "--verify gdbr",
            (output, loss),
            grads,
            model=model,
            rerun=output_and_loss,
            parameters=[p for _, p in named],
            inputs=images,
        )
    finally:
        model.train(was_training)
    return {name: (torch.zeros_like(p) if g is None else g).detach() for (name, p), g in zip(named, grads)}


# --------------------------------------------------------------------------- the bridge


def _is_shape_query(node: torch.fx.Node) -> bool:
    """``x.size(0)`` and friends read a shape, not values: not a branch of the gradient."""
    return (node.op == "call_method" and node.target in _SHAPE_QUERIES) or (
        node.op == "call_function"
        and getattr(node.target, "__name__", "") == "getattr"
        and len(node.args) > 1
        and node.args[1] == "shape"
    )


def _chain_input(node: torch.fx.Node) -> torch.fx.Node | None:
    args = list(node.args) + list(node.kwargs.values())
    return args[0] if args and isinstance(args[0], torch.fx.Node) else None


def _classify(node: torch.fx.Node, modules: dict[str, nn.Module]) -> BridgeLink:
    """What one op on the path does to the bridge; raise GDBRUnsupported for anything it cannot pass."""
    if node.op == "call_module":
        module = modules[node.target]
        name = str(node.target)
        if isinstance(module, nn.Linear):
            return BridgeLink("linear", name)
        if isinstance(module, nn.ReLU):
            return BridgeLink("relu", name)
        if isinstance(module, nn.LeakyReLU):
            return BridgeLink("relu", name, float(module.negative_slope))
        if isinstance(module, _PASS_MODULES):
            return BridgeLink("reshape", name)
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            raise GDBRUnsupported(
                name,
                f"{type(module).__name__} above the shared layer: the bridge (W Wᵀ)⁻¹W "
                "passes Linear layers only (GDBR Eq. 18-19)",
            )
        raise GDBRUnsupported(
            name,
            f"{type(module).__name__} lies on the bridge; it passes only Linear, ReLU, "
            "LeakyReLU and reshapes (Lemma 4: ∇z ⊙ z = ∇a ⊙ a needs a ReLU-like activation)",
        )
    if node.op == "call_function":
        if node.target in _RELU_FUNCTIONS:
            slope = 0.0
            if node.target in (F.leaky_relu, F.leaky_relu_):
                slope = float(node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01))
            return BridgeLink("relu", node.name, slope)
        if node.target in _PASS_FUNCTIONS:
            return BridgeLink("reshape", node.name)
        what = getattr(node.target, "__name__", str(node.target))
        raise GDBRUnsupported(
            node.name, f"{what} lies on the bridge; it passes only Linear, ReLU, LeakyReLU and reshapes"
        )
    if node.op == "call_method":
        if node.target in _RELU_METHODS:
            return BridgeLink("relu", node.name)
        if node.target in _PASS_METHODS:
            return BridgeLink("reshape", node.name)
        raise GDBRUnsupported(
            node.name, f".{node.target}() lies on the bridge; it passes only Linear, ReLU, LeakyReLU and reshapes"
        )
    raise GDBRUnsupported(node.name, f"{node.op} node on the bridge")


def bridge_path(model: nn.Module, shared_layer: str) -> list[BridgeLink]:
    """The ops from ``shared_layer``'s output to the logits; raises GDBRUnsupported for what the bridge cannot pass.

    Checks structure only (op kinds, single chain, widening Linears); a Linear that is numerically
    rank-deficient is caught when the attack builds its (W Wᵀ)⁻¹W.
    """
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types for data-dependent control flow
        raise GDBRUnsupported(
            type(model).__name__,
            f"torch.fx cannot trace the model ({type(exc).__name__}): the bridge needs a static chain to the logits",
        ) from exc
    modules = dict(graph_module.named_modules())
    calls = [n for n in graph_module.graph.nodes if n.op == "call_module" and n.target == shared_layer]
    if not calls:
        if shared_layer not in modules:
            raise ValueError(f"no module named {shared_layer!r} in {type(model).__name__}")
        raise GDBRUnsupported(shared_layer, "is not called in the traced forward pass")
    if len(calls) > 1:
        raise GDBRUnsupported(shared_layer, f"is applied {len(calls)} times: its gradient sums several uses")
    shared_module = modules[shared_layer]
    if not isinstance(shared_module, (nn.Linear, nn.Conv2d)):
        raise GDBRUnsupported(
            shared_layer,
            f"{type(shared_module).__name__}: GDBR reads ∇a from the weight gradient "
            "of a Linear or Conv2d layer only (Theorems 1-2)",
        )
    if isinstance(shared_module, nn.Conv2d) and shared_module.groups != 1:
        raise GDBRUnsupported(
            shared_layer, "grouped convolution: ⟨∇W_k, W_j⟩ pairs kernels that see different input channels"
        )
    links: list[BridgeLink] = []
    node = calls[0]
    while True:
        users = [user for user in node.users if not _is_shape_query(user)]
        if len(users) != 1:
            where = shared_layer if node is calls[0] else links[-1].name
            raise GDBRUnsupported(
                where,
                f"its output feeds {len(users)} ops (a branch or skip connection): "
                "the bridge follows a single chain to the logits",
            )
        nxt = users[0]
        if nxt.op == "output":
            break
        if _chain_input(nxt) is not node:
            raise GDBRUnsupported(nxt.name, "combines the chain with another tensor: the bridge follows a chain only")
        link = _classify(nxt, modules)
        if link.kind == "linear" and modules[link.name].out_features > modules[link.name].in_features:
            layer = modules[link.name]
            raise GDBRUnsupported(link.name, _widens(layer.in_features, layer.out_features))
        links.append(link)
        node = nxt
    if not any(link.kind == "linear" for link in links):
        raise GDBRUnsupported(
            shared_layer,
            "produces the logits: GDBR bridges from a hidden layer (the logits "
            "layer's own gradient is the one assumed withheld)",
        )
    return links


def _widens(width_in: int, width_out: int) -> str:
    return (
        f"widens {width_in} -> {width_out}: W Wᵀ ({width_out}x{width_out}) has rank at most {width_in}, so "
        "(W Wᵀ)⁻¹W does not exist and the bridge is blocked"
    )


class _LeftInverse:
    """(W Wᵀ)⁻¹W for one Linear, the left inverse of its backward map Wᵀ; raises when W is not full row rank."""

    def __init__(self, weight: torch.Tensor, name: str):
        rows, cols = weight.shape
        if rows > cols:
            raise GDBRUnsupported(name, _widens(cols, rows))
        self.weight = weight.to(torch.float64)
        gram = self.weight @ self.weight.T
        cholesky, info = torch.linalg.cholesky_ex(gram)
        # A (near-)dependent row leaves a pivot L_ii² at rounding level of the float32 weights the
        # client holds; Cholesky pivots are far cheaper than an eigen- or singular-value sweep,
        # which MKL makes very slow on these near-rank-one positive Gram matrices.
        pivots = cholesky.diagonal().square()
        tol = gram.diagonal().max() * (max(rows, cols) * torch.finfo(torch.float32).eps) ** 2
        deficient = int(info) != 0 or bool((pivots <= tol).any()) or not bool(torch.isfinite(pivots).all())
        if deficient:
            raise GDBRUnsupported(
                name,
                f"W ({rows}x{cols}) is not full row rank: W Wᵀ is singular, so "
                "(W Wᵀ)⁻¹W does not exist and the bridge is blocked",
            )
        self.cholesky = cholesky

    def __call__(self, grad_input: torch.Tensor) -> torch.Tensor:
        rhs = (self.weight @ grad_input).unsqueeze(-1)
        return torch.cholesky_solve(rhs, self.cholesky).squeeze(-1)


def _bridge(model: nn.Module, links: list[BridgeLink]) -> list[_LeftInverse]:
    """Every later Linear's (W Wᵀ)⁻¹W, in order from the shared layer up to the logits (Eq. 18-19).

    ReLUs are passed as identities: with the paper's positive bottom layers every unit is active,
    so ∇z = ∇a there (Theorem 1's proof). Reshapes do not touch a flattened gradient.
    """
    return [
        _LeftInverse(model.get_submodule(link.name).weight.detach(), link.name)
        for link in links
        if link.kind == "linear"
    ]


# --------------------------------------------------------------------------- estimation


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _input_shape(model: nn.Module, input_shape) -> tuple[int, int, int]:
    if input_shape is not None:
        return tuple(int(s) for s in input_shape)
    shape = getattr(model, "INPUT_SHAPE", None) or getattr(model, "input_shape", None)
    if shape is None:
        defining = sys.modules.get(type(model).__module__)
        shape = getattr(defining, "INPUT_SHAPE", None)
    if shape is None:
        raise ValueError(f"cannot tell {type(model).__name__}'s input shape: pass input_shape=(C, H, W)")
    return tuple(int(s) for s in shape)


def _estimate_features(
    model: nn.Module, shared_layer: str, first_act: BridgeLink | None, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ã (Assumption 1) and p̃ (Assumption 2): batch means over ``inputs`` of the feature and the softmax.

    The feature is φ'(z) ⊙ (z − b), which pairs with ∇W Wᵀ = ∇z (z − b)ᵀ (Lemma 1); with the
    paper's zero bias it is the activation a itself (Lemma 4). Conv features are per channel.
    """
    shared = model.get_submodule(shared_layer)
    captured: list[torch.Tensor] = []
    handle = shared.register_forward_hook(lambda _m, _i, output: captured.append(output.detach()))
    bias = shared.bias.detach() if shared.bias is not None else None
    feature_sum, prob_sum = None, None
    try:
        with torch.no_grad():
            for chunk in inputs.split(_FORWARD_CHUNK):
                captured.clear()
                logits = model(chunk)
                z = captured[0].to(torch.float64)
                bias_free = z if bias is None else z - bias.to(torch.float64).reshape((1, -1) + (1,) * (z.dim() - 2))
                if first_act is not None:
                    bias_free = bias_free * torch.where(z > 0, 1.0, first_act.slope)
                feature = bias_free.sum(0)
                probs = F.softmax(logits.to(torch.float64), dim=1).sum(0)
                feature_sum = feature if feature_sum is None else feature_sum + feature
                prob_sum = probs if prob_sum is None else prob_sum + probs
    finally:
        handle.remove()
    count = inputs.shape[0]
    feature = feature_sum / count
    # Sec. V-D4: zero features (dead units) would divide by zero; use the mean of the non-zero ones.
    nonzero = feature != 0
    if not bool(nonzero.any()):
        raise GDBRUnsupported(shared_layer, "every estimated feature is zero: no unit is active on these inputs")
    feature = torch.where(nonzero, feature, feature[nonzero].mean())
    return feature, prob_sum / count


def _activation_gradient(
    weight: torch.Tensor, grad: torch.Tensor, feature: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Batch-averaged ∇ā of the shared layer's output from ∇W̄ and ã (Eq. 14 for FC, Eq. 17 for 1x1 Conv).

    ``diagonal``: ∇ā_k = diag(∇W̄ Wᵀ)_k / ã_k, Eq. 14/17 as printed. ``rank_one``: the same
    Assumption 1 applied to the whole matrix, ∇W̄ Wᵀ = (1/B) Σ_n ∇a⁽ⁿ⁾ a⁽ⁿ⁾ᵀ ≈ ∇ā ãᵀ, solved in least
    squares: ∇ā = ∇W̄ Wᵀ ã / (ãᵀ ã). With every unit active, each column of ∇W̄ Wᵀ lies in the
    range of the backward map above the layer, so this estimate does too, and the bridge's left
    inverse does not amplify an out-of-range error. The diagonal weights every entry differently;
    through a deep bridge of near-rank-one positive layers that error swamps the label signal
    (6-layer MLP, fc2 shared: InsAcc 0.47 diagonal vs 0.98 rank_one).
    """
    w = weight.reshape(weight.shape[0], -1).to(torch.float64)
    g = grad.reshape(grad.shape[0], -1).to(torch.float64)
    a = feature.reshape(-1)
    if estimator == "diagonal":
        return (g * w).sum(1) / a
    if estimator == "rank_one":
        return g @ (w.T @ a) / (a @ a)
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def largest_remainder(estimate: torch.Tensor, total: int) -> torch.Tensor:
    """Non-negative integer counts summing to ``total`` closest in proportion to ``estimate`` (Hamilton's method).

    Negative entries are clipped to 0 (a class cannot have negative samples); the rest is scaled to
    sum to ``total``, every class gets the floor of its quota and the leftover units go to the
    largest fractional parts (ties to the lower class index). If nothing is positive, the largest
    entry takes everything.
    """
    estimate = estimate.detach().to(torch.float64).cpu()
    counts = torch.zeros(estimate.numel(), dtype=torch.long)
    positive = estimate.clamp(min=0)
    if float(positive.sum()) <= 0:
        counts[int(torch.argmax(estimate))] = total
        return counts
    quota = positive * (total / positive.sum())
    counts = quota.floor().to(torch.long)
    leftover = total - int(counts.sum())
    order = torch.argsort(-(quota - counts), stable=True)
    counts[order[:leftover]] += 1
    return counts


def gdbr_attack(
    model: nn.Module,
    shared_layer: str,
    shared_grads: dict[str, torch.Tensor],
    batch_size: int,
    aux: torch.Tensor | None = None,
    device: str | torch.device = "auto",
    seed: int = 0,
    *,
    input_shape: tuple[int, int, int] | None = None,
    estimator: str = "rank_one",
    n_dummy: int = DEFAULT_DUMMIES,
) -> torch.Tensor:
    """Recover the per-class label counts of a batch from ``shared_layer``'s weight gradient alone.

    1. ã and p̃ from ``aux`` or, without it, ``n_dummy`` N(0, 1) inputs (Sec. V-D3), through ``model``.
    2. ∇ā of the shared layer's output from ∇W̄ (only ``shared_grads[shared_layer + ".weight"]`` is read).
    3. Bridge to the logits: ∇z̄ = (W Wᵀ)⁻¹W ∇x̄ through each later Linear (Eq. 18-19).
    4. λ = B (p̃ − ∇z̄) (Eq. 21), rounded by :func:`largest_remainder`.

    Returns a LongTensor [n_classes] summing to ``batch_size``. A Conv2d shared layer needs a 1x1
    output (Theorem 2). Raises GDBRUnsupported naming the layer or op that blocks the bridge.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    dev = _resolve_device(device)
    links = bridge_path(model, shared_layer)
    key = f"{shared_layer}.weight"
    if key not in shared_grads:
        raise KeyError(f"shared_grads has no {key!r}")
    net = model if next(model.parameters()).device == dev else copy.deepcopy(model).to(dev)
    was_training = net.training
    net.eval()
    try:
        return _attack(
            net,
            shared_layer,
            links,
            shared_grads[key].to(dev),
            batch_size,
            aux,
            dev,
            seed,
            _input_shape(model, input_shape) if aux is None else None,
            estimator,
            n_dummy,
        )
    finally:
        net.train(was_training)


def _attack(
    net: nn.Module,
    shared_layer: str,
    links: list[BridgeLink],
    grad: torch.Tensor,
    batch_size: int,
    aux: torch.Tensor | None,
    dev: torch.device,
    seed: int,
    shape: tuple[int, int, int] | None,
    estimator: str,
    n_dummy: int,
) -> torch.Tensor:
    """Steps 1-4 of gdbr_attack on a model already on ``dev`` and in eval mode."""
    shared = net.get_submodule(shared_layer)
    bridge = _bridge(net, links)
    first_act = next((link for link in links if link.kind != "reshape"), None)
    first_act = first_act if first_act is not None and first_act.kind == "relu" else None
    gen = torch.Generator().manual_seed(int(seed))
    if aux is None:
        inputs = torch.randn((int(n_dummy),) + shape, generator=gen)
    else:
        inputs = aux
    dtype = next(net.parameters()).dtype
    feature, p_tilde = _estimate_features(net, shared_layer, first_act, inputs.to(device=dev, dtype=dtype))
    if isinstance(shared, nn.Conv2d) and feature[0].numel() != 1:
        raise GDBRUnsupported(
            shared_layer,
            f"output is {feature.shape[1]}x{feature.shape[2]} per channel: "
            "⟨∇W_k, W_k⟩ sums over positions, so ∇a of each position cannot be read off "
            "(Theorem 2 needs a 1x1 output)",
        )
    grad_a = _activation_gradient(shared.weight.detach(), grad, feature, estimator)
    grad_logits = grad_a
    for left_inverse in bridge:
        grad_logits = left_inverse(grad_logits)
    lam = batch_size * (p_tilde - grad_logits)
    return largest_remainder(lam, batch_size)


# --------------------------------------------------------------------------- metrics and driver


def ins_acc(recovered_counts, true_counts) -> float:
    """Instance-level accuracy: Σ_c min(recovered_c, true_c) / B, B the true batch size."""
    rec = torch.as_tensor(recovered_counts).to(torch.long).reshape(-1)
    true = torch.as_tensor(true_counts).to(torch.long).reshape(-1)
    total = int(true.sum())
    if total == 0:
        raise ValueError("true_counts is empty")
    size = max(rec.numel(), true.numel())
    rec, true = F.pad(rec, (0, size - rec.numel())), F.pad(true, (0, size - true.numel()))
    return float(torch.minimum(rec, true).sum()) / total


def cls_acc(recovered_counts, true_counts) -> float:
    """Class-level accuracy: |recovered classes ∩ true classes| / |recovered ∪ true| (Jaccard index).

    The GDBR paper names ClsAcc ("the accuracy of recovering the ground-truth classes", after its
    ref. [9]) but prints no formula; the Jaccard index penalises both missed and spurious classes.
    """
    rec = {i for i, c in enumerate(torch.as_tensor(recovered_counts).reshape(-1).tolist()) if c > 0}
    true = {i for i, c in enumerate(torch.as_tensor(true_counts).reshape(-1).tolist()) if c > 0}
    union = rec | true
    return 1.0 if not union else len(rec & true) / len(union)


def _as_dict(counts: torch.Tensor) -> dict[int, int]:
    return {i: int(c) for i, c in enumerate(counts.tolist()) if c > 0}


def run_gdbr(
    model: nn.Module,
    shared_layer: str,
    batch_size: int,
    trials: int = 5,
    class_dist: str = "random",
    aux: torch.Tensor | None = None,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    *,
    input_shape: tuple[int, int, int] | None = None,
    estimator: str = "rank_one",
    n_dummy: int = DEFAULT_DUMMIES,
    defense: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> GDBRResult:
    """Attack ``trials`` victim batches of real digits on ``model`` as it is (see :func:`init_like_paper`).

    Trial t uses seed ``seed * 1000 + t`` for its batch and its dummies. The client shares every
    gradient; the attack reads only ``shared_layer``'s weight gradient. ``ins_acc``/``cls_acc``
    are medians over trials; ``recovered``/``true`` come from the trial with the lower-median InsAcc.
    ``defense`` (grads -> grads) is applied by the client to its whole gradient before sharing; the attack
    reads ``shared_layer``'s weight entry of what was shared, unaware of the defense.
    """
    if trials < 1:
        raise ValueError(f"trials must be positive, got {trials}")
    started = time.perf_counter()
    dev = _resolve_device(device)
    shape = _input_shape(model, input_shape)
    net = copy.deepcopy(model).to(dev)
    net.eval()
    links = bridge_path(net, shared_layer)
    n_classes = net.get_submodule([link for link in links if link.kind == "linear"][-1].name).out_features
    key = f"{shared_layer}.weight"
    records = []
    for t in range(trials):
        trial_seed = int(seed) * 1000 + t
        trial_start = time.perf_counter()
        images, labels = victim_batch(n_classes, shape, batch_size, class_dist, seed=trial_seed)
        grads = client_gradient(net, images.to(dev), labels.to(dev))
        if defense is not None:
            grads = {name: g.to(dev) for name, g in defense(grads).items()}
        recovered = gdbr_attack(
            net,
            shared_layer,
            {key: grads[key]},
            batch_size,
            aux=aux,
            device=dev,
            seed=trial_seed,
            input_shape=shape,
            estimator=estimator,
            n_dummy=n_dummy,
        )
        true = torch.bincount(labels, minlength=n_classes)
        records.append(
            {
                "seed": trial_seed,
                "ins_acc": ins_acc(recovered, true),
                "cls_acc": cls_acc(recovered, true),
                "recovered": _as_dict(recovered),
                "true": _as_dict(true),
                "seconds": time.perf_counter() - trial_start,
            }
        )
        if progress is not None:
            progress(t + 1, trials)
    median_trial = sorted(records, key=lambda r: (r["ins_acc"], r["seed"]))[(trials - 1) // 2]
    return GDBRResult(
        shared_layer=shared_layer,
        batch_size=batch_size,
        ins_acc=statistics.median(r["ins_acc"] for r in records),
        cls_acc=statistics.median(r["cls_acc"] for r in records),
        trials=trials,
        seconds=time.perf_counter() - started,
        recovered=dict(median_trial["recovered"]),
        true=dict(median_trial["true"]),
        per_trial=records,
        class_dist=class_dist,
        estimator=estimator,
        features_from="dummy" if aux is None else "aux",
        device=str(dev),
    )
