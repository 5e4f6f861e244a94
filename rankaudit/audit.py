"""One call from a model file to a Result: load -> trace -> count -> findings."""
from __future__ import annotations

import time

from rankaudit import findings
from rankaudit.analysis import analyze
from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.load import load_model
from rankaudit.result import Result
from rankaudit.trace import trace_model


def audit(spec: str, *, input_shape: tuple[int, ...] | None = None, batch_size: int = 1,
          fail_on: str = "exposed", min_ra: int | None = None) -> Result:
    """Analyse the model named by `spec` (PATH or PATH:NAME) on the meta device."""
    if batch_size < 1:
        raise UsageError(f"batch size {batch_size} is not positive", "give --batch-size 1 or more")
    if fail_on not in findings.FAIL_ON_CHOICES:
        raise UsageError(f"unknown fail-on level '{fail_on}'", "use one of " + ", ".join(findings.FAIL_ON_CHOICES))
    started = time.perf_counter()
    loaded = load_model(spec, input_shape, device="meta")
    traced = trace_model(loaded.module, loaded.input_shape)
    result = analyze(traced, batch_size, model=spec, model_name=loaded.name, input_shape=loaded.input_shape)
    if not result.layers:
        raise ModelLoadError(f"found no layer to count in {spec} (no conv, linear, pooling or similar op "
                             "depends on the input)", "check that forward() uses the input tensor")
    non_injective = [traced.record(n).name for n in traced.order if traced.record(n).counting.non_injective]
    findings.apply_findings(result, non_injective_ops=non_injective, fallback_reason=traced.fallback_reason,
                            fail_on=fail_on, min_ra=min_ra)
    result.seconds = time.perf_counter() - started
    return result
