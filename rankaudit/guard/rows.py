"""The readouts of the weight matrices sent without a bias update beside them (a layer without a bias, one whose
bias is not sent, one whose bias the training left as it was): no ratio fixes the scale of a unit's row update, so
each row, and each difference of two rows that the update or the signals pair, is compared with each sample at its
best scale and offset (docs/method.md, "The client-side guard"). Plain tensors in; nothing here runs the model.
"""

from __future__ import annotations

import math

import torch

from rankaudit.guard.pairs import candidate_pairs, peaks, psnr_of, round_coefficients
from rankaudit.guard.readout import bias_of, listed, weight_layer
from rankaudit.result import GuardReadout


def _without_bias(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """[(layer, its weight's name)] for each weight matrix sent without a bias update beside it: a layer without a
    bias, one whose bias is not sent, and one whose bias the training left as it was (frozen, or not given to the
    optimiser) while its weight moved. None of them has a ratio to fix the scale of a row update."""
    found = []
    for name, weight in sent.items():
        layer = weight_layer(name)
        if layer is None or weight.dim() < 2 or not weight.is_floating_point() or name not in received:
            continue
        bias = bias_of(layer)
        if (
            bias not in received
            or bias not in sent
            or (
                sent[bias].shape == received[bias].shape
                and bool(torch.equal(sent[bias], received[bias]))
                and not bool(torch.equal(weight, received[name]))
            )
        ):
            found.append((layer, name))
    return found


def row_readouts(
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    samples: torch.Tensor,
    min_psnr: float,
    signals: dict[str, torch.Tensor] | None = None,
) -> tuple[list[GuardReadout], list[str], str | None, list[str]]:
    """(readouts, layers checked, a skipped-layer line or None, the layers it names) for the weight matrices sent
    without a bias. With no bias, no ratio fixes the scale of a unit's row update, which is one sample's vector when
    only that sample reached the unit; a server that knows the data's range or mean fixes scale and offset itself.
    So a row the size of a sample is compared with each sample at its best scale and offset (the most any such
    server reads), and read at ``min_psnr`` or above leaks that sample; other such layers are not checked, and the
    line says so. ``signals``: each sample's signal at each unit, where measured ({layer: (N, units)}: a layer
    whose bias did not move still has them), which propose pairs of rows when the samples outnumber the inputs."""
    readouts, checked, unchecked = [], [], []
    size = samples[0].numel() if len(samples) else 0
    for layer, name in _without_bias(received, sent):
        weight = sent[name]
        if weight[0].numel() != size:
            unchecked.append(layer)
            continue
        checked.append(layer)
        rows = weight.detach().reshape(len(weight), -1).to(torch.float64)
        rows = rows - received[name].detach().reshape(len(weight), -1).to(torch.float64)
        flat = samples.reshape(len(samples), -1).to(torch.float64)
        for unit, sample, score in _best_affine_matches(rows, flat):
            if score >= min_psnr:
                readouts.append(_row_readout(layer, [unit], "row", sample, score))
        # Pairs of rows whose coefficients (solved from the update itself) agree on every sample but one: their
        # difference is that sample's vector at some scale, as an imprint's neighbouring units give with no bias
        # (a constant input, or a BatchNorm's offset after the layer, fixes the scale for the server).
        tables = round_coefficients(rows, flat)
        measured = (signals or {}).get(layer)
        if measured is not None and tuple(measured.shape) == (len(flat), len(rows)):
            tables.append(measured)
        candidates = sorted({pair for table in tables for pair in candidate_pairs(table)})
        if candidates:
            combined = torch.stack([rows[i] - scale * rows[j] for i, j, _, scale in candidates])
            for k, sample, score in _best_affine_matches(combined, flat):
                if score >= min_psnr:
                    i, j, _, scale = candidates[k]
                    readouts.append(_row_readout(layer, [i, j], "row-pair", sample, score, scale))
    if not unchecked:
        return readouts, checked, None, []
    line = (
        f"{listed([layer or 'the model' for layer in unchecked])}: no bias, so no ratio fixes the scale of a "
        "unit's row update, which can be one sample's vector (a server that knows the data's range fixes it); not "
        "checked"
    )
    return readouts, checked, line, unchecked


def _row_readout(layer: str, units: list[int], kind: str, sample: int, score: float, scale=None) -> GuardReadout:
    """A readout of a layer without a bias, which reads the sample itself, at its best scale and offset."""
    return GuardReadout(
        layer,
        units,
        kind,
        sample,
        10 ** (-score / 20),
        True,
        psnr=round(score, 2),
        sample_psnr=round(score, 2),
        leaks=True,
        scale=scale,
    )


def unread_parameters(sent: dict[str, torch.Tensor], accounted: set[str]) -> str | None:
    """A skipped-layer line for the weight matrices (two or more dimensions) sent that no readout reads and no other
    line names (a parametrised weight's parts, an attention's packed projections, a recurrent layer's weights), or
    None. ``accounted``: the layers checked or named as not checked."""
    names = []
    for name, value in sent.items():
        if not value.is_floating_point() or value.dim() < 2:
            continue
        layer = weight_layer(name)
        if layer is None or layer not in accounted:
            names.append(name)
    if not names:
        return None
    return f"{listed(names)}: not a layer's weight any readout here reads; not checked"


def _best_affine_matches(rows: torch.Tensor, samples: torch.Tensor) -> list[tuple[int, int, float]]:
    """[(unit, sample, PSNR)]: each finite, non-constant row's best match among the samples at the best scale and
    offset (a·row + b), searched by correlation, its PSNR from the fitted row's own difference with the sample; the
    peak is the sample's range."""
    centred_rows = rows - rows.mean(1, keepdim=True)
    centred = samples - samples.mean(1, keepdim=True)
    energy = (centred_rows * centred_rows).sum(1)
    usable = torch.nonzero(torch.isfinite(energy) & (energy > 0)).flatten()
    # A constant sample is matched by any row at scale 0: its offset alone is the fit, and the row shows nothing.
    varied = (centred * centred).sum(1) > 0
    if not len(usable) or not bool(varied.any()):
        return []
    peak = peaks(samples)
    cross = centred_rows[usable] @ centred.T
    left = (centred * centred).sum(1)[None, :] - cross**2 / energy[usable, None]
    left = torch.where(varied[None, :], left.clamp_min(0), math.inf)
    best = (left / (peak**2)[None, :]).argmin(dim=1)
    scale = cross[torch.arange(len(usable)), best] / energy[usable]
    scores = psnr_of(centred_rows[usable] * scale[:, None], centred[best], peak[best])
    return list(zip(usable.tolist(), best.tolist(), scores.tolist()))
