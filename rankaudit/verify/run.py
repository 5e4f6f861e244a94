"""Running the verifiers asked for on one model: their refusals, their order, each record filed, the defended runs."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rankaudit import install_hint
from rankaudit.errors import UsageError
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext, check_budget, defendable, get, runs_apart

if TYPE_CHECKING:
    from rankaudit.result import Result


def _require_extras(modules: tuple[str, ...]) -> None:
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"--verify needs the verifier's extras ({exc.name} is missing)", install_hint("verify")
        ) from exc


def _file(context: VerifyContext, verifier: Verifier, report_error: Callable[[str], None]) -> dict:
    """Run one verifier, file its record under its name, say an internal error on stderr (never hidden by -q)."""
    record = verifier.run(context)
    context.result.verification[verifier.name] = record
    if isinstance(record, dict) and record.get("internal_error"):
        report_error(f"{context.spec}: {record['internal_error']}")
    return record


def _in_order(chosen: list[Verifier]) -> list[Verifier]:
    unique = {verifier.name: verifier for verifier in chosen}
    return sorted(unique.values(), key=lambda verifier: verifier.order)


def _check_real_model_memory(requested, context: VerifyContext, sample_values: int) -> None:
    """Refuse, before the model is built with real weights, a verifier whose model alone does not fit the memory
    limit: its parameters in float64, the trainable ones' gradient and its derivative, and one batch of inputs with
    its gradient. Building it first took minutes and the whole limit before failing."""
    from rankaudit.model import supervise

    limit = supervise.memory_limit()
    chosen = [name for name in requested if not runs_apart(get(name))]
    if limit <= 0 or not chosen:
        return
    parameters = context.result.parameters
    trainable = sum(row.own_weights for row in context.result.layers)  # frozen ones get no gradient
    needed = 8 * (parameters + 2 * min(trainable, parameters) + 2 * context.result.batch_size * sample_values)
    if needed > limit * 2**30:
        raise UsageError(
            f"--verify {', '.join(chosen)} builds the model with real weights: its {parameters:,} parameters in "
            f"float64 with their gradients and one batch of {sample_values:,} input values take at least "
            f"{needed / 2**30:.1f} GiB, more than the memory limit of {supervise.describe_memory_limit()}",
            "raise --memory-limit if the machine has the memory, or verify a smaller model (the analysis itself "
            "needs no weights: drop --verify)",
        )


def run_verifiers(requested, context: VerifyContext, report_error: Callable[[str], None]) -> None:
    """Run the requested verifiers on one model: the refusals their needs call for, then each in its order, every
    one at the --weights given (rankaudit.verify.model.deployed_weights) and built with the model arguments the
    analysis used (model_arguments)."""
    from rankaudit.verify.model import deployed_weights, model_arguments, read_state_dict

    if context.weights is not None:
        read_state_dict(context.weights)  # a missing or unreadable file is refused before any verifier runs
    with deployed_weights(context.weights), model_arguments(context.result.model_args):
        _run_verifiers(requested, context, report_error)


def _run_verifiers(requested, context: VerifyContext, report_error: Callable[[str], None]) -> None:
    import math

    from rankaudit.model import supervise

    shape = context.result.input_shape
    shapes = shape.values() if isinstance(shape, dict) else [shape]
    check_budget(
        requested,
        steps=context.steps,
        samples=context.samples,
        trials=context.trials,
        batch_size=context.result.batch_size,
        restarts=context.restarts,
        sample_values=sum(math.prod(one) for one in shapes),
    )
    _check_real_model_memory(requested, context, sum(math.prod(one) for one in shapes))
    chosen = [get(name) for name in requested]
    for verifier in _in_order([verifier for verifier in chosen if runs_apart(verifier)]):
        _file(context, verifier, report_error)
    group = [verifier for verifier in chosen if not runs_apart(verifier)]
    if not group:
        return
    supervise.enter(f"--verify {', '.join(verifier.name for verifier in group)} of {context.spec}")
    if context.in_round:
        single = [verifier.name for verifier in group if Need.ROUND not in verifier.needs]
        if single or context.defense_specs:
            from rankaudit.settings.levels import count

            round_ = context.result.round
            what = f"--verify {single[0]}" if single else "--defense"
            raise UsageError(
                f"{what} reads one shared gradient, and this round sends the update of "
                f"{count(round_.steps, 'local step')} from {count(round_.clients, 'client')}",
                "verify this round with --verify rank or --verify rgap (the FedAvg inversion), or drop the round's "
                "flags to check one gradient",
            )
        if any(Need.IMAGES in verifier.needs for verifier in group):
            _require_extras(("PIL", "scipy"))  # the round's attack matches reconstructions to originals
    else:
        if context.defense_specs and not [verifier for verifier in group if verifier.defended is not None]:
            raise UsageError(
                "--defense applies to the "
                + " and ".join(defendable())
                + " attacks; --verify rank measures the undefended gradient",
                "add " + " and/or ".join(f"--verify {name}" for name in defendable()) + ", or drop --defense",
            )
        # Token batches need neither images nor Pillow: they run before the image verifiers' extras are checked.
        for verifier in _in_order([verifier for verifier in group if Need.TOKENS in verifier.needs]):
            _file(context, verifier, report_error)
        group = [verifier for verifier in group if Need.TOKENS not in verifier.needs]
        if not group:
            return
        if any(Need.IMAGES in verifier.needs for verifier in group):
            _require_extras(("PIL",))
        if context.artifacts and context.several:
            context = dataclasses.replace(
                context, artifacts=str(Path(context.artifacts) / Path(context.spec.rsplit(":", 1)[0]).stem)
            )
        if context.defense_specs:
            from rankaudit.verify.defenses import parse_defense

            # A bad spec is a UsageError: exit 2.
            context = dataclasses.replace(context, defenses=tuple(parse_defense(s) for s in context.defense_specs))
    for verifier in group:
        if verifier.preflight is not None:
            verifier.preflight(context)
    first = [get(name) for verifier in group for name in verifier.runs_first(context)]
    # Each attack runs once undefended; its defended runs reuse the same model, images and batches.
    for verifier in _in_order(first + group):
        _file(context, verifier, report_error)
    if context.defenses:
        verify_training_cost(
            context.result, list(context.defenses), seed=context.seed, show_progress=context.show_progress
        )


def verify_defenses(
    result: Result,
    spec: str,
    defenses: list,
    *,
    attacks=("rgap",),
    samples: int = 4,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    steps: int = 1000,
    restarts: int = 2,
    trials: int = 5,
    class_dist: str = "random",
    aux: str | None = None,
    optimisation: bool = False,
    training: bool = True,
    training_rounds: int | None = None,
    training_clients: int | None = None,
    show_progress: bool = True,
) -> dict:
    """Run each requested attack without and with every defense; fill result.verification['defenses'].

    ``defenses``: :class:`rankaudit.verify.defenses.Defense` objects (``parse_defense("noise:0.01")``).
    ``attacks``: the attacks the user asked for, any verifiers the registry lists as defended (``"rgap"`` and/or
    ``"gdbr"``); the other arguments are the attacks' settings (``defense_runs.AttackSettings``: ``samples``,
    ``data``, ``steps``, ``restarts`` for R-GAP, ``trials``, ``class_dist``, ``aux`` for GDBR), so call this with the
    same values to attack the same images and batches: the baseline ("without") is re-run here on them, the defended
    runs see only the defended gradient.
    ``optimisation``: where R-GAP runs, also attack every defense with inverting gradients (``steps`` x
    ``restarts``; slow on a CPU, about 10 s per image and restart for CNN6). R-GAP is exact algebra and breaks
    under any perturbation, so its failure alone overstates a defense; the optimisation attack degrades gracefully.

    Sets ``result.verification["defenses"]``: one row per (defense, attack) with ``defense``, ``param``, ``spec``,
    ``label``, ``attack`` ("rgap" | "inverting-gradients" | "gdbr"), ``metric`` ("median_mse" | "ins_acc"),
    ``without``, ``with``, ``degrades`` (MSE at least doubled and above 1e-3; InsAcc down by at least
    max(0.05, 1/B)), ``fails_without``/``fails_with`` (MSE > 1e-2; InsAcc no better than guessing equal counts,
    ``chance``), PSNR or ClsAcc both ways, per-sample/per-trial figures, ``notes`` (about this defense) and
    ``attack_notes`` (about the attack, the same in every row of that attack). When AdaDefense is among the
    defenses and ``training`` is true, also ``result.verification["adadefense_training"]`` = {``rounds``,
    ``clients``, ``accuracy_without``, ``accuracy_with``, ...}: FedAvg on scikit-learn digits with and without
    the stand-in (:func:`rankaudit.verify.defenses.fedavg_accuracy`, about 4 s each). Returns both as a dict.
    """
    defended = defendable()
    unknown = [a for a in attacks if a not in defended]
    if unknown:
        raise UsageError(
            f"cannot attack defenses with {', '.join(map(str, unknown))}", "use " + " and/or ".join(defended)
        )
    defenses = list(defenses)
    out: dict = {}
    if not defenses:
        return out
    context = VerifyContext(
        result,
        spec,
        seed=seed,
        device=device,
        samples=samples,
        data=data,
        steps=steps,
        restarts=restarts,
        trials=trials,
        class_dist=class_dist,
        aux=aux,
        show_progress=show_progress,
        requested=tuple(attacks),
    )
    rows: list[dict] = []
    for name in defended:  # in the registry's order, whatever the order asked
        if name in attacks:
            rows += get(name).defended(context, defenses, optimisation=optimisation)
    result.verification["defenses"] = rows
    out["defenses"] = rows
    if training:
        training_row = verify_training_cost(
            result, defenses, seed=seed, rounds=training_rounds, clients=training_clients, show_progress=show_progress
        )
        if training_row is not None:
            out["adadefense_training"] = training_row
    return out


def verify_training_cost(
    result: Result,
    defenses: list,
    *,
    seed: int = 0,
    rounds: int | None = None,
    clients: int | None = None,
    show_progress: bool = True,
) -> dict | None:
    """When AdaDefense is among `defenses`: FedAvg with and without its stand-in, in
    result.verification['adadefense_training']; None otherwise."""
    from rankaudit.verify import defenses as defense_lib

    ada = next((d for d in defenses if d.name == "adadefense"), None)
    if ada is not None:
        kwargs = {
            "rounds": rounds or defense_lib.FEDAVG_ROUNDS,
            "clients": clients or defense_lib.FEDAVG_CLIENTS,
            "seed": seed,
        }
        with ProgressBar(2, "FedAvg with and without AdaDefense", enabled=show_progress) as bar:
            plain = defense_lib.fedavg_accuracy(None, **kwargs)
            bar.update()
            defended = defense_lib.fedavg_accuracy(ada, **kwargs)
            bar.update()
        training_row = {
            "rounds": plain["rounds"],
            "clients": plain["clients"],
            "local_steps": plain["local_steps"],
            "local_lr": plain["local_lr"],
            "batch_size": plain["batch_size"],
            "accuracy_without": plain["accuracy"],
            "accuracy_with": defended["accuracy"],
            "accuracy_cost": plain["accuracy"] - defended["accuracy"],
            "server_lr_without": plain["server_lr"],
            "server_lr_with": defended["server_lr"],
            "defense": ada.spec,
            "model": plain["model"],
            "data": plain["data"],
            "seed": seed,
            "train_accuracy_without": plain["train_accuracy"],
            "train_accuracy_with": defended["train_accuracy"],
            "seconds": round(plain["seconds"] + defended["seconds"], 3),
        }
        result.verification["adadefense_training"] = training_row
        return training_row
    return None
