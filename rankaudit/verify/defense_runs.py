"""--defense: each defendable verifier's runs without and with every defense, and AdaDefense's cost in training."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rankaudit.errors import UsageError
from rankaudit.verify.progress import ProgressBar

if TYPE_CHECKING:
    from rankaudit.result import Result

# An input attack is degraded when its median MSE at least doubles and leaves the near-perfect zone; it fails when
# the MSE passes the threshold the verifier reads as a poor reconstruction.
DEGRADED_MSE_FACTOR = 2.0
# A label attack is degraded when it loses at least this share of the batch's labels (and at least one label).
DEGRADED_INS_ACC_DROP = 0.05
WARMUP_SEED_OFFSET = 104_729


def rms(tensors) -> float:
    tensors = list(tensors)
    total = sum(float(t.double().pow(2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return math.sqrt(total / count) if count else 0.0


def strength_note(defense, rms: float, what: str) -> str | None:
    """Puts σ in the gradient's own units: absolute noise means nothing without the scale it is added to."""
    if defense.name != "noise" or rms <= 0:
        return None
    return f"σ = {defense.param:g} is {defense.param / rms:.3g}× the RMS of {what} ({rms:.3g})"


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
    ``"gdbr"``); the other arguments mean what they mean for ``rgap_check.verify_inputs`` (``samples``, ``data``,
    ``steps``, ``restarts``) and ``gdbr_check.verify_labels`` (``trials``, ``class_dist``, ``aux``), so call this with the same values to attack the same images and
    batches: the baseline ("without") is re-run here on them, the defended runs see only the defended gradient.
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
    from rankaudit.verify import registry
    from rankaudit.verify.registry import VerifyContext

    defendable = registry.defendable()
    unknown = [a for a in attacks if a not in defendable]
    if unknown:
        raise UsageError(
            f"cannot attack defenses with {', '.join(map(str, unknown))}", "use " + " and/or ".join(defendable)
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
    for name in defendable:  # in the registry's order, whatever the order asked
        if name in attacks:
            rows += registry.get(name).defended(context, defenses, optimisation=optimisation)
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
