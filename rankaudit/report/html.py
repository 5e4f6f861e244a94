"""Result -> one self-contained HTML page: inline CSS, inline SVG, images as data: URIs, no URL of any kind.

`render(results)` returns the document; several models become several sections with an index at the top. The page
reads the Result only (verification images are read from the paths the verifier recorded, and a missing one is
said so on the page). Layout and styles live in templates/report.html.j2 and templates/report.css; the drawings
in rankaudit/report/svg.py.
"""

from __future__ import annotations

import base64
import functools
import math
from importlib.resources import files
from pathlib import Path

import jinja2
from markupsafe import Markup

from rankaudit import __version__
from rankaudit.findings.meaning import energy_sentence
from rankaudit.findings.next_step import next_step
from rankaudit.report import bound_bar, records, svg
from rankaudit.report.fisher_chart import fisher_chart
from rankaudit.result import Result
from rankaudit.settings.levels import percent

RANK_KEYS = ("name", "unknowns", "rank", "local_deficit", "residual", "condition")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_BYTES = 8 * 1024 * 1024  # a verifier sample is a few KB; anything huge is not one of ours

# Where no energy certificate is computed (token ids, no reference distribution), the level reads directions.
HEADLINES = {
    "exposed": "Nothing in the architecture stops one shared gradient from determining this input.",
    "partial": "A deficit is certified, but one shared gradient still sees more of this input than the ceiling allows: "
    "not protection.",
    "protected": "At least the required share of this input's directions is invisible to one shared gradient.",
}

BLOCKED_BECAUSE = {
    "positions": "applies its weights at several positions, so the gradient at the layer's output cannot be read off",
    "shared-weights": "a later layer shares its weights over positions",
    "widens": "a later layer widens the features, so the bridge's matrix is singular",
    "activation": "an activation other than ReLU or LeakyReLU lies on the way to the logits",
    "branch": "a branch or merge lies on the way to the logits",
}


def _template_source(name: str):
    text = files("rankaudit.templates").joinpath(name).read_text(encoding="utf-8")
    return text, None, lambda: False


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_template_source),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["num"] = svg.fmt_int
    env.filters["real"] = fmt_real
    env.filters["percent"] = percent  # levels.percent: the share as every report writes it
    return env


def fmt_real(value, digits: int = 4) -> str:
    """A measured float: 4 significant digits, 'n/a' for a missing one, ∞ for a perfect PSNR."""
    if value is None or isinstance(value, bool):
        return "n/a"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return "n/a"
    if math.isinf(number):
        return "∞" if number > 0 else "−∞"
    return f"{number:.{digits}g}"


def _fraction(value) -> str:
    """An accuracy: as a percentage when it is a fraction of 1."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "n/a"
    return f"{number:.1%}" if 0 <= number <= 1 else fmt_real(number)


def _image(path, base_dir: Path | None) -> dict:
    """A verifier image as a data: URI, or why there is none."""
    if not path:
        return {"src": None, "path": None, "problem": "not saved by the verifier"}
    file = Path(path)
    if not file.is_absolute() and base_dir is not None:
        file = base_dir / file
    try:
        if file.stat().st_size > MAX_IMAGE_BYTES:
            return {"src": None, "path": str(path), "problem": "file too large to embed"}
        data = file.read_bytes()
    except OSError as exc:
        reason = "file not found" if isinstance(exc, FileNotFoundError) else (exc.strerror or "cannot be read")
        return {"src": None, "path": str(path), "problem": reason}
    if not data.startswith(PNG_SIGNATURE):
        return {"src": None, "path": str(path), "problem": "not a PNG file"}
    return {
        "src": "data:image/png;base64," + base64.b64encode(data).decode("ascii"),
        "path": str(path),
        "problem": None,
    }


def _sentence(text) -> str:
    text = str(text or "").strip()
    return text[:1].upper() + text[1:] if text else ""


def _rgap(data: dict, base_dir: Path | None) -> dict:
    samples = []
    for position, sample in enumerate(data.get("samples") or []):
        samples.append(
            {
                "index": sample.get("index", position),
                "mse": sample.get("mse"),
                "psnr": sample.get("psnr"),
                "seconds": sample.get("seconds"),
                "ssim": sample.get("ssim"),
                "grey_psnr": sample.get("grey_psnr"),
                "mean_colour_psnr": sample.get("mean_colour_psnr"),
                "recovered": sample.get("recovered"),
                "original": _image(sample.get("original_png"), base_dir),
                "reconstruction": _image(sample.get("reconstruction_png"), base_dir),
            }
        )
    attack = data.get("attack") or "rgap"
    return {
        "attack": {
            "rgap": "R-GAP (closed-form recursive attack)",
            "inverting-gradients": "Inverting Gradients (optimisation attack)",
            "fedavg-inversion": "FedAvg inversion (optimisation attack on the round's update)",
        }.get(attack, attack),
        "device": data.get("device"),
        "median_mse": data.get("median_mse"),
        "median_psnr": data.get("median_psnr"),
        "seconds": data.get("seconds"),
        "confirms": data.get("confirms"),
        "note": _sentence(data.get("note")),
        "samples": samples,
        "layers": [
            {key: layer.get(key) for key in RANK_KEYS} for layer in data.get("layers") or [] if isinstance(layer, dict)
        ],
        # The baselines beside the PSNR, the outcome they give and the best image.
        "grey_psnr_median": data.get("grey_psnr_median"),
        "mean_colour_psnr_median": data.get("mean_colour_psnr_median"),
        "outcome": data.get("outcome"),
        "recovered_samples": data.get("recovered_samples"),
        "best": data.get("best") if isinstance(data.get("best"), dict) else None,
    }


def _gdbr(data: dict, prefix: str) -> dict:
    recovered, true = data.get("recovered") or {}, data.get("true") or {}
    return {
        "shared_layer": data.get("shared_layer"),
        "batch_size": data.get("batch_size"),
        "ins_acc": _fraction(data.get("ins_acc")),
        "cls_acc": _fraction(data.get("cls_acc")),
        "trials": data.get("trials"),
        "seconds": data.get("seconds"),
        "classes": sorted({str(k) for k in recovered} | {str(k) for k in true}, key=svg._class_key),
        "recovered": {str(k): v for k, v in recovered.items()},
        "true": {str(k): v for k, v in true.items()},
        "svg": Markup(svg.label_counts(recovered, true, prefix=prefix)),
    }


def _embedded(png: bytes | None) -> str | None:
    """PNG bytes a verifier kept in the Result as a data: URI (None when it made none for this input)."""
    if not png or not png.startswith(PNG_SIGNATURE) or len(png) > MAX_IMAGE_BYTES:
        return None
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _visible_parts(data: dict, images: dict[str, bytes]) -> list[dict]:
    """method.md: verdicts: each checked input beside its visible part (what the gradient shows to first order)."""
    shown = []
    for sample in data.get("samples") or []:
        for entry in (sample.get("inputs") or []) if isinstance(sample, dict) else []:
            index = entry.get("index")
            hidden, psnr, ssim = entry.get("hidden_energy"), entry.get("visible_psnr"), entry.get("visible_ssim")
            shown.append(
                {
                    "index": index,
                    "original": _embedded(images.get(f"rank/original_{index}")),
                    "visible": _embedded(images.get(f"rank/visible_{index}")),
                    "hidden": "n/a" if hidden is None else percent(hidden),
                    "psnr": "∞" if psnr is None else f"{psnr:.1f}",
                    "ssim": None if ssim is None else f"{ssim:.3f}",
                    "npy": entry.get("visible_npy"),
                }
            )
    return shown


def _worst_first(data: dict, shown: list[dict]) -> list[dict]:
    """The visible parts in the rank check's worst-first order (least hidden first), where it gives one."""
    order = [e.get("index") for e in data.get("worst_first") or [] if isinstance(e, dict)]
    place = {index: position for position, index in enumerate(order)}
    return sorted(shown, key=lambda v: place.get(v["index"], len(place)))


def _rank(data: dict, base_dir: Path | None, images: dict[str, bytes] | None = None) -> dict:
    """--verify rank: the measured rank beside the verdict, what the gradient shows of each input, and the input
    directions it cannot see."""
    directions = [
        {
            "index": d.get("index", i),
            "singular_value": d.get("singular_value"),
            "image": _image(d.get("png"), base_dir) if d.get("png") else None,
            "npy": d.get("npy"),
        }
        for i, d in enumerate(data.get("directions") or [])
        if isinstance(d, dict)
    ]
    hidden_at_most = data.get("hidden_share_at_most")
    return {
        "exact": data.get("exact", True),  # False: the matrix-free check stopped early and measured bounds
        "rank_at_least": data.get("rank_at_least"),
        "hidden_at_most": None if hidden_at_most is None else percent(hidden_at_most),
        "stopped_because": data.get("stopped_because"),
        "rank": data.get("rank"),
        "unknowns": data.get("unknowns"),
        "deficit": data.get("deficit"),
        "gap": data.get("gap"),
        "reliable": data.get("reliable"),
        "tolerance": data.get("tolerance"),
        "seconds": data.get("seconds"),
        "device": data.get("device"),
        "confirms": data.get("confirms"),
        "judgement": _sentence(data.get("judgement")),
        "internal_error": _sentence(data.get("internal_error")),
        "samples": [s for s in data.get("samples") or [] if isinstance(s, dict)],
        "directions": directions,
        "batch_size": data.get("batch_size"),
        "visible_parts": _worst_first(data, _visible_parts(data, images or {})),
        "hidden_median": None if data.get("hidden_energy_median") is None else percent(data["hidden_energy_median"]),
        "psnr_median": data.get("visible_psnr_median"),
        "reading": data.get("visible_reading"),
        "worst": _worst(data),
        "energy": _energy(data.get("energy")),
    }


def _energy(energy) -> dict | None:
    """method.md: energy, measured: the worst sample at the weights used, on the energy levels, beside the certificate."""
    if not isinstance(energy, dict) or not energy.get("line"):
        return None
    certified, expected, stderr = (
        energy.get("certified_hidden_energy"),
        energy.get("expected_hidden_energy"),
        energy.get("stderr"),
    )
    checked = expected is not None and stderr is not None
    return {
        "line": energy["line"][:1].upper() + energy["line"][1:],
        "level": energy.get("level"),
        "samples": energy.get("samples"),
        "mean": percent(energy["mean_hidden_energy"]) if checked else None,
        "stderr": percent(stderr) if checked else None,
        "expected": percent(expected) if checked else None,
        "certified": percent(certified) if certified is not None else None,
        "below": energy.get("below_certified"),
        "quantile": percent(energy.get("certificate_quantile") or 0.9),
        "consistent": energy.get("consistent"),
    }


def _worst(data: dict) -> dict | None:
    """method.md: each sample: the sample the gradient hides least of, which the card leads with (not the median)."""
    worst = data.get("worst")
    if not isinstance(worst, dict) or worst.get("hidden_energy") is None:
        return None
    psnr, ssim = worst.get("visible_psnr"), worst.get("visible_ssim")
    measured = sum(
        1 for e in data.get("worst_first") or [] if isinstance(e, dict) and e.get("hidden_energy") is not None
    )
    return {
        "index": worst.get("index"),
        "hidden": percent(worst["hidden_energy"]),
        "psnr_value": psnr,
        "psnr": "∞" if psnr is None else f"{psnr:.1f}",
        "ssim": None if ssim is None else f"{ssim:.3f}",
        "rank": worst.get("rank"),
        "under_1": data.get("hiding_under_1_percent"),
        "measured": measured,
    }


ATTACK_NAMES = {"rgap": "R-GAP", "inverting-gradients": "Inverting Gradients", "gdbr": "GDBR"}


def _defense_figure(row: dict, which: str) -> str:
    value = row.get(which)
    if row.get("metric") == "ins_acc":
        return _fraction(value) if value is not None else "n/a"
    psnr = row.get(f"psnr_{which}")
    return fmt_real(value) + (f" ({fmt_real(psnr, 3)} dB)" if psnr is not None else "")


def _defenses(verification: dict) -> dict | None:
    rows = [row for row in verification.get("defenses") or [] if isinstance(row, dict)]
    training = verification.get("adadefense_training")
    training = training if isinstance(training, dict) else None
    if not rows and training is None:
        return None
    table, notes = [], []
    for row in rows:
        degrades, fails = bool(row.get("degrades")), bool(row.get("fails_with")) and not row.get("fails_without")
        attack = ATTACK_NAMES.get(row.get("attack"), str(row.get("attack")))
        table.append(
            {
                "defense": row.get("label") or row.get("defense"),
                "description": row.get("description") or "",
                "attack": attack,
                "metric": "InsAcc" if row.get("metric") == "ins_acc" else "median MSE (PSNR)",
                "without": _defense_figure(row, "without"),
                "with": _defense_figure(row, "with"),
                "verdict": ("yes, attack fails" if fails else "yes") if degrades else "no",
                "verdict_class": "fails" if degrades and fails else ("" if degrades else "holds"),
            }
        )
        texts = [f"{attack}: {note}" for note in row.get("attack_notes") or []]
        texts += [f"{row.get('label')} vs {attack}: {note}" for note in row.get("notes") or []]
        for text in texts:
            if text not in notes:
                notes.append(text)
    if training is not None:
        for key in ("accuracy_without", "accuracy_with"):
            training = {**training, f"{key}_text": _fraction(training.get(key))}
    return {"rows": table, "notes": notes, "training": training}


def _leakage(result: Result) -> dict | None:
    leakage = result.label_leakage
    if leakage is None:
        return None
    leaking = [b for b in leakage.layers if b.shared and b.bridge]
    blocked: dict[str, list[str]] = {}
    for bridge in leakage.layers:
        if bridge.shared and not bridge.bridge:
            at = "" if bridge.blocked_by in (None, bridge.name) else f" (at {bridge.blocked_by})"
            blocked.setdefault(bridge.kind, []).append(bridge.name + at)
    return {
        "risk": leakage.risk,
        "leaking": leaking,
        "blocked": [(BLOCKED_BECAUSE.get(kind, kind), names) for kind, names in blocked.items()],
        "withheld": [b.name for b in leakage.layers if not b.shared],
        "layers": leakage.layers,
    }


def _tokens(result: Result) -> dict | None:
    """Token leakage: the embedding table's rows, DAGER's span test per layer, and --verify dager's run."""
    tokens = result.token_leakage
    if tokens is None:
        return None
    dager = (result.verification or {}).get("dager")
    dager = dager if isinstance(dager, dict) else None
    if dager is not None:
        dager = {
            **dager,
            "judgement": _sentence(dager.get("judgement")),
            "precision_text": _fraction(dager.get("token_precision")),
            "recall_text": _fraction(dager.get("token_recall")),
            "extension": dager.get("extension") if isinstance(dager.get("extension"), dict) else None,
        }
    rows = [
        {
            "layer": layer,
            "status": "exposed"
            if layer.exposed
            else "frozen"
            if not layer.trainable
            else "withheld"
            if not layer.shared
            else "safe",
        }
        for layer in tokens.layers
    ]
    return {
        "t": tokens,
        "rows": rows,
        "exposed": tokens.exposed or tokens.span_exposed,
        "reason": next((layer.reason for layer in tokens.layers if layer.exposed), None),
        "positions": max((layer.positions for layer in tokens.layers), default=0),
        "dager": dager,
    }


def _round_card(result: Result) -> dict | None:
    """The federated round (method.md: the round): N, B, E, K, C, the cap that binds and ρ; None for FedSGD."""
    from rankaudit.settings.round import describe

    round_ = result.round
    if round_ is None or round_.fedsgd:
        return None
    bound = result.identifiability
    caps = bound.round if bound is not None else None
    return {
        "description": describe(round_),
        "samples": round_.samples,
        "batch_size": round_.batch_size,
        "epochs": round_.local_epochs,
        "steps": round_.steps,
        "clients": round_.clients,
        "optimizer": round_.optimizer,
        "lr": round_.lr,
        "momentum": round_.momentum,
        "unknowns": caps.unknowns if caps else None,
        "update_values": caps.update_values if caps else None,
        "steps_bound": caps.steps_bound if caps else None,
        "binding": caps.binding if caps else None,
        "explanation": _sentence(caps.explanation) if caps else "",
        "rho": bound.recoverable_fraction if bound is not None else None,
    }


def _dp(result: Result) -> dict | None:
    """The DP card: what the noise bounds, its curve over κ, --verify dp's measurement and --verify fisher's line
    beside the bound."""
    from rankaudit.findings.meaning import dp_sentence

    if result.dp is None:
        return None
    attack = (result.verification or {}).get("dp")
    attack = attack if isinstance(attack, dict) else None
    fisher = (result.verification or {}).get("fisher")
    from rankaudit.bound.fisher import BOUND_COVERS

    return {
        "d": result.dp,
        "sentence": _sentence(dp_sentence(result.dp)),
        "attack": attack,
        "bound_covers": BOUND_COVERS,
        "fisher": fisher if isinstance(fisher, dict) else None,
        "fisher_chart": Markup(fisher_chart(fisher)) if isinstance(fisher, dict) else "",
        "curve": Markup(svg.dp_curve(result.dp, attack)),
    }


def _headline(result: Result, verdict: str) -> str:
    """The verdict card's heading: the verdict's own reason, what the directions a server can see show of a sample's
    detail (the per-sample certificate the level reads); without one, the direction count the level then reads. A
    round that is not FedSGD is judged on its update, and beyond one sample the verdict is each sample's."""
    from rankaudit.findings.meaning import energy_percent, per_sample_view, samples_like_yours, visible_percent

    bound = result.identifiability
    sample = bound.sample if bound is not None else None
    sent = "the round's update" if result.round is not None and not result.round.fedsgd else "a shared gradient"
    if sample is not None and sample.certified_hidden_energy is not None and verdict in HEADLINES:
        hidden = sample.certified_hidden_energy
        shown = visible_percent(hidden)
        kept = "nothing" if hidden <= 0 else energy_percent(hidden)
        who = samples_like_yours(bound)
        if verdict == "protected":
            return (
                f"{who[0].upper()}{who[1:]} keep at least {kept} of their detail hidden from any weights: the "
                f"directions {sent} can show hold at most {percent(1 - hidden)} of it."
            )
        if verdict == "partial":
            return (
                f"The directions {sent} can show hold {shown} of a sample's detail: {kept} is certified hidden "
                f"for {who}, less than the {percent(1 - bound.max_recoverable)} protected asks; not protection."
            )
        return (
            f"The directions {sent} can show hold {shown} of a sample's detail: {kept} of it is certified "
            f"hidden for {who}, so a server can reconstruct them."
        )
    headline = HEADLINES.get(verdict, "")
    if sent != "a shared gradient":
        headline = headline.replace("one shared gradient", sent)
    if sample is not None and per_sample_view(result):
        headline = headline.replace("this input's", "each sample's").replace("this input", "any one sample")
    return headline


def _carried(result: Result) -> str:
    from rankaudit.findings.meaning import carried_by_sentence

    return carried_by_sentence(result)


def _panel(result: Result) -> dict | None:
    """The verdict card's rank figure: each sample's bound (method.md: each sample); at FedSGD batch 1 that is the batch's."""
    from rankaudit.findings.meaning import energy_percent, per_sample_view

    bound = result.identifiability
    if bound is None:
        return None
    certified = bound.sample.certified_hidden_energy if bound.sample is not None else None
    hidden = None if certified is None else energy_percent(certified)
    if bound.sample is not None and per_sample_view(result):
        sample = bound.sample
        return {
            "rank_bound": sample.rank_bound,
            "unknowns": sample.unknowns,
            "each": True,
            "deficit": sample.unknowns - sample.rank_bound,
            "fraction": sample.recoverable_fraction,
            "hidden": hidden,
        }
    return {
        "rank_bound": bound.rank_bound,
        "unknowns": bound.unknowns,
        "each": False,
        "deficit": bound.certified_deficit,
        "fraction": bound.recoverable_fraction,
        "hidden": hidden,
    }


# A picture narrower than this is enlarged by a whole factor, each pixel a visible block: a 32 px input shown at 32 px
# is unreadable, and smoothing would show detail the server does not see.
MIN_PICTURE_PX = 128


def _png(picture) -> bytes:
    """C×H×W in [0, 1] (1 or 3 channels) as PNG bytes, enlarged to at least MIN_PICTURE_PX on its shorter side by
    repeating pixels: zlib and struct, no image library."""
    import struct
    import zlib

    import numpy as np

    pixels = (np.clip(picture, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    factor = max(1, -(-MIN_PICTURE_PX // max(1, min(pixels.shape[1:]))))
    pixels = pixels.repeat(factor, axis=1).repeat(factor, axis=2)
    channels, height, width = pixels.shape
    rows = np.transpose(pixels, (1, 2, 0)).reshape(height, width * channels)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 on every scanline

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0 if channels == 1 else 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _certificate_picture(result: Result) -> dict | None:
    """method.md: energy: a shipped photograph crop beside its projection onto the top R_s components of the shipped
    spectrum, captioned with the PSNR: what a server that picks the weights could see of it. No weights needed."""
    from rankaudit.bound.energy import reference_picture
    from rankaudit.bound.quantile import PHOTO_REFERENCE

    bound = result.identifiability
    shipped = bound is not None and (bound.spectrum or "").startswith(PHOTO_REFERENCE)
    if bound is None or bound.sample is None or not shipped or len(result.inputs) != 1:
        return None
    picture = reference_picture(tuple(result.inputs[0].shape), bound.sample.rank_bound)
    if picture is None:
        return None
    original, visible, psnr = picture
    return {
        "original": _embedded(_png(original)),
        "visible": _embedded(_png(visible)),
        "psnr": "∞" if psnr is None else f"{psnr:.1f}",
        "rank": bound.sample.rank_bound,
        "hidden": bound.sample.certified_hidden_energy,
        "hidden_text": percent(bound.sample.certified_hidden_energy or 0.0),
        "quantile": percent(bound.certificate_quantile),
        "psnr_ceiling": bound.sample.visible_psnr_ceiling,
    }


def _whole(result: Result) -> str:
    from rankaudit.findings.meaning import per_sample_view, whole_sentence

    bound = result.identifiability
    if bound is None or bound.sample is None or not per_sample_view(result):
        return ""
    return whole_sentence(result)


def _suggest_review(suggestions) -> list[str]:
    """suggest's round review (N, E, C for protected), least-noise line and Fisher floor per design, as the table
    prints them."""
    if suggestions is None:
        return []
    from rankaudit.report.design import _fisher_lines, _noise_lines, _round_lines

    lines = (*_round_lines(suggestions), *_noise_lines(suggestions), *_fisher_lines(suggestions))
    return [line.strip() for line in lines if line.strip()]


# The verifiers with a card of their own: name -> how the card reads its record (record, result, the model's id
# prefix, base_dir). DAGER's run sits in the token-leakage card and the DP attack in the DP card (`_tokens`,
# `_dp`). Any other verifier's record gets the generic card (`_generic`).
CARDS = {
    "rgap": lambda record, result, prefix, base_dir: _rgap(record, base_dir),
    "gdbr": lambda record, result, prefix, base_dir: _gdbr(record, f"{prefix}l"),
    "rank": lambda record, result, prefix, base_dir: _rank(record, base_dir, result.images),
    "bias": lambda record, result, prefix, base_dir: record,
}
IN_OTHER_CARDS = ("dager", "dp", "fisher")


def _generic(name: str, record, card_id: str) -> dict:
    """A verifier without a card of its own: its judgement, its plain fields as a definition list, its notes."""
    shown = records.read(name, record)
    confirms = record.get("confirms") if isinstance(record, dict) else None
    return {
        "id": card_id,
        "name": name,
        "help": _sentence(shown.help),
        "judgement": _sentence(shown.judgement),
        "tone": "ok" if confirms is True else "warn" if confirms is False else None,
        "internal_error": _sentence(shown.internal_error),
        "fields": shown.fields,
        "notes": [_sentence(note) for note in shown.notes],
        "json_only": shown.json_only,
    }


def _verification_cards(result: Result, prefix: str, base_dir: Path | None) -> dict:
    """Each verifier's record read by its card: the cards of CARDS by name, and the generic ones as `verifiers`."""
    verification = result.verification or {}
    cards = {
        name: build(verification[name], result, prefix, base_dir) if isinstance(verification.get(name), dict) else None
        for name, build in CARDS.items()
    }
    others = records.without_section(verification, (*CARDS, *IN_OTHER_CARDS))
    cards["verifiers"] = [
        _generic(name, verification[name], f"{prefix}-verify-{position}") for position, name in enumerate(others, 1)
    ]
    return cards


def _model(result: Result, index: int, base_dir: Path | None, suggestions=None) -> dict:
    prefix = f"m{index}"
    verdict = result.verdict or "unknown"
    critical = result.critical_row
    verification = result.verification or {}
    return {
        "id": prefix,
        "r": result,
        "verdict": verdict,
        "verdict_class": verdict if verdict in HEADLINES else "unknown",
        "headline": _headline(result, verdict),
        "meaning": _sentence(result.meaning),
        "panel": _panel(result),
        "whole": _whole(result),
        "certificate": _certificate_picture(result),
        "energy": energy_sentence(result),
        "next_step": next_step(result),
        "carried": _carried(result),
        "shape": "×".join(str(d) for d in result.input_shape),
        "critical": critical,
        "chart": Markup(svg.ra_chart(result, prefix=f"{prefix}c")),
        "bound_bar": Markup(bound_bar.bound_bar(result, prefix=f"{prefix}b")),
        "graph": Markup(svg.architecture_graph(result, prefix=f"{prefix}g")),
        "leakage": _leakage(result),
        "tokens": _tokens(result),
        **_verification_cards(result, prefix, base_dir),
        "defenses": _defenses(verification),
        "round": _round_card(result),
        "deployment": result.deployment,
        "dp": _dp(result),
        "suggestions": suggestions,
        "suggest_review": _suggest_review(suggestions),
        "has_merge": any(n.kind in ("add", "cat") for n in (result.architecture.nodes if result.architecture else [])),
        "has_projection": any(
            n.kind == "projection" for n in (result.architecture.nodes if result.architecture else [])
        ),
        "series": [(symbol, meaning, colour) for _, symbol, meaning, colour in svg.SERIES],
        "warn": svg.WARN,
    }


def render(results: list[Result], *, base_dir: str | Path | None = None, suggestions: dict | None = None) -> str:
    """One HTML document for all `results`. Relative image paths in a verification resolve against `base_dir`
    (default: the working directory). `suggestions` maps a result's model to its SuggestReport (rankaudit
    suggest), shown as a section of that model's report."""
    base = Path(base_dir) if base_dir is not None else None
    models = [_model(result, i + 1, base, (suggestions or {}).get(result.model)) for i, result in enumerate(results)]
    css = files("rankaudit.templates").joinpath("report.css").read_text(encoding="utf-8")
    if "</style" in css.lower():
        raise ValueError("report.css must not contain '</style'")
    template = _environment().get_template("report.html.j2")
    return template.render(models=models, version=__version__, css=Markup(css))
