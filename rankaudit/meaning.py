"""What a verdict means, in sentences: the bound, the round, each sample, the batch as a whole, RA-i, DP and a pass."""

from __future__ import annotations

from rankaudit.levels import percent
from rankaudit.result import DPBound, Identifiability, Result

# Below this estimated hidden share of an image's energy, the visible part is a near-perfect picture of it.
NEAR_PERFECT_HIDDEN = 0.05

# R-GAP's index (spec §4): where its closed-form recursion stops. It no longer gives the verdict.
RA_MEANING = {
    "exposed": "R-GAP's closed form over-determines the input of every layer and reconstructs it layer by layer",
    "boundary": "R-GAP's closed form has exactly as many constraints as unknowns at the critical layer",
    "protected": "R-GAP's closed-form recursion stops at the critical layer (more unknowns than constraints there)",
}
ALL_DENSE_MEANING = "every layer is dense (no weight sharing): R-GAP recovers each layer's input from its own gradient"


def ra_verdict(ra_i: int | None) -> str:
    """Spec §4's reading of RA-i: < 0 exposed, = 0 boundary, > 0 protected; no non-dense layer is exposed."""
    if ra_i is None or ra_i < 0:
        return "exposed"
    return "boundary" if ra_i == 0 else "protected"


def hidden_estimate_sentence(bound: Identifiability) -> str:
    """Spec §11's static estimate of what a deficit hides of a natural image, pointing to the measurement."""
    if bound.certified_deficit <= 0:
        return "nothing of the input is certified hidden"
    hidden = bound.hidden_estimate
    expect = (
        "expect a near-perfect reconstruction"
        if hidden < NEAR_PERFECT_HIDDEN
        else "expect a recognisable reconstruction"
        if bound.verdict == "partial"
        else "expect a degraded reconstruction"
    )
    return (
        f"about {percent(hidden)} of an image's energy can be hidden (estimate: deficit / unknowns; --verify rank "
        f"measures it); {expect}"
    )


def bound_meaning(bound: Identifiability, ra_i: int | None, critical_layer: str | None) -> str:
    """What the verdict means, in one sentence (spec §9, §11)."""
    if bound.verdict == "protected":
        return (
            f"at least {bound.certified_deficit:,} input directions leave every shared gradient unchanged (to "
            f"first order), whatever the attack: at most {percent(bound.recoverable_fraction)} of the input's "
            f"directions can be recovered (ceiling {percent(bound.max_recoverable)}); "
            f"{hidden_estimate_sentence(bound)} (protected is not the same as private: the visible directions "
            "still carry part of the image)"
        )
    if bound.verdict == "partial":
        return (
            f"only {bound.certified_deficit:,} input directions are certified invisible: up to "
            f"{percent(bound.recoverable_fraction)} of the input's directions can still be recovered, above the "
            f"{percent(bound.max_recoverable)} ceiling; {hidden_estimate_sentence(bound)}. This is not "
            "protection: only a reconstruction of the whole input is ruled out"
        )
    if ra_i is not None and ra_i > 0:
        return (
            f"no cut through the graph stops the shared gradient from determining the input; R-GAP's closed "
            f"form stops at {critical_layer}, but optimisation attacks are not stopped"
        )
    return "no cut through the graph stops the shared gradient from determining the input: a server can reconstruct it"


def ra_sentence(result: Result) -> str:
    if result.ra_i is None:
        text = f"RA-i undefined: {ALL_DENSE_MEANING}."
    else:
        text = f"RA-i {result.ra_i} at {result.critical_layer}: {RA_MEANING[ra_verdict(result.ra_i)]}."
    if result.round is not None and result.round.steps > 1:
        text += (
            f" RA-i reads one gradient of one batch of {result.batch_size} (FedSGD): R-GAP has no multi-step "
            "form, so it says nothing about this round's update."
        )
    return text


def round_meaning(bound: Identifiability) -> str:
    """What the round's verdict means, in one sentence (spec §12)."""
    cap = bound.round.explanation
    if not bound.certified_deficit:
        return (
            f"no cap stops the round's update from determining the client's samples ({cap}): a server can "
            "reconstruct them"
        )
    reach = (
        f"at least {bound.certified_deficit:,} of the {bound.unknowns:,} input directions leave the update "
        f"unchanged (to first order), whatever the attack, because {cap}; up to "
        f"{percent(bound.recoverable_fraction)} of them can be recovered"
    )
    if bound.verdict == "partial":
        return (
            reach + f", above the {percent(bound.max_recoverable)} ceiling: this is not protection, only a "
            "reconstruction of every sample in full is ruled out"
        )
    return (
        reach + f" (ceiling {percent(bound.max_recoverable)}); a deficit of the round's inputs as a whole, which "
        "does not prove that each sample keeps a hidden part"
    )


# ---- each sample, not the batch (spec §14) ---------------------------------------------------------------------


def per_sample_view(result: Result) -> bool:
    """Whether the sample level differs from the batch level: anything but FedSGD at batch size 1, where both are
    one sample's gradient and every report reads as before."""
    round_ = result.round
    fedsgd_one = (round_.fedsgd and round_.batch_size == 1) if round_ is not None else result.batch_size == 1
    return not fedsgd_one


def _steps(count: int) -> str:
    return f"{count} local step{'s' if count != 1 else ''}"


def sample_meaning(bound: Identifiability) -> str:
    """What the per-sample verdict means, in one sentence (spec §14)."""
    sample = bound.sample
    steps, one_step = _steps(sample.steps_per_sample), sample.single_sample_bound
    if sample.level == "exposed":
        if one_step >= sample.unknowns:
            why = "one step's gradient can determine one sample (at batch size 1 no cut through the graph certifies anything)"
        else:
            why = (
                f"one step's gradient sees at most {one_step:,} of a sample's {sample.unknowns:,} directions, but "
                f"its {sample.steps_per_sample} steps together can see all of them"
            )
        return (
            f"each sample is read by {steps}; {why}: no count certifies that any part of any one sample stays "
            "hidden, whatever the batch, the round or the aggregation around it"
        )
    deficit = sample.unknowns - sample.rank_bound
    if sample.binding == "update-values":
        cap = f"the update has only {sample.rank_bound:,} values"
    else:
        cap = (
            f"the {steps} that read it carry at most {sample.rank_bound:,} of its directions (R(1) = "
            f"{one_step:,} per step)"
        )
    text = (
        f"at least {deficit:,} of each sample's {sample.unknowns:,} directions leave the update unchanged (to "
        f"first order), whatever the attack and whatever the other samples, because {cap}: at most "
        f"{percent(sample.recoverable_fraction)} of any one sample can be recovered"
    )
    if sample.level == "partial":
        return text + f", above the {percent(bound.max_recoverable)} ceiling: this is not protection"
    return text + f" (ceiling {percent(bound.max_recoverable)})"


def whole_sentence(result: Result) -> str:
    """The batch or round level as what it is (spec §14): a statement about all samples at once."""
    bound = result.identifiability
    round_ = result.round
    if round_ is not None and not round_.fedsgd:
        what, count = "round", round_.clients * round_.samples
    else:
        what, count = "batch", (round_.clients * round_.batch_size if round_ is not None else result.batch_size)
    head = (
        f"The {what} as a whole: rank <= {bound.rank_bound:,} of {bound.unknowns:,} "
        f"({percent(bound.recoverable_fraction)})"
    )
    if bound.certified_deficit > 0:
        return f"{head}: no attack recovers all {count:,} samples at once; this is no guarantee for any one of them."
    return f"{head}: nothing certifies that any part of the {count:,} samples stays hidden."


# --- differential privacy (spec §13): a section beside the structural verdict -----------------------------------

DP_UNITS = {"sample": "DP-SGD", "client": "DP-FedAvg (client level)"}


def dp_sentence(dp: DPBound) -> str:
    """The DP section in one sentence: ε at δ and the bound on any reconstruction at the user's prior."""
    epsilon = "no finite ε" if dp.epsilon is None else f"ε {dp.epsilon:.3g}"
    nothing = " (the noise bounds nothing here)" if dp.reconstruction_bound >= 1.0 else ""
    if dp.noise_by == "server":
        return (
            f"{DP_UNITS[dp.level]} with noise the server adds: {epsilon} at δ {dp.delta:g}; a reconstruction "
            f"from the released model succeeds with probability at most {dp.reconstruction_bound:.3g} when its "
            f"prior baseline is {dp.prior:g}; this bounds what the released model reveals, not what the server "
            "sees" + nothing
        )
    return (
        f"{DP_UNITS[dp.level]}: {epsilon} at δ {dp.delta:g}; any reconstruction succeeds with probability at most "
        f"{dp.reconstruction_bound:.3g} when its prior baseline is {dp.prior:g}{nothing}"
    )


def carried_by_sentence(result: Result) -> str:
    """Which of the two carries a passing verdict (spec §14: structure or noise), in one sentence; '' otherwise."""
    policy, dp = result.policy, result.dp
    if policy is None or not policy.passed or dp is None:
        return ""
    if policy.carried_by == "structure":
        return (
            f"carried by the structure: each sample is {result.verdict} by the architecture alone, whatever the noise"
        )
    if policy.carried_by != "noise":
        return ""
    return (
        f"carried by the noise, not the structure: the architecture leaves each sample {result.verdict}, and the "
        f"noise the client adds bounds any reconstruction of it to probability {dp.reconstruction_bound:.3g} at "
        f"prior {dp.prior:g}, within --max-reconstruction {dp.max_reconstruction:g}"
    )
