"""GDBR's gradient bridge: the chain of ops from the shared layer to the logits, and each Linear's left inverse."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import AttackUnsupported

__all__ = [
    "GDBRUnsupported",
    "BridgeLink",
    "bridge_path",
    "bridge_inverses",
]

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


def bridge_inverses(model: nn.Module, links: list[BridgeLink]) -> list[_LeftInverse]:
    """Every later Linear's (W Wᵀ)⁻¹W, in order from the shared layer up to the logits (Eq. 18-19).

    ReLUs are passed as identities: with the paper's positive bottom layers every unit is active,
    so ∇z = ∇a there (Theorem 1's proof). Reshapes do not touch a flattened gradient.
    """
    return [
        _LeftInverse(model.get_submodule(link.name).weight.detach(), link.name)
        for link in links
        if link.kind == "linear"
    ]
