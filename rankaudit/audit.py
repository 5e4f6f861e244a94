"""One call from a model file to a Result: load -> trace -> count -> findings."""

from __future__ import annotations

import dataclasses
import time

from rankaudit.bound.energy import ReferenceDataError
from rankaudit.bound.identifiability import GradientSource, covers, round_identifiability, shared_predicate
from rankaudit.count.analysis import analyze
from rankaudit.count.calls import trace_and_count
from rankaudit.count.op_counting import Role
from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.findings import apply as findings
from rankaudit.findings import leakage, policy
from rankaudit.model import supervise, worker
from rankaudit.model.load import load_model
from rankaudit.result import Result
from rankaudit.settings import levels
from rankaudit.settings.round import Round, validate_round


def _shared_set(traced, shared_layers, withheld_layers) -> set[str] | None:
    """Which layers with weights (and token embeddings) send a gradient; None: all of them. A name may be a layer,
    a normalisation, any module above parameters or one parameter (a state-dict key such as `fc1.weight`); a layer
    counts as withheld only when every parameter it reads is (shared_predicate)."""
    if shared_layers and withheld_layers:
        raise UsageError(
            "both --shared-layers and --withheld-layers given", "name either the shared or the withheld ones"
        )
    given = shared_layers or withheld_layers
    if not given:
        return None
    layers = {
        traced.record(n).name: [name for name, _ in traced.record(n).direct_params]
        for n in traced.order
        if traced.record(n).counting.role is Role.LAYER and traced.record(n).counting.weights
    }
    # The token embedding's table is a gradient too.
    layers.update({embedding.name: [embedding.weight] for embedding in traced.token_embeddings})
    parameters = model_parameters(traced)
    # A module without parameters (an affine-free norm, an activation) is a name of the model too, and so is a
    # buffer's state-dict key (`bn1.running_mean`, listed by an ExcludeVars): a running statistic named so is kept
    # back (the bound counts those a BatchNorm in training mode sends), a module sends no gradient of its own.
    modules = [traced.record(n).name.split("#")[0] for n in traced.order]
    unknown = [
        name
        for name in given
        if not any(covers(known, [name]) for known in parameters + modules) and name.rpartition(".")[0] not in modules
    ]
    if unknown:
        norms = [traced.record(n).name for n in traced.order if traced.record(n).family == "norm"]
        shown = list(layers) + [norm for norm in norms if norm not in layers]
        raise UsageError(
            f"no layer, module or parameter named {', '.join(unknown)} (layers: {', '.join(shown)})",
            "use the layer names shown in the table or the model's parameter names, e.g. "
            + ",".join((shown or parameters)[:2]),
        )
    is_sent = shared_predicate(shared_layers, withheld_layers)
    return {
        layer
        for layer, names in layers.items()
        if is_sent(GradientSource(layer.split("#")[0], 0, layer, True, tuple(names)))
    }


def model_parameters(traced) -> list[str]:
    """The qualified names of the parameters the traced calls read (trainable or frozen), and the token tables."""
    found = [name for n in traced.order for name, _ in traced.record(n).direct_params]
    found += [embedding.weight for embedding in traced.token_embeddings]
    return list(dict.fromkeys(found))


def load_and_trace(spec: str, input_shape, *, input_dtype=None, model_args: dict | None = None):
    """The model's code, in its worker: import, build and trace on meta, each in its phase. Hands back what the
    analysis reads, and nothing of the model's own (no module, no parameter, no call's arguments)."""
    loaded = load_model(spec, input_shape, device="meta", input_dtype=input_dtype, model_args=model_args)
    with supervise.phase(f"the trace of {spec}'s forward()"):
        traced = trace_and_count(
            loaded.module, loaded.input_shape, input_dtype=loaded.input_dtype, forward_kwargs=loaded.forward_kwargs
        )
    for node_id in traced.order:
        traced.record(node_id).facts = None
    for record in traced.records.values():
        record.facts = None
    return dataclasses.replace(loaded, module=None, forward_kwargs={}), traced


def audit(
    spec: str,
    *,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int = 1,
    fail_on: str = levels.DEFAULT_FAIL_ON,
    min_ra: int | None = None,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    max_recoverable: float | None = None,
    exposed_below: float | None = None,
    certificate_quantile: float | None = None,
    data: str | None = None,
    input_dtype=None,
    round_: Round | None = None,
    model_args: dict | None = None,
) -> Result:
    """Analyse the model named by `spec` (PATH or PATH:NAME) on the meta device.

    `data` (--data): the user's own samples as the energy certificate's reference distribution (method.md: energy);
    `exposed_below`: the hidden share under which a sample is `exposed`; `certificate_quantile`: the share of samples
    the certificate speaks for (default 0.9).
    `round_`: the federated round the client runs (method.md: the round); its batch size is the analysis batch size, and its
    `dp` settings (round.DPSettings) add the DP section and its policy rule (method.md: DP). None: FedSGD, one gradient
    of a batch of `batch_size`, no DP.
    """
    if round_ is not None:
        batch_size = validate_round(round_).batch_size
    if batch_size < 1:
        raise UsageError(f"batch size {batch_size} is not positive", "give --batch-size 1 or more")
    if fail_on not in levels.FAIL_ON_CHOICES:
        raise UsageError(f"unknown fail-on level '{fail_on}'", "use one of " + ", ".join(levels.FAIL_ON_CHOICES))
    started = time.perf_counter()
    loaded, traced = worker.run(
        load_and_trace, spec, input_shape, input_dtype=input_dtype, model_args=model_args, limited=True
    )
    result = analyze(traced, batch_size, model=spec, model_name=loaded.name, input_shape=traced.inputs[0].shape)
    findings.describe_inputs(result, traced, loaded)
    result.stand_ins = list(loaded.stand_ins)
    result.model_args = dict(model_args or {})
    if not result.layers:
        raise ModelLoadError(
            f"found no layer to count in {spec} (no conv, linear, pooling or similar op depends on the input)",
            "check that forward() uses the input tensor",
        )
    if max_recoverable is not None and not 0 <= max_recoverable <= 1:
        raise UsageError(
            f"--max-recoverable {max_recoverable:g} is not a fraction",
            "give a number between 0 and 1, e.g. --max-recoverable 0.5",
        )
    shared = _shared_set(traced, shared_layers, withheld_layers)
    result.round = round_ if round_ is not None else Round(batch_size=batch_size)
    result.identifiability = round_identifiability(
        traced,
        result.round,
        shared_layers=shared_layers,
        withheld_layers=withheld_layers,
        max_recoverable=max_recoverable,
    )
    result.token_leakage = leakage.token_leakage(traced, batch_size, shared)
    try:
        findings.apply_findings(
            result,
            traced,
            fail_on=fail_on,
            min_ra=min_ra,
            shared_layers=shared,
            max_recoverable=max_recoverable,
            data=data,
            exposed_below=exposed_below,
            certificate_quantile=certificate_quantile,
        )
    except ReferenceDataError as exc:
        raise UsageError(str(exc), "give a readable --data, or leave it out to use the shipped reference") from exc
    if result.round.dp is not None:
        policy.apply_dp(result, result.round.dp)
    result.seconds = time.perf_counter() - started
    return result
