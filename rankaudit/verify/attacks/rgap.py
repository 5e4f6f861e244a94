"""R-GAP: recover one training input from its gradients in closed form, layer by layer (Zhu & Blaschko, ICLR 2021)."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import finite

# The attack's steps live beside this module: reading the model into a chain (rgap_chain), each layer's algebra
# (rgap_solve).
from rankaudit.verify.attacks.rgap_chain import (
    RGapUnsupported,
    Step,
    _act_inverse,
    _act_range_ok,
    _kernel4,
    _layer_backward,
    chain_forward,
    extract_chain,
)
from rankaudit.verify.attacks.rgap_solve import (
    LayerSolve,
    _Candidate,
    _layer_rank,
    _solve_layer,
    _top_candidates,
)

__all__ = [
    "Reconstruction",
    "RGapResult",
    "client_gradients",
    "reconstruct",
    "numerical_rank",
    "run_rgap",
]

LOSSES = ("logistic", "cross-entropy")


@dataclass
class Reconstruction:
    """Result of one R-GAP run on one gradient."""

    x: torch.Tensor
    layers: list[LayerSolve]
    notes: list[str]
    label: int | None
    alternatives: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RGapResult:
    """R-GAP over a set of images: per-sample quality and timing, and the first sample's layer table."""

    reconstructions: torch.Tensor
    mse: list[float]
    psnr: list[float]
    seconds: list[float]
    median_mse: float
    median_psnr: float
    median_seconds: float
    layers: list[LayerSolve]
    notes: list[str]
    device: str
    labels: list[int]
    recovered_labels: list[int | None]


# --------------------------------------------------------------------------- client side


def client_gradients(model: nn.Module, x: torch.Tensor, y: int, loss: str = "logistic") -> dict[str, torch.Tensor]:
    """The gradient one client shares for one unbatched sample x (parameter name -> gradient).

    logistic: single logit mu, y in {-1, +1}, l = log(1 + exp(-y mu)); cross-entropy: y a class index.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    p0 = next(iter(model.parameters()))
    x = x.to(device=p0.device, dtype=p0.dtype)

    def output_and_loss():
        out = model(x[None])
        if loss == "logistic":
            if out.numel() != 1:
                raise ValueError(f"logistic loss needs a single logit, the model returns {tuple(out.shape)}")
            if y not in (-1, 1):
                raise ValueError("logistic loss needs y in {-1, +1}")
            return out, F.softplus(-y * out.reshape(()))
        return out, F.cross_entropy(out.reshape(1, -1), torch.tensor([int(y)], device=out.device))

    out, ell = output_and_loss()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(ell, [p for _, p in named], allow_unused=True)
    # No reconstruction (and no MSE) from a NaN gradient: name the op that made it.
    finite.require_finite(
        "--verify rgap (R-GAP)",
        (out, ell),
        grads,
        model=model,
        rerun=output_and_loss,
        parameters=[p for _, p in named],
        inputs=x,
    )
    return {n: (torch.zeros_like(p) if g is None else g.detach()) for (n, p), g in zip(named, grads)}


# --------------------------------------------------------------------------- the recursion


@dataclass(eq=False)
class _State:
    pos: int  # index in the chain of the layer whose input we hold
    x: torch.Tensor  # that layer's input
    g: torch.Tensor  # dL/d(that input)
    solves: list[LayerSolve]
    cand: _Candidate


def _walk_down(chain, st: _State):
    """Through the activations/reshapes below chain[st.pos]: (index of the next layer or -1, its output z,
    dL/dz) from the layer input we hold and its gradient."""
    x, g = st.x, st.g
    i = st.pos - 1
    while i >= 0 and not chain[i].is_layer:
        s = chain[i]
        x, g = x.reshape(s.in_shape), g.reshape(s.in_shape)
        if s.kind == "act":
            x, d = _act_inverse(s, x)
            g = g * d
        i -= 1
    return i, x, g


def _step_down(chain, weights, grads, st: _State) -> _State:
    """From the input of layer chain[st.pos], walk down to the next layer and solve it."""
    i, z, g = _walk_down(chain, st)
    if i < 0:
        return _State(-1, z, g, st.solves, st.cand)
    s = chain[i]
    w4, b = _kernel4(s, weights)
    k = g.reshape(s.out_shape)
    if s.kind == "linear" and s.bias is not None:
        # Phong et al.: dL/db = k exactly, so the recursion's accumulated error does not enter here.
        k = grads[s.bias].to(w4.dtype).reshape(s.out_shape)
    x_in, solve = _solve_layer(s, w4, b, grads[s.weight], z.reshape(s.out_shape), k)
    g_in = _layer_backward(s, w4, k)
    return _State(i, x_in, g_in, st.solves + [solve], st.cand)


def _identity_misfit(chain, weights, grads, st: _State) -> float:
    """How badly a candidate's (z, k) at the next layer down break <dW_o, W_o'> = sum_p k[o,p] (z-b)[o',p].

    The identity (GDBR Lemma 3 generalised) holds for every pair of output channels whatever the
    unknown input is, so it tests a top-layer candidate without solving the layer: a wrong label sign
    or a non-scaling twin breaks it, an exact twin of a homogeneous net does not.
    """
    i, z, g = _walk_down(chain, st)
    if i < 0:
        return 0.0
    s = chain[i]
    w4, b = _kernel4(s, weights)
    o = w4.shape[0]
    k = g.reshape(o, -1)
    if s.kind == "linear" and s.bias is not None:
        k = grads[s.bias].reshape(o, -1)
    zb = z.reshape(o, -1) - (b.reshape(o, 1) if b is not None else 0)
    rhs = k @ zb.T
    lhs = grads[s.weight].reshape(o, -1) @ w4.reshape(o, -1).T
    return float((lhs - rhs).norm() / rhs.norm().clamp_min(1e-300))


def _descend(chain, weights, grads, st: _State) -> _State:
    while st.pos > 0:
        st = _step_down(chain, weights, grads, st)
    return st


def _final_input(chain, st: _State, input_shape) -> torch.Tensor:
    x = st.x
    if st.pos > 0:
        for s in reversed(chain[: st.pos]):
            x = x.reshape(s.in_shape)
            if s.kind == "act":
                x, _ = _act_inverse(s, x)
    return x.reshape(input_shape)


def _worst_residual(st: _State) -> float:
    vals = [s.residual for s in st.solves if not math.isnan(s.residual)]
    return max(vals) if vals else 0.0


def _box_distance(x: torch.Tensor) -> float:
    return float(((x - x.clamp(0, 1)) ** 2).mean())


def _homogeneous(chain: list[Step]) -> bool:
    return all((s.kind != "act" or s.act in ("leaky_relu", "identity")) and not (s.is_layer and s.bias) for s in chain)


def reconstruct(
    chain: list[Step],
    weights: dict,
    gradients: dict,
    loss: str = "logistic",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
) -> Reconstruction:
    """Algorithm 1: recover the input from one sample's gradients, top layer first; layers come back bottom-up."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    device = torch.device(device)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in weights.items()}
    grads = {k: v.detach().to(device=device, dtype=dtype) for k, v in gradients.items()}
    top = max(i for i, s in enumerate(chain) if s.is_layer)
    ts = chain[top]
    w4, b = _kernel4(ts, weights)
    cands, notes = _top_candidates(ts, w4, b, grads, loss)
    input_shape = chain[0].in_shape

    states = []
    for cand in cands:
        x_top, solve = _solve_layer(ts, w4, b, grads[ts.weight], cand.z, cand.k)
        states.append(_State(top, x_top, _layer_backward(ts, w4, cand.k), [solve], cand))

    # Activations just below the top bound its input (Sigmoid: (0,1)); that alone often fixes y.
    def range_ok(st):
        x, i = st.x, top - 1
        while i >= 0 and not chain[i].is_layer:
            x = x.reshape(chain[i].in_shape)
            if chain[i].kind == "act":
                if not _act_range_ok(chain[i], x.reshape(chain[i].out_shape)):
                    return False
                x, _ = _act_inverse(chain[i], x)
            i -= 1
        return True

    why_rejected: dict[int, str] = {}
    kept = [st for st in states if range_ok(st)]
    if len(kept) < len(states) and kept:
        for st in states:
            if all(st is not k_ for k_ in kept):
                why_rejected[id(st.cand)] = "its top-layer input leaves the activation's range"
        states = kept
    if len(states) > 1 and top > 0:
        misfit = {id(st): _identity_misfit(chain, weights, grads, st) for st in states}
        least = min(misfit.values())
        survivors = [st for st in states if misfit[id(st)] <= 10 * least + 1e-9]
        for st in states:
            if all(st is not k_ for k_ in survivors):
                why_rejected[id(st.cand)] = (
                    f"it breaks the <dW, W> channel identities of the layer below "
                    f"(relative misfit {misfit[id(st)]:.2g} vs {least:.2g})"
                )
        states = survivors

    finals: list[tuple[_State, torch.Tensor]] = []
    homog = _homogeneous(chain) and loss == "logistic"
    done_twins: dict[int, tuple[_State, torch.Tensor]] = {}
    for st in states:
        twin = done_twins.get(st.cand.label) if homog else None
        if twin is not None:
            # Positively homogeneous net without bias: the twin is exactly the other input scaled by
            # the ratio of margins (Appendix B), so we need not solve again.
            base_st, base_x = twin
            scale = st.cand.margin / base_st.cand.margin
            fin = _State(0, base_x * scale, base_st.g, [replace(l_) for l_ in base_st.solves], st.cand)
            finals.append((fin, base_x * scale))
            continue
        fin = _descend(chain, weights, grads, st)
        x = _final_input(chain, fin, input_shape)
        finals.append((fin, x))
        if homog and st.cand.margin:
            done_twins[st.cand.label] = (fin, x)

    best = min(_worst_residual(f) for f, _ in finals)
    plausible = [(f, x) for f, x in finals if _worst_residual(f) <= 10 * best + 1e-9]
    for f, _ in finals:
        if all(f is not p for p, _ in plausible):
            why_rejected[id(f.cand)] = (
                f"its reconstruction misfits the layer constraints (relative residual "
                f"{_worst_residual(f):.2g} vs {best:.2g})"
            )
    # Exact twins give identical gradients, so only a prior can choose: pixel values lie in [0, 1];
    # among candidates inside the box take the larger one, since the twin of a natural image is
    # usually a faint scaled copy.
    plausible.sort(key=lambda fx: (round(_box_distance(fx[1]), 12), -float(fx[1].abs().max())))
    chosen, x = plausible[0]
    others = [xx for f, xx in plausible[1:]]
    margins = sorted({c.margin for c in cands if c.margin is not None})
    if loss == "logistic" and len(margins) > 1:
        alive = {f.cand.margin for f, _ in plausible}
        head = (
            f"twin data (Appendix B): margins {margins[0]:.4g} and {margins[1]:.4g} both fit "
            f"<dL/dW, W> = {-margins[0] / (1 + math.exp(margins[0])):.4g}; "
        )
        if len(alive) > 1:
            notes.append(
                head + "both reconstructions explain the gradients exactly (the twin is the input "
                f"rescaled); chose margin {chosen.cand.margin:.4g} by the [0,1] pixel-range prior, "
                "the other is in Reconstruction.alternatives"
            )
        else:
            reasons = sorted(
                {why_rejected[id(c)] for c in cands if c.margin != chosen.cand.margin and id(c) in why_rejected}
            )
            notes.append(head + f"the twin was rejected: {'; '.join(reasons) or 'it fits worse'}")
    if float(grads[ts.weight].abs().max()) == 0.0:
        notes.append(
            "the output layer's gradient is exactly zero (saturated loss): it carries no information "
            "about this sample, the reconstruction is meaningless"
        )
    # Report layers bottom-up, the order the user reads a model in.
    return Reconstruction(
        x=x, layers=list(reversed(chosen.solves)), notes=notes, label=chosen.cand.label, alternatives=others
    )


# --------------------------------------------------------------------------- numerical rank on its own


def numerical_rank(
    chain: list[Step],
    weights: dict,
    gradients: dict | None = None,
    *,
    loss: str = "logistic",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    only: set[str] | None = None,
) -> list[LayerSolve]:
    """|x_i| - rank(A_i) per layer (method.md: numerical check numerical mode), bottom layer first.

    Without gradients, the k_i come from a seeded uniform [0,1] input pushed through the given weights
    (pass random weights for the generic rank); with gradients, R-GAP runs and its solves are returned.
    `only` restricts the (costly) rank computation to the named layers.
    """
    if gradients is not None:
        return reconstruct(chain, weights, gradients, loss, device, dtype).layers
    device = torch.device(device)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in weights.items()}
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(chain[0].in_shape, generator=gen, dtype=dtype).to(device)
    outs = chain_forward(chain, weights, x)
    top = max(i for i, s in enumerate(chain) if s.is_layer)
    logits = outs[top].reshape(-1)
    if loss == "logistic":
        y = 1 if torch.rand((), generator=gen) < 0.5 else -1
        g = (-y * torch.sigmoid(-y * logits)).reshape(chain[top].out_shape)
    else:
        label = int(torch.randint(logits.numel(), (), generator=gen))
        g = torch.softmax(logits, 0) - F.one_hot(torch.tensor(label), logits.numel()).to(dtype).to(device)
    g = g.reshape(chain[top].out_shape)
    result = []
    for i in range(top, -1, -1):
        s = chain[i]
        if s.is_layer:
            w4, _ = _kernel4(s, weights)
            if only is None or s.name in only:
                result.append(_layer_rank(s, w4, g))
            g = _layer_backward(s, w4, g)
        elif s.kind == "act":
            _, d = _act_inverse(s, outs[i])
            g = g.reshape(s.out_shape) * d
        g = g.reshape(s.in_shape)
    return list(reversed(result))


# --------------------------------------------------------------------------- the attack on a set of images


def _reconstruct_defended(chain, weights, grads, loss, dev, dtype, shape) -> Reconstruction:
    """reconstruct() on a defended gradient, which need not be a gradient at all: where the algebra breaks
    (no valid top-layer candidate, a singular or non-finite system), the attacker has nothing, scored as zeros."""
    try:
        rec = reconstruct(chain, weights, grads, loss, dev, dtype)
    except (RGapUnsupported, RuntimeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        reason = exc.reason if isinstance(exc, RGapUnsupported) else f"{type(exc).__name__}: {exc}"
        return Reconstruction(
            x=torch.zeros(shape, dtype=dtype, device=dev),
            layers=[],
            notes=[f"R-GAP failed on the defended gradient ({reason}); scored as an all-zero image"],
            label=None,
        )
    if not bool(torch.isfinite(rec.x).all()):
        rec.notes.append("the reconstruction from the defended gradient is not finite; non-finite pixels scored as 0")
        rec.x = torch.nan_to_num(rec.x, nan=0.0, posinf=0.0, neginf=0.0)
    return rec


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def run_rgap(
    model: nn.Module,
    images: torch.Tensor,
    device: str = "auto",
    seed: int = 0,
    loss: str = "logistic",
    progress: Callable[[int, int], None] | None = None,
    *,
    defense: Callable[[dict], dict] | None = None,
) -> RGapResult:
    """Attack each image's single-sample gradient with R-GAP and score the reconstruction.

    MSE is on the raw reconstruction (what the algebra recovered); PSNR is on the reconstruction
    clipped to [0, 1], the image a person would look at, with a 1e-30 MSE floor (300 dB) to stay finite.
    Everything runs in float64: the client's gradient is computed in float64 too, so the MSE measures
    the attack, not float32 rounding of the gradient. Labels are drawn from `seed` (logistic: y = +-1;
    cross-entropy: a class). Seconds time reconstruct() alone. progress(done, total) runs after each sample.

    ``defense`` (grads -> grads, e.g. ``rankaudit.verify.defenses.Defense.client()``) is what the client applies
    before sharing: the attack sees only its output. The attack is not told about the defense. Where the defended
    gradient is no gradient R-GAP can invert at all, the sample's reconstruction is all zeros and a note says why.
    """
    dev = _resolve_device(device)
    dtype = torch.float64
    net = copy.deepcopy(model).to(device=dev, dtype=dtype)
    net.train()
    if images.dim() < 2:
        raise ValueError("images must be a batch N x C x H x W")
    input_shape = tuple(images.shape[1:])
    chain = extract_chain(net, input_shape)
    weights = {n: p.detach() for n, p in net.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    n = images.shape[0]
    recs, mses, psnrs, secs, labels, rlabels = [], [], [], [], [], []
    layers: list[LayerSolve] = []
    notes: list[str] = []
    n_classes = None
    for i in range(n):
        x = images[i].to(device=dev, dtype=dtype)
        if loss == "logistic":
            y = 1 if torch.rand((), generator=gen) < 0.5 else -1
        else:
            if n_classes is None:
                with torch.no_grad():
                    n_classes = net(x[None]).numel()
            y = int(torch.randint(n_classes, (), generator=gen))
        grads = client_gradients(net, x, y, loss)
        if defense is not None:
            grads = {name: g.to(device=dev, dtype=dtype) for name, g in defense(grads).items()}
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if defense is None:
            rec = reconstruct(chain, weights, grads, loss, dev, dtype)
        else:
            rec = _reconstruct_defended(chain, weights, grads, loss, dev, dtype, x.shape)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
        xr = rec.x.reshape(x.shape)
        mse = float(((xr - x) ** 2).mean())
        mse_clip = float(((xr.clamp(0, 1) - x) ** 2).mean())
        mses.append(mse)
        psnrs.append(10 * math.log10(1.0 / max(mse_clip, 1e-30)))
        recs.append(xr.detach().cpu())
        labels.append(y)
        rlabels.append(rec.label)
        if i == 0:
            layers = rec.layers
        notes.extend(f"sample {i}: {note}" for note in rec.notes)
        if progress is not None:
            progress(i + 1, n)
    return RGapResult(
        reconstructions=torch.stack(recs) if recs else torch.empty(0),
        mse=mses,
        psnr=psnrs,
        seconds=secs,
        median_mse=statistics.median(mses) if mses else math.nan,
        median_psnr=statistics.median(psnrs) if psnrs else math.nan,
        median_seconds=statistics.median(secs) if secs else math.nan,
        layers=layers,
        notes=notes,
        device=str(dev),
        labels=labels,
        recovered_labels=rlabels,
    )
