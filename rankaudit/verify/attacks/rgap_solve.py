"""R-GAP's per-layer algebra: the output layer's candidates and each layer's linear system A_i x_i = b_i."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rankaudit.verify.attacks.rgap_chain import RGapUnsupported, Step, _as_image

# Beyond these sizes the dense per-layer matrices (the weight block, and V of G's SVD, HW x HW) stop
# fitting comfortably in memory; R-GAP is meant for the small networks of the paper, so we refuse
# (the caller falls back to an optimisation attack) instead of thrashing.
_MAX_DENSE_ENTRIES = 80_000_000
_MAX_SPATIAL = 4_096


@dataclass
class LayerSolve:
    """What solving A_i x_i = b_i told us about one layer."""

    name: str
    unknowns: int  # |x_i| counting zero-padding entries, as the counting rules do
    rank: int
    local_deficit: int  # unknowns - rank
    residual: float  # max of the relative residuals of weight and gradient constraints (nan: not solved)
    condition: float  # larger of the two solve stages' condition numbers (see _solve_layer); nan: unknown


# --------------------------------------------------------------------------- one layer's linear system


def _rank_tol(m: int, n: int, dtype) -> float:
    # NumPy/LAPACK convention: singular values below max(m, n) * eps * sigma_max cannot be told
    # apart from rounding of entries of that magnitude. A_i's structural dependencies (stride
    # overlaps, the C_out^2 GDBR identities) are exact, so their singular values sit at this
    # rounding level while genuine ones are many orders above it (see tests: CNN6-d conv2).
    return max(m, n) * torch.finfo(dtype).eps


class _LayerSystem:
    """A_i = [W_i; K_i; P] of one layer, held in the structured form the solver exploits.

    With x padded to (C, Hp, Wp), the gradient constraints are dW[o,c,q] = sum_p k[o,p] xpad[c, idx[q,p]]
    (idx = unfold's index map). Their coefficient matrix G, rows (o,q), columns = padded pixels, is the
    same for every input channel c, so K_i = I_C (x) G. The padding rows P pin the padded pixels to 0,
    which is the same as deleting those columns (rank(A) = #padded + rank of the interior system).
    """

    def __init__(self, step: Step, w4: torch.Tensor, k_out: torch.Tensor):
        self.step, self.w4 = step, w4
        o, c, kh, kw = w4.shape
        _, h, w = _as_image(step, torch.empty(step.in_shape, device="meta")).shape
        top, bottom, left, right = step.padding
        hp, wp = h + top + bottom, w + left + right
        self.o, self.c, self.h, self.w, self.hp, self.wp, self.kk = o, c, h, w, hp, wp, kh * kw
        if h * w > _MAX_SPATIAL:
            raise RGapUnsupported(
                step.name,
                f"input of {h}x{w} pixels per channel is too large for the dense R-GAP solve (limit {_MAX_SPATIAL})",
            )
        dev, dt = w4.device, w4.dtype
        grid = torch.arange(hp * wp, device=dev, dtype=torch.float64).reshape(1, 1, hp, wp)
        idx = F.unfold(grid, (kh, kw), dilation=step.dilation, stride=step.stride)[0].round().long()  # (K, L)
        self.n_out = idx.shape[1]
        interior = torch.full((hp * wp,), -1, dtype=torch.long, device=dev)
        rows = torch.arange(top, top + h, device=dev)[:, None] * wp + torch.arange(left, left + w, device=dev)[None, :]
        interior[rows.reshape(-1)] = torch.arange(h * w, device=dev)
        col = interior[idx]  # (K, L), -1 where the kernel reads padding
        kmat = k_out.reshape(o, self.n_out).to(dt)
        g = torch.zeros(o * self.kk, h * w, dtype=dt, device=dev)
        row_ids = (
            torch.arange(o, device=dev)[:, None, None] * self.kk + torch.arange(self.kk, device=dev)[None, :, None]
        ).expand(o, self.kk, self.n_out)
        cols = col[None].expand(o, -1, -1)
        vals = kmat[:, None, :].expand(o, self.kk, self.n_out)
        keep = cols >= 0
        g.index_put_((row_ids[keep], cols[keep]), vals[keep], accumulate=True)
        self.G = g
        self.unknowns = c * hp * wp
        self.n_pad = c * (hp * wp - h * w)

    def grad_rhs(self, grad_w: torch.Tensor) -> torch.Tensor:
        return grad_w.reshape(self.o, self.c, self.kk).permute(0, 2, 1).reshape(self.o * self.kk, self.c)

    def apply_w(self, x_int: torch.Tensor) -> torch.Tensor:
        """W_i applied to a batch of interior inputs (B, C, H, W) -> (B, O*L), bias excluded."""
        top, bottom, left, right = self.step.padding
        xp = F.pad(x_int, (left, right, top, bottom))
        return F.conv2d(xp, self.w4, None, stride=self.step.stride, dilation=self.step.dilation).reshape(
            x_int.shape[0], -1
        )

    def null_block(self, n_basis: torch.Tensor) -> torch.Tensor:
        """W_i (I_C (x) N): each null-space basis image of G placed in each channel and convolved.

        Convolving basis images gives W_i N exactly without materialising the (sparse) W_i.
        """
        nn_ = n_basis.shape[1]
        imgs = n_basis.T.reshape(nn_, 1, self.h, self.w)
        top, bottom, left, right = self.step.padding
        imgs = F.pad(imgs, (left, right, top, bottom))
        blocks = []
        for ch in range(self.c):
            out = F.conv2d(imgs, self.w4[:, ch : ch + 1], None, stride=self.step.stride, dilation=self.step.dilation)
            blocks.append(out.reshape(nn_, -1).T)
        return torch.cat(blocks, dim=1)


def _svd_g(system: _LayerSystem):
    g = system.G
    # The full V is needed for null(G); when G is tall the reduced SVD already holds all of V.
    u, s, vh = torch.linalg.svd(g, full_matrices=g.shape[0] < g.shape[1])
    tol = _rank_tol(*g.shape, g.dtype)
    r = int((s > tol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return u, s, vh, r


def _singular_values(a: torch.Tensor) -> torch.Tensor:
    # LAPACK's direct SVD of these structured, not-quite-tall blocks ran 5-10x slower here than a
    # Householder QR followed by the SVD of the square R, which has the same singular values.
    tall = a if a.shape[0] >= a.shape[1] else a.T
    return torch.linalg.svdvals(torch.linalg.qr(tall, mode="r")[1])


def _rank_of(sv: torch.Tensor, shape) -> tuple[int, float]:
    if not sv.numel() or sv[0] <= 0:
        return 0, math.inf
    rank = int((sv > _rank_tol(*shape, sv.dtype) * sv[0]).sum())
    return rank, float(sv[0] / sv[rank - 1])


# Cholesky of the Gram matrix certifies full column rank when its smallest eigenvalue sits far above
# the Gram's own rounding level (~ n eps lambda_max, 1e-12 lambda_max for n ~ 2500). We ask for
# lambda_min / lambda_max > 1e-8, i.e. sigma_min / sigma_max > 1e-4: eight orders above the SVD
# tolerance, so the rank is the one the SVD would report. Anything less certain goes to the SVD.
# Why not always the SVD: on a shared 2-core box an SVD of a 2500-column block took 20-50 s under
# load (bidiagonalisation is memory-bound), while Gram + Cholesky are BLAS-3 and took ~1.5 s.
_GRAM_CERTIFY = 1e-8


def _gram_solve(a: torch.Tensor, rhs: torch.Tensor):
    """Least squares through Cholesky of a^T a when a has certainly full column rank, else None."""
    n = a.shape[1]
    if a.shape[0] < n:
        return None
    m = a.T @ a
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) != 0:
        return None
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(n, min(4, n), generator=gen, dtype=a.dtype).to(a.device)
    w = v.clone()
    # Block power and inverse iteration; their Rayleigh-Ritz values bracket the spectrum from inside.
    # A dozen steps give the extreme Ritz values to a few digits, enough for the certificate's
    # four-orders margin and for the reported condition.
    for _ in range(12):
        v = torch.linalg.qr(m @ v)[0]
        w = torch.linalg.qr(torch.cholesky_solve(w, chol))[0]
    lam_max = float(torch.linalg.eigvalsh(v.T @ m @ v)[-1])
    lam_min = float(torch.linalg.eigvalsh(w.T @ m @ w)[0])
    if lam_min <= 0 or lam_min < _GRAM_CERTIFY * lam_max:
        return None
    x = torch.cholesky_solve((a.T @ rhs)[:, None], chol)
    for _ in range(2):  # refinement: semi-normal equations then reach ~cond*eps instead of cond^2*eps
        x = x + torch.cholesky_solve(a.T @ (rhs[:, None] - a @ x), chol)
    return x[:, 0], n, math.sqrt(lam_max / lam_min)


def _least_squares(a: torch.Tensor, rhs: torch.Tensor, use_svd: bool | None = None) -> tuple[torch.Tensor, int, float]:
    """Minimum-norm least-squares a x = rhs (Algorithm 1's pseudo-inverse), its rank, its condition."""
    tol = _rank_tol(*a.shape, a.dtype)
    if use_svd if use_svd is not None else a.device.type == "cuda":
        # cuSOLVER's lstsq assumes full rank; the truncated SVD is exactly the pseudo-inverse.
        u, sv, vh = torch.linalg.svd(a, full_matrices=False)
        rank, cond = _rank_of(sv, a.shape)
        return vh[:rank].T @ ((u[:, :rank].T @ rhs) / sv[:rank]), rank, cond
    certified = _gram_solve(a, rhs)
    if certified is not None:
        return certified
    # Not gelsy: torch's gelsy returned wrong solutions for rank-deficient blocks here (residual 0.13
    # on a consistent system; pytorch issues #71222/#92537, its pivot array is not reset). gelsd is
    # SVD-based: it gives the min-norm solution, the rank at our tolerance and the singular values.
    res = torch.linalg.lstsq(a, rhs[:, None], rcond=tol, driver="gelsd")
    rank = int(res.rank)
    sv = res.singular_values
    cond = float(sv[0] / sv[rank - 1]) if rank else math.inf
    return res.solution[:, 0], rank, cond


def _solve_layer(step: Step, w4, b, grad_w, z_out, k_out):
    """Solve A_i x_i = b_i for one layer, in two exact stages.

    Stage 1: G (same for every channel) is inverted on its row space: the gradient constraints fix
    x_c's component there, x_c = V_r S_r^-1 U_r^T g_c. Stage 2: the rest of x lies in null(G) per
    channel, x_c = x_c^r + N y_c, and the weight constraints W x = z - b decide y by least squares.
    Under the orthogonal change of variables x_c -> V^T x_c, A_i becomes block-triangular, so
    rank(A_i) = #padded + C*rank(G) + rank(W (I (x) N)) exactly; no equilibration between gradient
    and weight rows is needed.
    """
    sysm = _LayerSystem(step, w4, k_out)
    dt = w4.dtype
    c, h, w = sysm.c, sysm.h, sysm.w
    g_rhs = sysm.grad_rhs(grad_w.to(dt))
    u, s, vh, r = _svd_g(sysm)
    coef = (u[:, :r].T @ g_rhs) / s[:r, None]
    x_cols = vh[:r].T @ coef  # (HW, C)
    cond_g = float(s[0] / s[r - 1]) if r else math.nan
    nnull = h * w - r
    z_flat = z_out.reshape(-1).to(dt)
    zb = z_flat - (b.to(dt).repeat_interleave(sysm.n_out) if b is not None else 0)
    rank_y, cond_y = 0, math.nan
    if nnull:
        if sysm.o * sysm.n_out * c * nnull > _MAX_DENSE_ENTRIES:
            raise RGapUnsupported(
                step.name,
                f"the weight-constraint block ({sysm.o * sysm.n_out} x {c * nnull}) "
                "is too large for the dense R-GAP solve",
            )
        n_basis = vh[r:].T  # (HW, nnull)
        y_mat = sysm.null_block(n_basis)
        rhs = zb - sysm.apply_w(x_cols.T.reshape(1, c, h, w))[0]
        sol, rank_y, cond_y = _least_squares(y_mat, rhs)
        x_cols = x_cols + n_basis @ sol.reshape(c, nnull).T
    x_img = x_cols.T.reshape(c, h, w)
    rank = sysm.n_pad + c * r + rank_y

    w_fit = sysm.apply_w(x_img[None])[0]
    w_res = float((w_fit - zb).norm() / zb.norm().clamp_min(1e-300))
    g_res = float((sysm.G @ x_cols - g_rhs).norm() / g_rhs.norm().clamp_min(1e-300))
    conds = [v for v in (cond_g, cond_y) if not math.isnan(v)]
    condition = math.nan if (nnull and math.isnan(cond_y)) or not conds else max(conds)
    solve = LayerSolve(step.name, sysm.unknowns, rank, sysm.unknowns - rank, max(w_res, g_res), condition)
    return x_img.reshape(step.in_shape), solve


def _layer_rank(step: Step, w4, k_out) -> LayerSolve:
    sysm = _LayerSystem(step, w4, k_out)
    _, s, vh, r = _svd_g(sysm)
    nnull = sysm.h * sysm.w - r
    rank_y, cond_y = 0, math.nan
    if nnull:
        if sysm.o * sysm.n_out * sysm.c * nnull > _MAX_DENSE_ENTRIES:
            raise RGapUnsupported(step.name, "layer too large for the dense rank computation")
        y_mat = sysm.null_block(vh[r:].T)
        certified = _gram_solve(y_mat, torch.zeros(y_mat.shape[0], dtype=y_mat.dtype, device=y_mat.device))
        if certified is not None:
            _, rank_y, cond_y = certified
        else:
            rank_y, cond_y = _rank_of(_singular_values(y_mat), y_mat.shape)
    cond_g = float(s[0] / s[r - 1]) if r else math.nan
    rank = sysm.n_pad + sysm.c * r + rank_y
    conds = [v for v in (cond_g, cond_y) if not math.isnan(v)]
    return LayerSolve(step.name, sysm.unknowns, rank, sysm.unknowns - rank, math.nan, max(conds) if conds else math.nan)


# --------------------------------------------------------------------------- the top layer


def _logistic_value(m: float) -> float:
    """<dL/dW, W> = (dl/dmu) mu as a function of the margin m = y*mu, for l = log(1 + e^-m)."""
    if m >= 0:
        e = math.exp(-m)
        return -m * e / (1 + e)
    return -m / (1 + math.exp(m))


_M_STAR = 1.2784645427610738  # argmin of the function above: 1 + e^m (1 - m) = 0


def _bisect(f, lo, hi, target):
    flo = f(lo) - target
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        fm = f(mid) - target
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
        if hi - lo <= 1e-16 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def _margin_roots(v: float) -> tuple[list[float], str | None]:
    """All margins m with (dl/dmu) mu = v for the logistic loss (Fig. 1 of the paper)."""
    if v > 0:
        return [_bisect(_logistic_value, -v - 60.0, 0.0, v)], None
    if v == 0:
        return [0.0], None
    vmin = _logistic_value(_M_STAR)
    if v <= vmin:
        return [_M_STAR], (
            f"<dL/dW, W> = {v:.4g} is below the logistic loss's minimum {vmin:.4g}: "
            "gradients are inconsistent (noise?); using the extremum"
        )
    return [_bisect(_logistic_value, 0.0, _M_STAR, v), _bisect(_logistic_value, _M_STAR, 800.0, v)], None


@dataclass
class _Candidate:
    k: torch.Tensor  # dL/dz at the top layer's output
    z: torch.Tensor  # the top layer's output (logits)
    label: int
    margin: float | None
    what: str


def _top_candidates(step: Step, w4, b, grads: dict, loss: str) -> tuple[list[_Candidate], list[str]]:
    """Every (label, dL/dz, z) at the output layer that its gradient allows; later steps pick one."""
    gw = grads[step.weight].reshape(w4.shape[0], -1).to(w4.dtype)
    w = w4.reshape(w4.shape[0], -1)
    dev, dt = w4.device, w4.dtype
    notes: list[str] = []
    n_out = w.shape[0]
    if loss == "logistic":
        if n_out != 1:
            raise RGapUnsupported(
                step.name,
                f"logistic loss needs a single logit; {step.name} has {n_out} outputs (use loss='cross-entropy')",
            )
        if b is not None:
            # dL/db = dl/dmu = -y / (1 + e^m): its sign gives y, its size gives m uniquely (no twin).
            d = float(grads[step.bias].reshape(()))
            if d == 0 or abs(d) >= 1:
                raise RGapUnsupported(step.name, "the output bias gradient is 0 or not a logistic derivative")
            y = -1 if d > 0 else 1
            m = math.log(1 / abs(d) - 1)
            mu = y * m
            k = torch.tensor([d], dtype=dt, device=dev)
            z = torch.tensor([mu], dtype=dt, device=dev)
            return [_Candidate(k, z, y, m, "from the output bias gradient")], notes
        v = float((gw * w).sum())
        roots, warn = _margin_roots(v)
        if warn:
            notes.append(warn)
        cands = []
        for m in roots:
            for y in (1, -1):
                d = -y / (1 + math.exp(m)) if m < 700 else -y * math.exp(-m)
                cands.append(
                    _Candidate(
                        torch.tensor([d], dtype=dt, device=dev),
                        torch.tensor([y * m], dtype=dt, device=dev),
                        y,
                        m,
                        f"y={y:+d}, margin={m:.6g}",
                    )
                )
        return cands, notes
    # cross-entropy: dL/dz = softmax(z) - e_y has exactly one negative entry, at the label (iDLG).
    if b is not None:
        k = grads[step.bias].reshape(-1).to(dt)
        label = int(torch.argmin(k))
        p = (k + F.one_hot(torch.tensor(label, device=dev), n_out).to(dt)).clamp_min(1e-300)
        # logits are fixed by softmax only up to a constant; W x + b pins it, so fit it there.
        x = (k @ gw) / (k @ k)
        zc = torch.log(p)
        shift = ((w @ x + b.to(dt)) - zc).mean()
        return [_Candidate(k, zc + shift, label, None, f"label {label} from the output bias gradient")], notes
    # No bias: dL/dW = k x^T is rank one, k = a*u and x = (s/a)*v up to the scale a. With p = k + e_y =
    # softmax(t W v), t = s/a, every pair of classes j, l != y gives log u_j - log u_l = t (Wv_j - Wv_l):
    # a linear regression for t. With two classes only the label's entry is left, fitted in 1-D.
    uu, ss, vvh = torch.linalg.svd(gw, full_matrices=False)
    u, s1, v = uu[:, 0], float(ss[0]), vvh[0]
    cands = []
    for sign in (1.0, -1.0):
        us, vs = sign * u, sign * v
        if int((us < 0).sum()) != 1:
            continue
        label = int(torch.argmin(us))
        wv = w @ vs
        e_y = F.one_hot(torch.tensor(label, device=dev), n_out).to(dt)
        others = torch.arange(n_out, device=dev) != label
        t = None
        if n_out >= 3:
            a_, b_ = wv[others], torch.log(us[others])
            a_c, b_c = a_ - a_.mean(), b_ - b_.mean()
            if float(a_c @ a_c) > 0:
                t = float((a_c @ b_c) / (a_c @ a_c))
        if t is None or t <= 0:
            t = _fit_softmax_scale(us, vs, wv, e_y, s1)
        a = s1 / t
        resid = float(((a * us + e_y) - torch.softmax(t * wv, 0)).norm())
        cands.append(_Candidate(a * us, t * wv, label, None, f"label {label} (softmax fit residual {resid:.1e})"))
    if not cands:
        raise RGapUnsupported(step.name, "the output gradient is not a cross-entropy gradient of one sample")
    return cands, notes


def _fit_softmax_scale(us, vs, wv, e_y, s1) -> float:
    """t > 0 minimising ||(s1/t) us + e_y - softmax(t wv)|| by a log grid and golden section."""

    def resid(log_t):
        t = math.exp(log_t)
        return float((((s1 / t) * us + e_y) - torch.softmax(t * wv, 0)).norm())

    grid = [i / 20 for i in range(-200, 401)]
    vals = [resid(g) for g in grid]
    i0 = min(range(len(grid)), key=vals.__getitem__)
    lo, hi = grid[max(i0 - 1, 0)], grid[min(i0 + 1, len(grid) - 1)]
    for _ in range(120):
        m1, m2 = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
        if resid(m1) < resid(m2):
            hi = m2
        else:
            lo = m1
    return math.exp(0.5 * (lo + hi))
