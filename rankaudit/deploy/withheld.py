"""Which layers never leave the client: NVFlare's ExcludeVars, a client whose get_parameters leaves layers out
(FedBN) or sends one submodule alone (FedPer, FedRep), as withheld layers with their source, or a note where
rankaudit cannot take them out."""

from __future__ import annotations

from pathlib import Path

from rankaudit.deploy import model_code, nvflare


def withheld_layers(directory: Path, mechanisms, settings, sources, model: str) -> list[str] | None:
    """NVFlare's ExcludeVars (a config filter or a call in the code): the listed variables never leave the client;
    a client whose get_parameters leaves out the state-dict keys holding a word (FedBN's "bn"): the model's layers
    named so stay local."""
    if settings.withheld_layers is not None or settings.shared_layers is not None:
        return None
    local: list[str] = []
    for mechanism in (m for m in mechanisms if m.kind == "local-layers"):
        words = mechanism.arguments["words"].value
        shown = " or ".join(repr(word) for word in words)
        if mechanism.condition is not None:
            sources.notes.append(
                f"{mechanism.name} at {mechanism.source} keeps the layers whose names hold {shown} on the client, "
                f"but {mechanism.condition}: every layer is judged as sent; name the local layers in withheld-layers "
                "of [tool.rankaudit] for the run with it"
            )
            continue
        built = model_code.attribute_layers(model, words)
        if not built:
            sources.notes.append(
                f"{mechanism.name} at {mechanism.source} keeps the layers whose names hold {shown} on the client; "
                "none is a layer of the model's own class rankaudit can name: every layer is judged as sent; name "
                "them in withheld-layers of [tool.rankaudit]"
            )
            continue
        layers = [name for name, _ in built]
        norms = [name for name, made_by in built if made_by in _NORMALISATIONS]
        if norms:
            # A normalisation's scale and shift are gradients the server would read beside the layers' (FedBN keeps
            # them, and the running statistics, local): left out of what is sent, as the app does.
            sources.notes.append(
                f"{mechanism.name} at {mechanism.source} keeps the normalisation layers {', '.join(norms)} on the "
                "client (FedBN): their scale and shift are left out of what is judged as sent"
            )
        local += [layer for layer in layers if layer not in local]
        sources.add(
            "withheld-layers", ",".join(layers), f"{mechanism.source} ({mechanism.name} sends no key holding {shown})"
        )
    for mechanism in (m for m in mechanisms if m.kind == "sent-part"):
        local += [layer for layer in _kept_beside(mechanism, model, sources) if layer not in local]
    found = nvflare.excluded_variables(directory) + [
        m.arguments["exclude_vars"] for m in mechanisms if m.kind == "exclude-vars" and m.arguments.get("exclude_vars")
    ]
    names: list[str] = []
    for item in found:
        if isinstance(item.value, str):
            sources.notes.append(
                f"ExcludeVars in {item.source} is a regular expression ({item.value!r}); "
                "name the withheld layers in withheld-layers of [tool.rankaudit]"
            )
            continue
        names += [name for name in item.value if name not in names]
        sources.add("withheld-layers", ",".join(item.value), item.source)
    names += [name for name in local if name not in names]
    return names or None


def _kept_beside(mechanism, model: str, sources) -> list[str]:
    """A client that sends one submodule of the model (FedPer's and FedRep's `model.body.state_dict()`): the
    model's other layers stay on the client, withheld, with a note; where the choice of client or the submodule
    is not read, every layer is judged as sent and the note says so."""
    part = mechanism.arguments["part"].value
    where = f"{mechanism.name} at {mechanism.source} sends the model's {part} alone"
    if mechanism.condition is not None:
        sources.notes.append(
            f"{where}, but {mechanism.condition}: every layer is judged as sent; name the local layers in "
            "withheld-layers of [tool.rankaudit] for the run with it"
        )
        return []
    built = model_code.attribute_layers(model, [""])
    if part not in [name for name, _ in built]:
        sources.notes.append(
            f"{where}; {part} is not a layer of the model's own class rankaudit can name: every layer is judged as "
            "sent; name the layers that stay on the client in withheld-layers of [tool.rankaudit]"
        )
        return []
    kept = [name for name, _ in built if name != part]
    if kept:
        sources.add("withheld-layers", ",".join(kept), f"{mechanism.source} ({mechanism.name} sends {part} alone)")
        sources.notes.append(
            f"{where}: {', '.join(kept)} {'stays' if len(kept) == 1 else 'stay'} on the client (personal layers, as "
            f"in FedPer and FedRep) and {'is' if len(kept) == 1 else 'are'} left out of what is judged as sent"
        )
    return kept


# Layers built with these are normalisations: parameters used directly by the op, not a layer's weights.
_NORMALISATIONS = frozenset(
    {
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
        "LayerNorm",
    }
)
