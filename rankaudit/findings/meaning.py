"""What a verdict means, in sentences: the bound, the round, each sample, the batch as a whole, RA-i, DP and a pass."""

from __future__ import annotations

import math

from rankaudit.bound.energy import NO_REFERENCE
from rankaudit.result import DPBound, Identifiability, Result, SampleBound
from rankaudit.settings.levels import percent
from rankaudit.settings.round import Round

# Below this estimated hidden share of an image's energy, the visible part is a near-perfect picture of it.
NEAR_PERFECT_HIDDEN = 0.05

# R-GAP's index (method.md: counting): where its closed-form recursion stops. It no longer gives the verdict.
RA_MEANING = {
    "exposed": "R-GAP's closed form over-determines the input of every layer and reconstructs it layer by layer",
    "boundary": "R-GAP's closed form has exactly as many constraints as unknowns at the critical layer",
    "protected": "R-GAP's closed-form recursion stops at the critical layer (more unknowns than constraints there)",
}
ALL_DENSE_MEANING = "every layer is dense (no weight sharing): R-GAP recovers each layer's input from its own gradient"


def ra_verdict(ra_i: int | None) -> str:
    """The counting section's reading of RA-i: < 0 exposed, = 0 boundary, > 0 protected; no non-dense layer is exposed."""
    if ra_i is None or ra_i < 0:
        return "exposed"
    return "boundary" if ra_i == 0 else "protected"


def energy_percent(share: float) -> str:
    """A certified hidden share as the reports write it: "less than 0.01 %" where the percent would need more
    digits than a reader can use."""
    return "less than 0.01 %" if 0 < share < 1e-4 else percent(share)


def visible_percent(hidden: float) -> str:
    """The share of the energy the visible directions may hold, given the share certified hidden: "all" with
    nothing hidden, "more than 99.99 %" where the exact figure would need more digits than a reader can use."""
    if hidden <= 0:
        return "all"
    return "more than 99.99 %" if hidden < 1e-4 else f"up to {percent(1 - hidden)}"


def hidden_estimate_sentence(bound: Identifiability) -> str:
    """What the batch or round line hides of the energy: the certificate (method.md: energy) where one was computed, else
    the verdicts section's estimate, pointing to the measurement."""
    if bound.certified_deficit <= 0:
        return "nothing of the input is certified hidden"
    if bound.certified_hidden_energy is not None:
        if certifies_nothing(bound):
            return "nothing of the samples' detail is certified hidden without --data (the input is not an image)"
        return (
            f"{percent(bound.certificate_quantile)} of batches like yours keep "
            f"{_at_least(bound.certified_hidden_energy)} of the samples' detail hidden, for any weights"
        )
    hidden = bound.hidden_estimate
    expect = "expect a near-perfect reconstruction" if hidden < NEAR_PERFECT_HIDDEN else "expect a degraded one"
    return (
        f"about {percent(hidden)} of the input's directions are hidden (--verify rank measures the energy they "
        f"hold); {expect}"
    )


def bound_meaning(bound: Identifiability, ra_i: int | None, critical_layer: str | None) -> str:
    """What the bound means, in one sentence (method.md: the bound, verdicts); the level itself is read on energy (method.md: energy)."""
    if bound.certified_deficit > 0:
        return (
            f"at least {bound.certified_deficit:,} input directions leave every shared gradient unchanged (to "
            f"first order), whatever the attack: at most {percent(bound.recoverable_fraction)} of the input's "
            f"directions can be recovered; {hidden_estimate_sentence(bound)}"
        )
    if ra_i is not None and ra_i > 0:
        return (
            f"no cut through the graph stops the shared gradient from determining the input; R-GAP's closed "
            f"form stops at {critical_layer}, but optimisation attacks are not stopped"
        )
    return "no cut through the graph stops the shared gradient from determining the input: a server can reconstruct it"


def _at_least(share: float) -> str:
    if share <= 0:
        return "nothing"
    shown = energy_percent(share)
    return shown if shown.startswith("less") else f"at least {shown}"


def samples_like_yours(bound: Identifiability) -> str:
    """ "90 % of samples like yours": the share of samples the per-sample certificate speaks for, and, where it is
    read off the user's samples, how many and with what confidence."""
    read = ""
    if bound.certificate_samples is not None and bound.certificate_confidence is not None:
        read = (
            f" (read from your {bound.certificate_samples:,} samples, "
            f"{percent(bound.certificate_confidence)} confidence)"
        )
    return f"{percent(bound.certificate_quantile)} of samples like yours{read}"


def certifies_nothing(bound: Identifiability) -> bool:
    """Whether no reference distribution was there to certify anything (a non-image input without --data)."""
    return bound.spectrum == NO_REFERENCE


def energy_sentence(result: Result) -> str:
    """The per-sample certificate as the verdict line names it: the share of their detail that samples like the
    user's keep hidden, the PSNR ceiling, the threat it covers, the distribution, and, where no architecture
    reaches `protected`, that noise is the way (docs/method.md, "The certificate, per sample")."""
    bound = result.identifiability
    sample = bound.sample if bound is not None else None
    if sample is None or sample.certified_hidden_energy is None:
        return ""
    protected_share = 1 - bound.max_recoverable
    note = f" {bound.reference_note[:1].upper()}{bound.reference_note[1:]}." if bound.reference_note else ""
    if certifies_nothing(bound) and sample.rank_bound >= sample.unknowns:
        # Every direction reaches the server: a reference distribution has no hidden part to read, so --data would
        # change nothing.
        return (
            f"For any weights, nothing is certified hidden: every direction of a sample reaches the server (rank "
            f"{sample.rank_bound:,} of {sample.unknowns:,}), so no data, --data included, can show any of it hidden; "
            f"only client DP noise bounds what a server reconstructs (--dp-noise, `rankaudit suggest` with "
            f"--max-reconstruction); protected asks that {samples_like_yours(bound)} keep at least "
            f"{percent(protected_share)} of their detail hidden (--max-recoverable).{note}"
        )
    if certifies_nothing(bound):
        return (
            f"For any weights, nothing is certified hidden: this input is not an image, and without --data there is "
            f"no distribution of samples like yours to certify against; give --data (a few hundred samples like "
            f"yours) for a figure; protected asks that {samples_like_yours(bound)} keep at least "
            f"{percent(protected_share)} of their detail hidden (--max-recoverable).{note}"
        )
    if sample.rank_bound == 0:  # nothing reaches the server: its best guess is the reference's mean
        psnr = "no direction of them reaches the server"
    elif sample.visible_psnr_ceiling is not None:
        psnr = f"their visible part is at most a {sample.visible_psnr_ceiling:.1f} dB reconstruction"
    else:
        psnr = "their visible part can be the sample itself"
    expected = (
        f"; on average {energy_percent(sample.expected_hidden_energy)} stays hidden"
        if sample.expected_hidden_energy and sample.rank_bound > 0
        else ""
    )
    if sample.certified_hidden_energy > 0:
        kept = (
            f"{samples_like_yours(bound)} keep {_at_least(sample.certified_hidden_energy)} of their detail (their "
            f"difference from the average sample) hidden and {psnr}"
        )
    else:
        kept = (
            "nothing of a sample's detail (its difference from the average sample) is certified hidden, and "
            + psnr.replace("their visible part", "its visible part")
        )
    text = (
        f"For any weights, including a server that picks them: {kept} ({bound.spectrum}{expected}); protected asks "
        f"at least {percent(protected_share)} (--max-recoverable)"
    )
    if result.verdict == "protected":
        return text + "." + note
    if result.verdict == "exposed":
        text += f", and less than {percent(bound.exposed_below)} is exposed (--exposed-below)"
    text += "."
    if bound.protected_rank is not None and bound.protected_rank < sample.rank_bound:
        if bound.protected_rank == 0:
            text += (
                " No architecture change reaches protected on this input: a single visible direction already shows "
                "more than that share of the detail of some samples like yours."
            )
        else:
            text += f" Protected needs a per-sample rank bound of at most {bound.protected_rank:,}."
    return text + note


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
    """What the round's verdict means, in one sentence (method.md: the round)."""
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
    return (
        reach + f"; {hidden_estimate_sentence(bound)}; a deficit of the round's inputs as a whole, which does not "
        "prove that each sample keeps a hidden part"
    )


# ---- each sample, not the batch (method.md: each sample) ---------------------------------------------------------------------


def per_sample_view(result: Result) -> bool:
    """Whether the sample level differs from the batch level: anything but FedSGD at batch size 1, where both are
    one sample's gradient and every report reads as before."""
    round_ = result.round
    fedsgd_one = (round_.fedsgd and round_.batch_size == 1) if round_ is not None else result.batch_size == 1
    sample = result.identifiability.sample if result.identifiability is not None else None
    return not fedsgd_one or (sample is not None and sample.rounds > 1)


def _steps(count: int) -> str:
    return f"{count} local step{'s' if count != 1 else ''}"


def sample_meaning(bound: Identifiability) -> str:
    """What the per-sample verdict means, in one sentence (method.md: each sample)."""
    sample = bound.sample
    steps, one_step = _steps(sample.steps_per_sample), sample.single_sample_bound
    if sample.rounds > 1:
        steps += f" in each of {sample.rounds:,} server rounds"
    if sample.rank_bound >= sample.unknowns:
        if one_step >= sample.unknowns:
            why = "one step's gradient can determine one sample (at batch size 1 no cut through the graph certifies anything)"
        elif sample.rounds > 1 and sample.round_bound < sample.unknowns:
            why = (
                f"one round's update sees at most {sample.round_bound:,} of a sample's {sample.unknowns:,} "
                f"directions, but its {sample.rounds:,} rounds together can see all of them"
            )
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
        per_step = (
            f"{one_step:,} per step with the batch statistics"
            if sample.batch_statistics
            else f"R(1) = {one_step:,} per step"
        )
        cap = f"the {steps} that read it carry at most {sample.rank_bound:,} of its directions ({per_step})"
    text = (
        f"at least {deficit:,} of each sample's {sample.unknowns:,} directions leave the update unchanged (to "
        f"first order), whatever the attack and whatever the other samples, because {cap}: at most "
        f"{percent(sample.recoverable_fraction)} of any one sample's directions can be recovered"
    )
    return text


def coverage_sentence(sample: SampleBound, round_: Round, batch_norms: list[str]) -> str:
    """What one verdict covers (method.md: the round): the server rounds counted, and the BatchNorm mode of the model's
    `batch_norms` (empty: the model has none, and the mode is not mentioned)."""
    per_round = sample.round_bound
    if not sample.rounds_known:
        text = "One server round"
        if sample.rank_bound >= sample.unknowns:
            text += " (the rounds are not known; one round already reaches every direction of a sample)"
        elif per_round:
            after = math.ceil(sample.unknowns / per_round)
            text += (
                f" (the rounds are not known): each further round the client takes part in can add up to "
                f"{per_round:,} directions; after {after:,} rounds nothing is certified hidden. Give "
                "--server-rounds (server-rounds in [tool.rankaudit.round]) to count them"
            )
        else:
            text += " (the rounds are not known; further rounds add nothing: no gradient reaches the server)"
    elif sample.rounds == 1:
        text = "The one server round the client takes part in"
    else:
        text = (
            f"All {sample.rounds:,} server rounds: {sample.rounds:,} x {per_round:,} = "
            f"{sample.rounds * per_round:,} directions at most"
            + (f", capped at the sample's {sample.unknowns:,}" if sample.rounds * per_round > sample.unknowns else "")
            + " (every round counted: client sampling lowers the expected number, not the worst case)"
        )
    if batch_norms:
        shown = ", ".join(batch_norms[:3]) + (" ..." if len(batch_norms) > 3 else "")
        if round_.bn_mode == "eval":
            text += (
                f". BatchNorm in eval mode ({shown}: running statistics, --bn-mode eval): a client training in "
                "training mode couples the samples of a batch, which this bound does not cover"
            )
            if sample.batch_statistics:
                text += f" (except {', '.join(sample.batch_statistics[:3])}: no running statistics, counted)"
        elif sample.batch_statistics:
            others = round_.batch_size - 1
            text += (
                f". BatchNorm in training mode: the batch statistics of {shown} carry each sample into the other "
                f"{others:,} sample{'s' if others != 1 else ''} of its batch, and the bound counts these paths"
            )
        else:
            text += f". BatchNorm in training mode ({shown}): a batch of one sample couples nothing"
    if sample.running_statistics:
        norms = list(dict.fromkeys(key.rpartition(".")[0] for key in sample.running_statistics))
        shown = ", ".join(norms[:3]) + (" ..." if len(norms) > 3 else "")
        text += (
            f". Running statistics counted as sent ({shown}): each training step moves them by the batch's mean "
            "and variance of the norm's input, and a client that sends its state_dict sends them (assumed, unless "
            "withheld-layers names them, e.g. "
            f"{norms[0]}.running_mean,{norms[0]}.running_var, for a client that sends parameters() alone)"
        )
    return text + "."


def whole_sentence(result: Result) -> str:
    """The batch or round level as what it is (method.md: each sample): a statement about all samples at once."""
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
        samples = f"all {count:,} samples" if count != 1 else "the sample"
        return f"{head}: no attack recovers {samples} at once; this is no guarantee for any one of them."
    return f"{head}: nothing certifies that any part of the {f'{count:,} samples' if count != 1 else 'sample'} stays hidden."


# --- differential privacy (method.md: DP): a section beside the structural verdict -----------------------------------

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
    """Which of the two carries a passing verdict (method.md: each sample: structure or noise), in one sentence; '' otherwise."""
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
