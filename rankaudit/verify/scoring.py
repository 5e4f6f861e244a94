"""An input attack's reconstructions read against the verdict: thresholds, flat-image baselines, saved images."""

from __future__ import annotations

import math
from pathlib import Path

# An exposed model is confirmed by a near-perfect reconstruction, a protected one by a poor one.
CONFIRM_EXPOSED_BELOW = 1e-3
CONFIRM_PROTECTED_ABOVE = 1e-2


def confirms(verdict: str, median_mse: float) -> tuple[bool, str]:
    """Whether the attack's median MSE confirms the verdict, and the sentence that says so."""
    if verdict == "exposed":
        ok = median_mse < CONFIRM_EXPOSED_BELOW
        return ok, (
            f"confirms exposed: median MSE {median_mse:.3g} < {CONFIRM_EXPOSED_BELOW:g}"
            if ok
            else f"disagrees: the analysis says exposed, but the attack's median MSE is {median_mse:.3g} "
            f"(>= {CONFIRM_EXPOSED_BELOW:g})"
        )
    if verdict == "protected":
        ok = median_mse > CONFIRM_PROTECTED_ABOVE
        return ok, (
            f"confirms protected: median MSE {median_mse:.3g} > {CONFIRM_PROTECTED_ABOVE:g}"
            if ok
            else f"disagrees: the analysis says protected, but the attack reached median MSE {median_mse:.3g} "
            f"(<= {CONFIRM_PROTECTED_ABOVE:g})"
        )
    if verdict == "partial":
        # A partial verdict rules out only an exact reconstruction; a near-perfect one is what it predicts for a
        # small deficit, a poor one may be the attack's weakness: neither outcome confirms or refutes it.
        return False, (
            f"partial verdict: no threshold to confirm against (median MSE {median_mse:.3g}); "
            "--verify rank measures what the gradient shows"
        )
    return False, f"boundary verdict: no threshold to confirm against (median MSE {median_mse:.3g})"


def judge_attack(verdict: str, median_mse: float, against: dict) -> tuple[bool, str]:
    """One judgement for an input attack's section, from both of its readings, with the rule it used.

    The MSE threshold and the flat-image baselines (rankaudit.verify.baselines) could each give a judgement; a section
    that printed "recovered" beside "confirms protected" would say two things. So: `protected` is confirmed only when
    the median MSE is above CONFIRM_PROTECTED_ABOVE *and* no reconstruction beats both baselines; a reconstruction
    that beats both is a recovery, whatever the median says. `exposed` is confirmed by the median MSE below
    CONFIRM_EXPOSED_BELOW. `partial` and `boundary` have no threshold; the baselines' outcome is said beside them."""
    from rankaudit.verify import baselines

    recovered, total = against.get("recovered_samples", 0), against.get("samples_scored")
    of = f"{recovered} of {total}" if total is not None else str(recovered)
    if verdict == "protected":
        rule = (
            f"rule: protected is confirmed when the median MSE is above {CONFIRM_PROTECTED_ABOVE:g} and no "
            "reconstruction beats both the flat-grey and the mean-colour baseline"
        )
        if against.get("outcome") != baselines.FAILED:
            return False, (
                f"does not confirm protected: {of} reconstruction(s) beat both the flat-grey and the mean-colour "
                f"baseline ({against.get('outcome')}; median MSE {median_mse:.3g}); {rule}"
            )
        if median_mse <= CONFIRM_PROTECTED_ABOVE:
            return False, (
                f"disagrees: the analysis says protected, but the attack reached median MSE {median_mse:.3g} "
                f"(<= {CONFIRM_PROTECTED_ABOVE:g}); {rule}"
            )
        return True, (
            f"confirms protected: median MSE {median_mse:.3g} > {CONFIRM_PROTECTED_ABOVE:g} and no reconstruction "
            f"beats both baselines; {rule}"
        )
    confirmed, judgement = confirms(verdict, median_mse)
    if verdict == "exposed":
        judgement += f"; rule: exposed is confirmed when the median MSE is below {CONFIRM_EXPOSED_BELOW:g}"
    return confirmed, judgement + baseline_judgement(against)


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def save_images(artifacts: Path, originals, reconstructions) -> list[tuple[str, str]]:
    """Each original and its reconstruction as .npy and PNG under `artifacts`: their PNG paths."""
    import numpy as np
    import torch
    from PIL import Image

    artifacts.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (original, reconstruction) in enumerate(zip(originals, reconstructions)):
        pair = []
        for kind, image in (("original", original), ("reconstruction", reconstruction)):
            array = image.detach().to(torch.float64).cpu().numpy()
            np.save(artifacts / f"{kind}_{index}.npy", array)
            pixels = (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
            pixels = pixels[0] if pixels.shape[0] == 1 else np.transpose(pixels, (1, 2, 0))
            target = artifacts / f"{kind}_{index}.png"
            Image.fromarray(pixels).save(target)
            pair.append(str(target))
        paths.append((pair[0], pair[1]))
    return paths


def against_baselines(originals, reconstructions) -> tuple[list, dict]:
    """Every image's reconstruction scored beside the grey and mean-colour baselines (rankaudit.verify.baselines),
    and the summary keys the verification gains: the baselines' medians, the best image, the outcome."""
    from rankaudit.verify import baselines

    scored = baselines.score(originals, reconstructions)
    return scored, baselines.summary(scored)


def baseline_judgement(against: dict) -> str:
    """What the judgement adds when some reconstruction does not beat both baselines."""
    from rankaudit.verify import baselines

    if against["outcome"] == baselines.FAILED:
        return (
            "; no reconstruction beats both the flat-grey and the mean-colour baseline: the attack failed, "
            "it recovered nothing"
        )
    if against["outcome"] == baselines.PARTLY:
        return (
            f"; only {against['recovered_samples']} reconstruction(s) beat both the flat-grey and the "
            "mean-colour baseline"
        )
    return ""
