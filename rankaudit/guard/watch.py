"""What the guard needs, recorded during the client's own training instead of computed again after it.

``with guard.watch(net): train(net)`` hooks the readout layers of the model the client trains: at each training
step it keeps what each layer read from each sample and the gradient at the layer's output (each sample's signal
at each unit, for the step it ran). ``Guard.decide`` then reads its tables from these records when they cover
every sample it is given, and makes its own forward and backward pass otherwise. Forward passes without a
backward (evaluation) leave no signal and are not used.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from rankaudit.verify.attacks.bias import readout_layers, sample_vectors


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal's answer, from numpy's comparison where numpy has the dtype (forty times faster on a CPU batch)."""
    if a.dtype in (torch.bfloat16,) or a.dtype != b.dtype:
        return bool(torch.equal(a, b))
    return bool(np.array_equal(a.numpy(), b.numpy()))


def _key(row: torch.Tensor) -> bytes:
    """A sample's bytes, by which a step's row is found among the samples (bfloat16, which NumPy lacks, as the same
    bits read as int16)."""
    return (row.view(torch.int16) if row.dtype == torch.bfloat16 else row).numpy().tobytes()


class Watch:
    """Hooks on ``net`` while the block runs; ``tables(samples)`` afterwards."""

    def __init__(self, net: nn.Module, shared: list[str] | None = None):
        self.net = net
        names = shared if shared is not None else [name for name, p in net.named_parameters() if p.requires_grad]
        # A layer whose weight trains and whose bias does not (frozen, or left out of the optimiser) is watched too:
        # its signals pair its rows, which read the samples with no ratio.
        names = names + [name[: -len("weight")] + "bias" for name in names if name.endswith("weight")]
        self.layers = readout_layers(net, names)
        self.steps: list[dict] = []
        # Layer calls with a gradient while no step was started: the model run without its own call (net.forward(x)
        # called directly skips the hooks around it), so those steps cannot be tied to the samples.
        self.untied = 0
        self.hooks: list = []
        self.layer_hooks: dict[str, object] = {}

    def __enter__(self) -> Watch:
        self.hooks.append(self.net.register_forward_pre_hook(self._started, with_kwargs=True))
        for name, module in self.layers:
            self.layer_hooks[name] = module.register_forward_hook(
                lambda mod, args, out, name=name: self._seen(name, mod, args, out)
            )
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks + list(self.layer_hooks.values()):
            hook.remove()
        self.hooks, self.layer_hooks = [], {}

    def _started(self, module, args, kwargs=None) -> None:
        # The batch as the model takes it: its first argument, or its first keyword argument (net(x=batch)).
        given = [args[0]] if args else list((kwargs or {}).values())[:1]
        if given and isinstance(given[0], torch.Tensor):
            self.steps.append({"x": given[0].detach().clone(), "vectors": {}, "signals": {}, "calls": {}})

    def _seen(self, name, module, args, out) -> None:
        if not torch.is_grad_enabled():
            return
        if not self.steps:
            self.untied += 1
            return
        step = self.steps[-1]
        step["calls"][name] = step["calls"].get(name, 0) + 1
        # A convolution over several positions is not checkable: known from its output's shape, before unfolding.
        one_vector = args[0].dim() == 2 if isinstance(module, nn.Linear) else out.shape[2:].numel() == 1
        vectors = sample_vectors(module, args[0]) if one_vector else None
        if vectors is None:
            # Not checkable in these records once one step has shown it (tables() names it so): its hook goes, and
            # with it its cost in every later step.
            hook = self.layer_hooks.pop(name, None)
            if hook is not None:
                hook.remove()
            return
        step["vectors"][name] = vectors.detach().clone()
        if out.requires_grad:

            def keep(grad, name=name, step=step):
                step["signals"][name] = grad.detach().reshape(len(grad), -1).clone()

            out.register_hook(keep)

    def trained_samples(self) -> torch.Tensor | None:
        """Every distinct sample the recorded training steps ran on, in the order first run (an augmented copy of a
        given sample is one of them, as trained), or None when no step was recorded with its backward."""
        seen: dict[bytes, int] = {}
        rows = []
        for step in self.steps:
            if not step["signals"]:
                continue
            batch = step["x"].cpu().contiguous()
            for row in batch:
                key = _key(row)
                if key not in seen:
                    seen[key] = len(rows)
                    rows.append(row)
        return torch.stack(rows) if rows else None

    def tables(self, samples: torch.Tensor) -> tuple[dict, dict, dict] | None:
        """({layer: (N, d) vectors}, {layer: (N, units) signals}, {layer: why it is not checked}) for ``samples``
        (each sample's vectors from the first step it ran in, its signals summed over the steps), or None when the
        records do not cover every sample."""
        trained = [step for step in self.steps if step["signals"]]
        if not trained:
            return None
        samples = samples.detach().cpu().contiguous()
        index: dict[bytes, int] = {}
        why_not: dict[str, str] = {}
        # Per layer: the rows and vectors of each sample's first step, and every step's rows and signals, put
        # together once at the end (one index_add for the signals instead of one per step).
        first_rows: dict[str, list] = {}
        first_vectors: dict[str, list] = {}
        step_rows: dict[str, list] = {}
        step_signals: dict[str, list] = {}
        seen = torch.zeros(len(samples), dtype=torch.bool)
        at = 0  # where the next step's batch starts when the steps run through the samples in order
        ordered = True  # every step so far took the next samples in order (then no row needs an index)
        for step in trained:
            batch = step["x"].cpu().to(samples.dtype).contiguous()
            if at + len(batch) <= len(samples) and _equal(batch, samples[at : at + len(batch)]):
                if ordered:  # the rows as a range (a tensor only if needed at the end), all new or all seen
                    rows, fresh = range(at, at + len(batch)), len(batch) > 0 and not bool(seen[at])
                    seen[at : at + len(batch)] = True
                else:
                    rows = torch.arange(at, at + len(batch))
            else:  # shuffled, or other samples: each row found by its bytes
                ordered = False
                if not index:
                    index = _sample_index(samples)
                found = [index.get(_key(row)) for row in batch]
                if any(row is None for row in found):
                    return None  # a step on samples the guard was not given
                rows = torch.tensor(found)
            if not isinstance(rows, range):
                first = ~seen[rows]
                seen[rows] = True
            at = (rows[-1] + 1) % len(samples) if len(rows) else at
            at = int(at)
            for name, _ in self.layers:
                calls = step["calls"].get(name, 0)
                if calls > 1:
                    why_not[name] = f"called {calls} times per forward pass: its update sums the calls"
                elif name not in step["vectors"]:
                    why_not[name] = "reads several vectors per sample (positions), not one"
                elif name not in step["signals"]:
                    return None  # a step without its backward: the records do not say what the step sent
                if name in why_not:
                    continue
                if isinstance(rows, range):
                    if fresh:  # samples run in order, first seen now
                        first_rows.setdefault(name, []).append(rows)
                        first_vectors.setdefault(name, []).append(step["vectors"][name])
                else:
                    first_rows.setdefault(name, []).append(rows[first])
                    first_vectors.setdefault(name, []).append(step["vectors"][name][first])
                step_rows.setdefault(name, []).append(rows)
                step_signals.setdefault(name, []).append(step["signals"][name])
        if not bool(seen.all()):
            return None
        vectors: dict[str, torch.Tensor] = {}
        signals: dict[str, torch.Tensor] = {}
        for name in step_rows:
            if name in why_not:
                continue
            found = torch.cat(first_vectors[name])
            summed = torch.cat(step_signals[name]).to(torch.float64)
            if ordered:  # the first epoch's rows are the samples in order, and every epoch's rows too
                vectors[name] = found.to(torch.float64)
                epochs = -(-len(summed) // len(samples))
                padded = torch.zeros(epochs * len(samples), summed.shape[1], dtype=torch.float64)
                padded[: len(summed)] = summed
                signals[name] = padded.view(epochs, len(samples), -1).sum(0)
                continue
            vectors[name] = torch.zeros(len(samples), found.shape[1], dtype=torch.float64)
            vectors[name][_rows(first_rows[name])] = found.to(torch.float64)
            signals[name] = torch.zeros(len(samples), summed.shape[1], dtype=torch.float64)
            signals[name].index_add_(0, _rows(step_rows[name]), summed)
        return vectors, signals, why_not


def _sample_index(samples: torch.Tensor) -> dict[bytes, int]:
    """{a sample's bytes: its number}: how a row a step ran is found among the samples."""
    return {_key(sample): n for n, sample in enumerate(samples)}


def numbers_among(trained: torch.Tensor, samples: torch.Tensor) -> list[int] | None:
    """For each sample the training ran (trained_samples), its number among the samples given; None when one is not
    among them (an augmented copy)."""
    given = samples.detach().cpu().to(trained.dtype).contiguous()
    index = _sample_index(given)
    found = [index.get(_key(row)) for row in trained.cpu().contiguous()]
    return None if any(n is None for n in found) else found


def _rows(parts: list) -> torch.Tensor:
    """The rows of several steps (ranges of samples run in order, or tensors of rows) as one tensor."""
    return torch.cat([torch.arange(part.start, part.stop) if isinstance(part, range) else part for part in parts])
