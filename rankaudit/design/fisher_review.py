"""The design review's Fisher line: each design's floor at one σ (compare), each edit's least σ (suggest)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from rankaudit.bound.fisher import summary
from rankaudit.count.calls import trace_and_count
from rankaudit.design.edits import changed_stride, narrow_readers, narrowed_width
from rankaudit.errors import RankauditError, UsageError
from rankaudit.model.load import load_model
from rankaudit.settings.round import DPSettings, Round, dp_for_round
from rankaudit.verify.progress import ProgressBar

# The design review reads the Fisher line on few samples and a looser estimate than --verify fisher: it ranks
# designs by a figure that moves by orders of magnitude between them (--verify fisher measures one closely).
DESIGN_SAMPLES = 2
DESIGN_RELATIVE_SE = 0.05
# Seconds the rank check of each sample's Jacobian may take for the line with a prior; a reading stopped there
# counts its rank from below and nothing as hidden (a higher ceiling, said in the notes).
DESIGN_RANK_SECONDS = 30.0
# Edits measured, first in the structural ranking (`--top N` measures the N shown): each is a model to measure,
# about a minute each for a ResNet-18 at 32 px on two CPU cores.
DESIGN_EDITS = 8
# Edits that change the model's code (a skip cut) are not rebuilt from the real model: the review says so, and
# `compare` measures a design written out.
NOT_REBUILT = {
    "cut-skip": "the edit rewrites forward(): write the edited design and `compare` it at the same σ",
}


@dataclass
class EditFloor:
    """One design (the model as it is, or one edit of it) on the Fisher line."""

    edit: str  # "as is" or one of rankaudit.design.suggest.EDITS
    target: str
    detail: str
    least_noise: float | None  # the least σ keeping every measured sample's PSNR ceiling <= the target; None: not
    median_psnr_ceiling: float | None = None  # at σ = 1, dB
    reason: str = ""  # why it was not measured
    # The attacker who fills what the update cannot see with the reference mean: the designs are ranked by this σ.
    least_noise_with_prior: float | None = None
    median_prior_psnr_ceiling: float | None = None  # at σ = 1, dB


@dataclass
class FisherReview:
    """`suggest` with DP options: per design, the least σ keeping the PSNR ceiling at or below the target."""

    psnr_target: float
    clip: float
    sample_rate: float
    steps: int
    as_is: EditFloor
    edits: list[EditFloor]  # measured ones by their least σ (least first), then those not measured
    samples: int
    inputs: str
    weights: str
    estimator: str
    covers: str
    seconds: float
    notes: list[str] = field(default_factory=list)


def review_settings(options: dict, round_: Round | None, given: dict[str, str]) -> DPSettings:
    """The clip, q and T the review reads the line at (σ is what it searches; the flags or the round give the
    rest, as `suggest`'s noise search reads them)."""
    defaults = DPSettings(noise_multiplier=1.0)
    settings = DPSettings(
        noise_multiplier=1.0,
        clip=options.get("clip", defaults.clip),
        sample_rate=options.get("sample-rate", defaults.sample_rate),
        steps=options.get("steps", defaults.steps),
        level=options.get("level", defaults.level),
        noise_by=options.get("noise-by", defaults.noise_by),
    )
    return dp_for_round(round_ or Round(), settings, given)


def design_line(
    spec: str,
    input_shape,
    dp: DPSettings,
    psnr_target: float,
    data: str | None,
    edit=None,
    *,
    bn_mode: str = "train",
    batch_size: int = 1,
    what: str = "suggest's Fisher line",
    sent: dict | None = None,
) -> dict:
    """One design's Fisher line at `dp` on DESIGN_SAMPLES samples, its estimate to DESIGN_RELATIVE_SE, each
    sample's rank check within DESIGN_RANK_SECONDS; a client normalising batches of several samples is refused.
    `sent`: the shared or withheld layers (the gradient the server reads; default all of it)."""
    from rankaudit.verify.rank.fisher import line_for

    return line_for(
        spec,
        tuple(input_shape),
        dp,
        psnr_target=psnr_target,
        data=data,
        samples=DESIGN_SAMPLES,
        target=DESIGN_RELATIVE_SE,
        edit=edit,
        bn_mode=bn_mode,
        batch_size=batch_size,
        rank_seconds=DESIGN_RANK_SECONDS,
        what=what,
        **(sent or {}),
    )


def narrow_in_place(name: str, width: int, readers: list[str]) -> Callable[[nn.Module], dict]:
    """A layer cut to its first `width` output channels, on the real model: the readers' weights on the dropped
    channels are zeroed (the forward pass is the narrowed design's) and masked out of the shared gradient (the
    narrowed design has no such weights); the dropped channels' own parameters then get no gradient. The weights
    kept are the model's own."""

    def narrow(model: nn.Module) -> dict:
        import torch

        layer = _module(model, name)
        old = getattr(layer, "out_channels", None) or getattr(layer, "out_features", None)
        masks = {}
        for reader_name in readers:
            reader = _module(model, reader_name.split("#")[0])
            weight = getattr(reader, "weight", None)
            if isinstance(reader, nn.Linear) and old and reader.in_features % old == 0:
                per_channel = reader.in_features // old
                columns = (slice(None), slice(width * per_channel, None))
            elif isinstance(reader, nn.modules.conv._ConvNd) and reader.groups == 1 and reader.in_channels == old:
                columns = (slice(None), slice(width, None))
            else:
                raise UsageError(f"{reader_name} reads {name} in a way the review does not rebuild", "")
            mask = torch.ones_like(weight)
            mask[columns] = 0
            with torch.no_grad():
                weight.mul_(mask)
            masks[f"{reader_name.split('#')[0]}.weight"] = mask
        return masks

    return narrow


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise UsageError(f"{name} is not a module of the real model", "") from exc


def _edit_of(edit: str, target: str, detail: str, traced) -> Callable[[nn.Module], dict | None] | str:
    """The change `edit` makes to the real model, or why it cannot be made there."""
    if edit in NOT_REBUILT:
        return NOT_REBUILT[edit]
    name = target.split("#")[0]
    if edit == "narrow":
        return narrow_in_place(name, narrowed_width(detail), narrow_readers(traced, target))

    if edit == "remove-bias":

        def remove(model):
            module = _module(model, name)
            if not isinstance(getattr(module, "bias", None), nn.Parameter):
                raise UsageError(f"{name} holds no bias parameter to remove", "")
            module.register_parameter("bias", None)

        return remove
    if edit == "stride":

        def restride(model):
            module = _module(model, name)
            module.stride = changed_stride(module.stride)

        return restride
    return f"no rebuild of a {edit} edit on the real model"


def review(
    report,
    dp: DPSettings,
    psnr_target: float,
    data: str | None,
    top: int | None = None,
    bn_mode: str = "train",
    model_args: dict | None = None,
) -> FisherReview:
    """The least σ of the model as it is and of each suggested edit that can be made on the real model, for the
    first `top` edits (default DESIGN_EDITS) of the structural ranking, ranked by the least σ against the attacker
    with a prior (then the unbiased one); `bn_mode` and the report's batch size are the client's; every design is
    built with `model_args` (--model-arg, an app's or the config's), as the structural ranking built it."""
    from rankaudit.verify.model import model_arguments

    with model_arguments(model_args):
        return _review(report, dp, psnr_target, data, top, bn_mode, model_args)


def _review(report, dp, psnr_target, data, top, bn_mode, model_args) -> FisherReview:
    from rankaudit.verify.rank.fisher_check import check_settings

    check_settings(dp, "suggest's Fisher line")
    started = time.perf_counter()
    client = {
        "bn_mode": bn_mode,
        "batch_size": report.batch_size,
        "sent": {"shared_layers": report.shared_layers, "withheld_layers": report.withheld_layers},
    }
    limit = DESIGN_EDITS if top is None else top
    # Each design is a real model measured sample by sample (a minute or more on a large one): stderr shows life.
    with ProgressBar(1 + min(limit, len(report.suggestions)), "Fisher floor, per design") as bar:
        base = design_line(report.model, report.input_shape, dp, psnr_target, data, **client)
        bar.update()

        def floor(edit, target, detail, line) -> EditFloor:
            return EditFloor(
                edit,
                target,
                detail,
                line["least_noise"],
                line["median_psnr_ceiling"],
                least_noise_with_prior=line.get("least_noise_with_prior"),
                median_prior_psnr_ceiling=line.get("median_prior_psnr_ceiling"),
            )

        loaded = load_model(report.model, report.input_shape, device="meta", model_args=model_args)
        traced = trace_and_count(
            loaded.module, loaded.input_shape, input_dtype=loaded.input_dtype, forward_kwargs=loaded.forward_kwargs
        )
        measured, unmeasured = [], []
        for number, suggestion in enumerate(report.suggestions):
            if number >= limit:
                reason = f"beyond the first {limit} edits measured (--top N measures the N shown)"
                unmeasured.append(EditFloor(suggestion.edit, suggestion.target, suggestion.detail, None, reason=reason))
                continue
            change = _edit_of(suggestion.edit, suggestion.target, suggestion.detail, traced)
            if isinstance(change, str):
                unmeasured.append(EditFloor(suggestion.edit, suggestion.target, suggestion.detail, None, reason=change))
                bar.update()
                continue
            try:
                line = design_line(report.model, report.input_shape, dp, psnr_target, data, edit=change, **client)
            except RankauditError as exc:
                unmeasured.append(
                    EditFloor(suggestion.edit, suggestion.target, suggestion.detail, None, reason=exc.problem)
                )
                continue
            finally:
                bar.update()
            measured.append(floor(suggestion.edit, suggestion.target, suggestion.detail, line))
    measured.sort(key=ranking)
    return FisherReview(
        psnr_target=psnr_target,
        clip=dp.clip,
        sample_rate=dp.sample_rate,
        steps=dp.steps,
        as_is=floor("as is", "", "", base),
        edits=measured + unmeasured,
        samples=len(base["samples"]),
        inputs=base["inputs"],
        weights=base["weights"],
        estimator=base["estimator"],
        covers=base["covers"],
        seconds=time.perf_counter() - started,
        notes=[note for note in base["notes"] if not note.startswith(("weights:", "inputs:"))],
    )


def ranking(one: EditFloor) -> tuple[float, float]:
    """Designs in the order of the least σ against the attacker with a prior, then against unbiased attackers."""
    prior = one.least_noise_with_prior
    return (prior if prior is not None else one.least_noise, one.least_noise)


def compare_lines(
    results, specs, dp: DPSettings, psnr_target: float, data: str | None, sent: dict | None = None
) -> list[dict]:
    """Each design's Fisher line at the same σ, filed as its Result's verification['fisher'] (what the reports
    read): the model as it is, at its seeded initialisation, on the gradient it sends (`sent`: the shared or
    withheld layers, as `check` reads them)."""
    from rankaudit.verify.rank.fisher_check import check_settings

    check_settings(dp, "compare's Fisher line")
    lines = []
    for result, spec in zip(results, specs):
        if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
            raise UsageError(
                f"compare's Fisher line differentiates each sample's gradient with respect to one real-valued "
                f"input, and {spec} takes several or token ids",
                "drop --dp-noise to compare these designs' structure only",
            )
        round_ = result.round
        # A real model measured sample by sample: stderr shows life.
        with ProgressBar(1, f"Fisher floor of {spec}") as bar:
            line = design_line(
                spec,
                result.input_shape,
                dp,
                psnr_target,
                data,
                bn_mode=round_.bn_mode if round_ is not None else "train",
                batch_size=round_.batch_size if round_ is not None else result.batch_size,
                what="compare's Fisher line",
                sent=sent,
            )
            bar.update()
        result.verification["fisher"] = line
        lines.append(summary(line))
    return lines
