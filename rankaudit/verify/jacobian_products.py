"""Products with one sample's clipped-gradient Jacobian J = ∂ clip_C(g(x)) / ∂x, without forming J.

g(x) is the gradient of one sample's loss with respect to the shared parameters (|θ| values), clip_C(g) =
g · min(1, C/‖g‖) as DP-SGD clips it, and J its Jacobian in the sample x (|θ| × d). Everything here is in units of
C (the clipped gradient divided by C, norm at most 1), so no clip norm under- or overflows; J in these units is the
Jacobian the noise σ·C is measured against (docs/method.md, "The Fisher floor under DP noise").

- ``jvp(x, v)`` = J v (|θ|): forward-over-reverse (torch.func.jvp of the gradient), one pass per direction,
  ``vmap`` carries a chunk of directions at once;
- ``vjp(x, u)`` = Jᵀ u (d): reverse-over-reverse;
- ``jacobian(x)``: the dense J (|θ| × d), for small models and the checks.

For callers other than the CLI::

    products = ClippedGradientProducts(model, label, clip=1.0, loss="cross-entropy")
    products.jvp(x, directions)   # directions: k x d -> k x |θ|
"""

from __future__ import annotations

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.verify.client import mean_loss


class ClippedGradientProducts:
    """J and Jᵀ products of one model's clipped per-sample gradient, in units of the clip norm.

    ``model``: real weights (its own dtype and device are used; float64 is what the verifier passes); put it in
    the mode it is to be differentiated in (eval: DP-SGD's per-sample gradients cannot share batch statistics).
    ``shared``: the parameter names whose gradient is sent (default every trainable one); ``label``: the class
    index (cross-entropy) or ±1 (logistic) of the sample's loss; ``masks``: parameter name -> 0/1 tensor of its
    shape, the entries sent (default all)."""

    def __init__(
        self,
        model: nn.Module,
        label: int,
        *,
        clip: float,
        loss: str,
        shared: list[str] | None = None,
        masks: dict[str, torch.Tensor] | None = None,
    ):
        from torch.func import functional_call

        if not clip > 0:
            raise UsageError(f"a clip norm of {clip!r} clips nothing", "give --dp-clip a number above 0")
        named = dict(model.named_parameters())
        names = shared if shared is not None else [name for name, p in named.items() if p.requires_grad]
        if not names:
            raise UsageError(
                "the model has no trainable parameters, so it sends no gradient to clip and noise",
                "make some parameters trainable (requires_grad)",
            )
        self.params = {name: named[name].detach() for name in names}
        frozen = {name: p.detach() for name, p in named.items() if name not in self.params}
        self.buffers = {**frozen, **{name: b.detach() for name, b in model.named_buffers()}}
        self.clip = float(clip)
        self.loss = loss
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.label = torch.tensor([label], dtype=torch.long, device=self.device)
        self.size = sum(p.numel() for p in self.params.values())
        # Entries of a shared parameter that are not sent (a design that lacks them): their gradient is dropped.
        self.masks = {name: mask.to(self.device, self.dtype) for name, mask in (masks or {}).items()}

        def sample_loss(values, x):
            output = functional_call(model, (values, self.buffers), (x.unsqueeze(0),))
            return mean_loss(output, self.label, loss)

        self._sample_loss = sample_loss

    def gradient(self, x: torch.Tensor) -> torch.Tensor:
        """clip_C(g(x)) / C, flattened (|θ|): g · min(1/C, 1/‖g‖); a zero gradient stays zero."""
        flat = self._unclipped(x)
        norm = flat.norm()
        # min(1/C, 1/‖g‖) with a zero norm mapped to 1/C (the product is zero there anyway, and its derivative
        # finite): torch.where keeps both branches differentiable.
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        scale = torch.minimum(1.0 / safe, torch.full_like(safe, 1.0 / self.clip))
        return flat * scale

    def scaled_jvp(self, x: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """s·J_g v for each row v, with J_g the unclipped gradient's Jacobian and s the clipping's factor held fixed
        at x: the size J's terms have before the clipping's own derivative cancels them (where J is zero by
        cancellation, J v is rounding error against this)."""
        from torch.func import jvp, vmap

        x = x.to(self.device, self.dtype)
        with torch.no_grad():
            norm = float(self._unclipped(x).norm())
        scale = min(1.0 / self.clip, 1.0 / norm) if norm > 0 else 1.0 / self.clip
        tangents = directions.to(self.device, self.dtype).reshape(len(directions), *x.shape)
        return scale * vmap(lambda v: jvp(self._unclipped, (x,), (v,))[1])(tangents)

    def _unclipped(self, x: torch.Tensor) -> torch.Tensor:
        """g(x), flattened, the entries not sent dropped."""
        from torch.func import grad

        grads = grad(self._sample_loss)(self.params, x)
        return torch.cat([(g * self.masks[n] if n in self.masks else g).reshape(-1) for n, g in grads.items()])

    def clipped(self, x: torch.Tensor) -> bool:
        """Whether clipping is active at x (‖g‖ > C): J is then the Jacobian of the rescaled gradient."""
        return bool(self.gradient(x).norm() >= 1.0 - 1e-12)

    def jvp(self, x: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """J v for each row v of ``directions`` (k x d, or k x the sample's shape): k x |θ|."""
        from torch.func import jvp, vmap

        x = x.to(self.device, self.dtype)
        tangents = directions.to(self.device, self.dtype).reshape(len(directions), *x.shape)

        def one(v):
            return jvp(self.gradient, (x,), (v,))[1]

        return vmap(one)(tangents)

    def vjp(self, x: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
        """Jᵀ u for each row u of ``cotangents`` (k x |θ|): k x d."""
        from torch.func import vjp, vmap

        x = x.to(self.device, self.dtype)
        _, pull = vjp(self.gradient, x)
        rows = vmap(lambda u: pull(u)[0])(cotangents.to(self.device, self.dtype))
        return rows.reshape(len(cotangents), -1)

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """The dense J (|θ| x d) by reverse mode: for small models and checks only."""
        from torch.func import jacrev

        x = x.to(self.device, self.dtype)
        return jacrev(self.gradient)(x).reshape(self.size, -1)
