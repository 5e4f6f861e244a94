"""Registry: `--verify NAME` -> the one module that runs it, what it needs, and the record it returns (the verifiers
run in rankaudit.verify.run)."""

# Each verifier lives beside what it verifies: verify/rank/check.py measures the rank (verify/rank/ holds the
# measurement), verify/attacks/<name>_check.py runs one attack (verify/attacks/<name>.py is the algorithm, the
# `_check` beside it reads the Result, runs the algorithm on real tensors and returns the record). A verifier
# module's top imports only light modules: the CLI reads the names and help from here before torch is loaded.
# Adding a verifier: one new module that defines VERIFIER, and its line in _MODULES.

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from rankaudit.errors import UsageError
from rankaudit.settings.files import input_file
from rankaudit.settings.levels import DEFAULT_PSNR_TARGET

# The fix for --weights naming no file, a folder or a pipe (torch.load reads a file it may seek in).
WEIGHTS_FIX = "save the weights to a file with torch.save (a state dict, or a checkpoint holding one) and name it"

if TYPE_CHECKING:
    from rankaudit.result import Result
    from rankaudit.settings.round import DPSettings

# The CLI lists the verifiers in this order (--verify's choices and help); they run in the order of `Verifier.order`.
_MODULES = (
    "rankaudit.verify.attacks.rgap_check",
    "rankaudit.verify.attacks.gdbr_check",
    "rankaudit.verify.rank.check",
    "rankaudit.verify.rank.fisher_check",
    "rankaudit.verify.attacks.dager_check",
    "rankaudit.verify.attacks.dp_check",
    "rankaudit.verify.attacks.bias_check",
)


class Need(str, Enum):
    """What a verifier needs. The dispatch below reads IMAGES, TOKENS, ROUND and DP_NOISE (never a verifier's
    name); LABELS, GPU and TRAINABLE say what the verifier itself checks or prefers."""

    IMAGES = "images"  # real images or real-valued inputs: Pillow (the [verify] extra), scipy in a round
    LABELS = "labels"  # labelled batches
    TOKENS = "tokens"  # random token batches of the vocabulary: runs before the image extras are checked
    ROUND = "a round"  # has a form for a round that is not FedSGD; without it, such a round is refused
    DP_NOISE = "DP settings"  # attacks the DP noise: runs first and alone, takes no --defense
    GPU = "a GPU preferred"  # --device auto picks CUDA when present
    TRAINABLE = "a trainable model"  # refuses a model that shares no gradient


@dataclass(frozen=True)
class VerifyContext:
    """One model's verification request, built once by the CLI and handed to every verifier."""

    result: Result
    spec: str
    seed: int = 0
    device: str = "auto"
    samples: int = 4
    samples_given: bool = False  # --samples on the command line (the DP attack's trials default otherwise)
    data: str | None = None
    steps: int = 1000
    restarts: int = 2
    artifacts: str | None = None
    trials: int = 5
    class_dist: str = "random"
    aux: str | None = None
    dp: DPSettings | None = None
    dp_candidates: int | None = None
    defense_specs: tuple[str, ...] = ()  # --defense as given
    defenses: tuple = ()  # the parsed defenses (rankaudit.verify.defenses.Defense), filled by run.run_verifiers
    shared_layers: list[str] | None = None
    withheld_layers: list[str] | None = None
    rank_precision: str = "auto"
    rank_method: str = "auto"
    rank_budget: float | None = None  # --rank-budget: seconds per sample for the matrix-free check (None: until exact)
    psnr_target: float = DEFAULT_PSNR_TARGET  # --psnr-target: the PSNR ceiling the least σ of --verify fisher keeps
    weights: str | None = None  # --weights: a state dict or checkpoint every verifier runs at (None: seeded init)
    show_progress: bool = True
    several: bool = False  # several models in one run: each keeps its --artifacts in a folder of its own
    requested: tuple[str, ...] = ()  # the names asked for

    @property
    def in_round(self) -> bool:
        """A round that is not FedSGD: the update of several local steps or clients, not one gradient."""
        return self.result.round is not None and not self.result.round.fedsgd


@dataclass(frozen=True)
class Verifier:
    """One `--verify NAME`: `run` returns its record, filed under `name` in Result.verification."""

    name: str
    help: str  # its sentence in --verify's help
    needs: frozenset[Need]
    run: Callable[[VerifyContext], dict]
    order: int = 100  # when it runs among those chosen (lower first)
    preflight: Callable[[VerifyContext], None] | None = None  # refusals due before any verifier spends time
    runs_first: Callable[[VerifyContext], tuple[str, ...]] = lambda context: ()  # verifiers it needs run before it
    defended: Callable[..., list[dict]] | None = None  # (context, defenses, *, optimisation) -> rows: --defense
    flags: dict[str, str] = field(default_factory=dict)  # its own flags -> what they set (refused without it)


_verifiers: dict[str, Verifier] | None = None


def verifiers() -> dict[str, Verifier]:
    """Every registered verifier by name, in the CLI's order (the modules are imported once)."""
    global _verifiers
    if _verifiers is None:
        loaded = [importlib.import_module(module).VERIFIER for module in _MODULES]
        _verifiers = {verifier.name: verifier for verifier in loaded}
    return _verifiers


def names() -> list[str]:
    return list(verifiers())


def get(name: str) -> Verifier:
    return verifiers()[name]


def help_text() -> str:
    """--verify's help: each verifier's sentence, in the registry's order."""
    return "Also run a verifier (repeatable). " + " ".join(f"{v.name}: {v.help}" for v in verifiers().values())


def defendable() -> list[str]:
    """The verifiers --defense repeats against a defended gradient."""
    return [name for name, verifier in verifiers().items() if verifier.defended is not None]


def runs_apart(verifier: Verifier) -> bool:
    return Need.DP_NOISE in verifier.needs


def check_request(
    requested, defense_specs, flags: dict[str, Any], weights: str | None = None, artifacts: str | None = None
) -> None:
    """Refusals that need no model: --defense with nothing to defend, a verifier's flag without the verifier,
    --weights or --artifacts without a verifier, --weights naming no file."""
    chosen = [get(name) for name in requested]
    if artifacts is not None and not requested:
        raise UsageError(
            "--artifacts is where the verifiers write their images and records; without --verify nothing would be "
            "written there",
            "add --verify rank (or another verifier), or drop --artifacts",
        )
    if weights is not None and not requested:
        raise UsageError(
            "--weights sets the weights the verifiers run at; the analysis holds for every weight value",
            "add --verify rank (or another verifier), or drop --weights",
        )
    if weights is not None:
        input_file(weights, "--weights", WEIGHTS_FIX)
    if defense_specs and not [verifier for verifier in chosen if not runs_apart(verifier)]:
        raise UsageError(
            "--defense needs an attack to defend against",
            "add " + " and/or ".join(f"--verify {name}" for name in defendable()),
        )
    if defense_specs:  # a malformed value is the user's to fix (exit 2), said before any model runs
        from rankaudit.verify.defenses import parse_defense

        for spec in defense_specs:
            parse_defense(spec)
    for verifier in verifiers().values():
        for flag, what in verifier.flags.items():
            if flags.get(flag) is not None and verifier.name not in requested:
                raise UsageError(
                    f"{flag} sets {what} of --verify {verifier.name}", f"add --verify {verifier.name} or drop {flag}"
                )


# The largest run a verifier starts: beyond these a run would take days, so it is refused before any work (exit 2).
# --verify dp checks its own (rankaudit.verify.attacks.dp); the rank check sizes its sketch to the memory.
MAX_STEPS = 100_000  # optimisation steps of the inversion (--steps)
MAX_SAMPLES = 1_000  # inputs attacked or measured (--samples)
MAX_TRIALS = 1_000  # GDBR's victim batches (--trials)
MAX_BATCH = 4_096  # samples in one real batch (--batch-size): the bias readout, GDBR, the rank of a batch
MAX_PASSES = 10**8  # sample-gradient passes of the inversion: samples x batch x steps x restarts
MAX_BATCH_VALUES = 2 * 10**8  # input values of one real batch in float64 (1.6 GB)


def check_budget(
    requested,
    *,
    steps: int,
    samples: int,
    trials: int,
    batch_size: int,
    restarts: int = 2,
    sample_values: int | None = None,
) -> None:
    """Refuse, before any work, a verifier run beyond the limits above: one line naming the limit and the flag."""
    chosen = [name for name in requested if not runs_apart(get(name))]
    if not chosen:
        return
    what = "--verify " + ", ".join(chosen)

    def refuse(problem: str, fix: str):
        raise UsageError(f"{what}: {problem}", fix)

    if "rgap" in chosen and steps > MAX_STEPS:
        refuse(
            f"--steps {steps:,} is above the {MAX_STEPS:,} steps an inversion runs",
            f"give --steps {MAX_STEPS} or fewer",
        )
    if samples > MAX_SAMPLES:
        refuse(
            f"--samples {samples:,} is above the {MAX_SAMPLES:,} inputs a verifier attacks in one run",
            f"give --samples {MAX_SAMPLES} or fewer, and run again with another --seed for more",
        )
    if "gdbr" in chosen and trials > MAX_TRIALS:
        refuse(
            f"--trials {trials:,} is above the {MAX_TRIALS:,} batches GDBR attacks in one run",
            f"give --trials {MAX_TRIALS} or fewer, and run again with another --seed for more",
        )
    if batch_size > MAX_BATCH:
        refuse(
            f"a batch of {batch_size:,} samples is above the {MAX_BATCH:,} a verifier builds from real tensors",
            f"verify at --batch-size {MAX_BATCH} or less (the analysis itself has no such limit: drop --verify)",
        )
    passes = samples * batch_size * steps * restarts
    if "rgap" in chosen and passes > MAX_PASSES:
        refuse(
            f"the inversion would run {passes:.2g} sample-gradient passes ({samples:,} --samples x batch "
            f"{batch_size:,} x {steps:,} --steps x {restarts} restarts), above the {MAX_PASSES:.0e} it runs",
            "lower --samples, --steps or --batch-size",
        )
    if sample_values is not None and batch_size * sample_values > MAX_BATCH_VALUES:
        refuse(
            f"one real batch would hold {batch_size * sample_values:.2g} input values (batch {batch_size:,} x "
            f"{sample_values:,} per sample), above the {MAX_BATCH_VALUES:.0e} a verifier allocates",
            "verify at a smaller --batch-size or --input-shape",
        )
