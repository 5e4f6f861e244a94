"""One call from a model file to a Result: load -> trace -> count -> findings."""

from __future__ import annotations

import dataclasses
import time

from rankaudit.bound.energy import ReferenceDataError
from rankaudit.bound.identifiability import round_identifiability
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
    """Which layers' gradients the client sends; None: all of them."""
    if shared_layers and withheld_layers:
        raise UsageError(
            "both --shared-layers and --withheld-layers given", "name either the shared or the withheld ones"
        )
    names = [
        traced.record(n).name
        for n in traced.order
        if traced.record(n).counting.role is Role.LAYER and traced.record(n).counting.weights
    ]
    names += [embedding.name for embedding in traced.token_embeddings]  # the token embedding's table is shared too
    # State-dict keys (`fc1.weight`, `fc1.bias`: NVFlare's ExcludeVars, say) name their layer.
    named = list(
        dict.fromkeys(layer for name in (shared_layers or withheld_layers or []) for layer in layers_under(name, names))
    )
    unknown = [name for name in named if name not in names]
    if unknown:
        raise UsageError(
            f"no parametric layer named {', '.join(unknown)} (layers: {', '.join(names)})",
            "use the layer names shown in the table, e.g. " + ",".join(names[:2]),
        )
    if shared_layers:
        return set(named)
    if withheld_layers:
        return set(names) - set(named)
    return None


def layer_of(name: str, layers: list[str]) -> str:
    """A layer name as given, or the layer a state-dict key belongs to (`fc1.weight` -> `fc1`)."""
    if name in layers:
        return name
    head, _, tail = name.rpartition(".")
    return head if head in layers and tail in ("weight", "bias") else name


def layers_under(name: str, layers: list[str]) -> list[str]:
    """The layers a name stands for: the layer itself, a state-dict key's layer, or every layer inside a submodule
    (`head` -> `head.0`: FedRep's head, kept on the client whole)."""
    single = layer_of(name, layers)
    if single in layers:
        return [single]
    return [layer for layer in layers if layer.startswith(name + ".")] or [name]


def layer_names(names: list[str] | None, traced) -> list[str] | None:
    """Layer names with state-dict keys and submodules mapped to their layers, for whoever else reads
    --shared/--withheld-layers."""
    if not names:
        return names
    layers = [traced.record(n).name for n in traced.order]
    return list(dict.fromkeys(layer for name in names for layer in layers_under(name, layers)))


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
    shared_layers, withheld_layers = layer_names(shared_layers, traced), layer_names(withheld_layers, traced)
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


def as_layers(names: list[str] | None, result) -> list[str] | None:
    """State-dict keys (`fc1.weight`) as the layer names the verifiers match (`fc1`)."""
    layers = [row.name for row in result.layers]
    return [layer_of(name, layers) for name in names] if names else names
