"""Verifier records a report has no section of its own for: which ones they are, and their fields as text."""

# The table and the HTML page each keep a section per verifier they know (R-GAP's images, GDBR's counts, ...).
# A verifier registered later still shows in both: its record's plain fields, read here once for both reports.
# `Result.verification` also holds keys that are not a verifier's record ("defenses", "adadefense_training":
# the --defense runs): the registry's names tell the two apart, so no list of them is kept here.

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass

from rankaudit.verify import registry

SHORT_LIST = 8  # a list up to this long, of plain values, is shown; a longer one is left to the JSON
# Read and shown as sentences, not as fields.
SENTENCE_KEYS = ("judgement", "notes", "internal_error")


@dataclass(frozen=True)
class GenericRecord:
    """One verifier's record as a report without a section for it shows it."""

    name: str
    help: str  # the verifier's sentence in --verify's help
    judgement: str | None
    internal_error: str | None
    fields: list[tuple[str, str]]  # (key, value as text), keys sorted
    notes: list[str]
    json_only: list[str]  # the keys too large or too nested to show: "layers (list of 12)"


def without_section(verification: dict, sections: Container[str]) -> list[str]:
    """The registered verifiers' records in `verification` that no entry of `sections` renders, in filing order."""
    others = [name for name in verification if name not in sections]
    if not others:
        return []  # the registry's modules are not imported for a run with no other record
    registered = registry.verifiers()
    return [name for name in others if name in registered]


def number(value: float) -> str:
    """A measured float: 4 significant digits; a non-finite one is no figure."""
    return f"{value:.4g}" if math.isfinite(value) else "n/a"


def _plain(value) -> str | None:
    """A scalar as text; None for anything that is not one."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return number(value)
    if isinstance(value, str):
        return " ".join(value.split())  # one line in the table, whatever the record holds
    return None


def _shown(value) -> str | None:
    """A scalar or a short list of scalars as text; None for what is left to the JSON."""
    if isinstance(value, (list, tuple)):
        if len(value) > SHORT_LIST:
            return None
        items = [_plain(item) for item in value]
        if any(item is None for item in items):
            return None
        return ", ".join(items) if items else "none"
    return _plain(value)


def _left(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"list of {len(value)}"
    if isinstance(value, dict):
        return f"{len(value)} fields"
    return type(value).__name__


def _sentence(value) -> str | None:
    if value is None or value == "":
        return None
    text = _plain(value)
    return text.rstrip(".") if text is not None else None


def read(name: str, record) -> GenericRecord:
    """`record` (what verifier `name` filed) split into its sentences, its plain fields and what only the JSON holds."""
    verifier = registry.verifiers().get(name)
    help_ = verifier.help.strip() if verifier is not None else ""
    if not isinstance(record, dict):
        shown = _shown(record)
        fields = [("record", shown)] if shown is not None else []
        return GenericRecord(name, help_, None, None, fields, [], [] if fields else [f"record ({_left(record)})"])
    fields, json_only = [], []
    for key in sorted(record, key=str):
        if key in SENTENCE_KEYS:
            continue
        shown = _shown(record[key])
        if shown is None:
            json_only.append(f"{key} ({_left(record[key])})")
        else:
            fields.append((str(key), shown))
    notes = record.get("notes")
    notes = [notes] if isinstance(notes, str) else notes if isinstance(notes, (list, tuple)) else []
    return GenericRecord(
        name=name,
        help=help_,
        judgement=_sentence(record.get("judgement")),
        internal_error=_sentence(record.get("internal_error")),
        fields=fields,
        notes=[text for text in (_sentence(note) for note in notes) if text],
        json_only=json_only,
    )
