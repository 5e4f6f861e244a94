"""Defenses in the verifier: each one, at a stated strength, measurably degrades the attack it targets.

Every figure in a comment was measured on the CPU with the seeds used here; the assertions leave a margin
around it. R-GAP is exact algebra, so any perturbation of the gradient wrecks it; the optimisation attack
(inverting gradients) degrades gradually with the strength, which the graded figures below show.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import torch.nn as nn
from conftest import EXAMPLES

from rankaudit.audit import audit
from rankaudit.errors import UsageError
from rankaudit.report import html, table
from rankaudit.verify import run
from rankaudit.verify.attacks import gdbr, gdbr_victims
from rankaudit.verify.attacks.invert import run_inverting
from rankaudit.verify.defenses import (
    ADADEFENSE_SERVER_LR,
    DEFAULT_NOISE_SIGMA,
    DEFAULT_PRUNE_FRACTION,
    DefenseError,
    fedavg_accuracy,
    parse_defense,
)


def load_example(file_name: str, class_name: str):
    spec = importlib.util.spec_from_file_location(f"defense_{file_name[:-3]}", EXAMPLES / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name), tuple(module.INPUT_SHAPE)


def digit_patches(count: int) -> torch.Tensor:
    """Real 8x8 images in [0, 1]: scikit-learn's digits, one channel."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images[:count], dtype=torch.float32) / 16.0
    return images.unsqueeze(1)


def over_determined_mlp() -> nn.Module:
    # 64 unknowns against a 256x64 first-layer gradient with bias: inverting gradients recovers x (MSE ~1e-9).
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


@pytest.fixture(autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- parsing and the maths of each defense


def test_parse_defaults_and_params():
    noise, prune, ada = parse_defense("noise"), parse_defense("prune"), parse_defense("adadefense")
    assert (noise.name, noise.param) == ("noise", DEFAULT_NOISE_SIGMA) == ("noise", 0.01)
    assert (prune.name, prune.param) == ("prune", DEFAULT_PRUNE_FRACTION) == ("prune", 0.9)
    assert ada.name == "adadefense" and ada.options == {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "warmup": 0}
    assert parse_defense("noise:0.05").param == 0.05 and parse_defense(" Prune:0.99 ").param == 0.99
    assert parse_defense("adadefense:0.99").options["beta2"] == 0.99  # a bare number in [0.5, 1) is β2
    assert parse_defense("adadefense:1e-6").options["eps"] == 1e-6  # one in (0, 0.5) is ε
    custom = parse_defense("adadefense:eps=1e-6,beta2=0.99,warmup=5")
    assert custom.options == {"beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "warmup": 5}
    assert parse_defense(custom.spec) == custom and custom.spec == "adadefense:beta2=0.99,eps=1e-06,warmup=5"
    assert custom != parse_defense("adadefense:eps=1e-6,beta2=0.99") and len({custom, parse_defense(custom.spec)}) == 1
    assert parse_defense("prune:0.07").label == "prune 7%" and parse_defense("prune:0.125").label == "prune 0.125"
    assert noise.label == "noise σ=0.01" and prune.label == "prune 90%" and ada.label == "adadefense"


@pytest.mark.parametrize(
    "text, problem, fix",
    [
        ("gauss:0.1", "unknown defense 'gauss'", "use one of noise, prune, adadefense"),
        ("noise:abc", "sigma 'abc' is not a number", "noise[:SIGMA]"),
        ("noise:-1", "sigma must be positive", "noise:0.01"),
        ("prune:90", "must lie in [0, 1), got 90", "prune:0.9 for 90%"),
        ("prune:1", "must lie in [0, 1)", "prune:0.9"),
        ("adadefense:2", "β2 in [0.5, 1) or ε in (0, 0.5), got 2", "adadefense:beta2="),
        ("adadefense:lr=1", "unknown AdaDefense option 'lr'", "beta1=, beta2=, eps= or warmup="),
        ("adadefense:warmup=1.5", "a whole number 0-1000", "warmup=5"),
        ("noise:", "nothing after the colon", "noise[:SIGMA]"),
    ],
)
def test_bad_values_name_the_problem_and_the_fix(text, problem, fix):
    with pytest.raises(DefenseError) as info:
        parse_defense(text)
    error = info.value
    assert isinstance(error, ValueError) and isinstance(error, UsageError) and error.exit_code == 2
    assert problem in error.problem and fix in error.fix
    assert str(error) == f"{error.problem}; fix: {error.fix}" and text.strip() in error.problem


def test_each_defense_does_what_it_says():
    gen = torch.Generator().manual_seed(0)
    grads = {
        "w": torch.randn((200, 50), generator=gen, dtype=torch.float64) * 1e-3,
        "b": torch.randn(7, generator=gen, dtype=torch.float64),
    }
    # noise: N(0, σ²) per entry, a fresh draw per call, the same for the same seed
    noisy = parse_defense("noise:0.5").client(seed=3)
    first, second = noisy(grads), noisy(grads)
    assert abs(float((first["w"] - grads["w"]).std()) - 0.5) < 0.01
    assert not torch.equal(first["w"], second["w"])
    assert torch.equal(parse_defense("noise:0.5").client(seed=3)(grads)["w"], first["w"])
    # prune: exactly floor(p n) smallest-magnitude entries of every tensor zeroed, the rest untouched
    pruned = parse_defense("prune:0.9")(grads)
    assert int((pruned["w"] == 0).sum()) == 9000 and int((pruned["b"] == 0).sum()) == 6
    kept = pruned["w"] != 0
    assert torch.equal(pruned["w"][kept], grads["w"][kept])
    assert float(grads["w"][kept].abs().min()) >= float(grads["w"][~kept].abs().max())
    # AdaDefense, first round (zero moments): m̂ = g, v̂ = g², so the stand-in is g / (|g| + ε), about sign(g)
    ada = parse_defense("adadefense")
    stand_in = ada(grads)
    assert torch.allclose(stand_in["w"], grads["w"] / (grads["w"].abs() + 1e-8), rtol=1e-12, atol=0)
    clear = grads["w"].abs() > 1e-5
    assert float((stand_in["w"] - grads["w"].sign())[clear].abs().max()) < 1e-3
    # ...and later rounds follow Adam's recursion, the moments staying in the client's state
    state = ada.new_state()
    history = [{k: v * (i + 1) + 0.1 for k, v in grads.items()} for i in range(3)]
    for g in history:
        shared = ada.apply(g, state)
    m = v = 0
    for _t, g in enumerate(history, start=1):
        m = 0.9 * m + 0.1 * g["b"]
        v = 0.999 * v + 0.001 * g["b"] ** 2
    expected = (m / (1 - 0.9**3)) / ((v / (1 - 0.999**3)).sqrt() + 1e-8)
    assert state["t"] == 3 and torch.allclose(shared["b"], expected, rtol=1e-12)
    # warm-up: the client's moments come from earlier rounds, and every attacked round starts from them
    warm = ada.client(warmup=history)
    assert torch.equal(warm(history[-1])["b"], warm(history[-1])["b"])
    assert not torch.allclose(warm(grads)["w"], stand_in["w"])


def test_no_defense_and_identity_defense_change_nothing():
    model, images = over_determined_mlp(), digit_patches(2)
    plain = run_inverting(model, images, "cross-entropy", steps=40, restarts=1, device="cpu", seed=0)
    same = run_inverting(
        model, images, "cross-entropy", steps=40, restarts=1, device="cpu", seed=0, defense=lambda grads: dict(grads)
    )
    assert plain.mse == same.mse
    lenet = gdbr_victims.init_like_paper(load_example("lenet10.py", "LeNet10")[0](), ["fc1", "fc2"], seed=0)
    kwargs = dict(trials=2, device="cpu", seed=0, input_shape=(1, 28, 28))
    assert (
        gdbr.run_gdbr(lenet, "fc1", 16, **kwargs).per_trial[1]["recovered"]
        == gdbr.run_gdbr(lenet, "fc1", 16, defense=lambda grads: grads, **kwargs).per_trial[1]["recovered"]
    )


# --------------------------------------------------------------------------- input reconstruction


@pytest.fixture(scope="module")
def cnn6_defended():
    """CNN6 (exposed), one photograph crop, R-GAP without and with three defenses, plus the FedAvg comparison."""
    spec = str(EXAMPLES / "cnn6.py")
    result = audit(spec)
    run.verify_defenses(
        result,
        spec,
        [parse_defense(s) for s in ("noise:1e-6", "prune:0.01", "adadefense")],
        attacks=("rgap",),
        samples=1,
        seed=0,
        device="cpu",
        show_progress=False,
    )
    return result


def _row(result, label, attack):
    return next(r for r in result.verification["defenses"] if r["label"] == label and r["attack"] == attack)


@pytest.mark.slow  # CNN6's defended R-GAP runs and FedAvg training: minutes on two cores
def test_tiny_noise_and_pruning_break_cnn6_rgap(cnn6_defended):
    """σ = 1e-6 is 0.5 % of the gradient's RMS (2.0e-4); pruning 1 % zeroes only the smallest entries. R-GAP's
    median MSE goes from 1.4e-26 to 309 (noise) and 2.4e4 (pruning), PSNR from 259 dB to about 4 dB."""
    noise, prune = _row(cnn6_defended, "noise σ=1e-06", "rgap"), _row(cnn6_defended, "prune 1%", "rgap")
    for row in (noise, prune):
        assert row["without"] < 1e-20 and row["psnr_without"] > 200
        assert row["with"] > 1.0 and row["psnr_with"] < 10
        assert row["degrades"] and row["fails_with"] and not row["fails_without"]
    assert "0.00489× the RMS" in noise["notes"][0]


@pytest.mark.slow  # an end-to-end attack of half a minute or more on two cores
def test_noise_and_pruning_degrade_inverting_gradients_gradually():
    """Over-determined MLP (64 unknowns, 19k gradient entries; first-layer gradient RMS 0.011), three digits,
    300 Adam steps. Median MSE (PSNR): 2.0e-10 (97 dB) without; noise σ=0.01 4.8e-4 (33 dB), σ=0.1 1.3e-2
    (19 dB); pruning 90 % 8.7e-4 (31 dB), 99 % 5.9e-2 (12 dB)."""
    model, images = over_determined_mlp(), digit_patches(3)
    measured = {}
    for text in (None, "noise:0.01", "noise:0.1", "prune:0.9", "prune:0.99"):
        defense = parse_defense(text).client(seed=0) if text else None
        outcome = run_inverting(
            model, images, "cross-entropy", steps=300, restarts=1, device="cpu", seed=0, defense=defense
        )
        measured[text] = outcome.median_mse
    assert measured[None] < 1e-8
    assert 1e-4 < measured["noise:0.01"] < 3e-3
    assert measured["noise:0.1"] > 1e-2 > measured["noise:0.01"]
    assert 2e-4 < measured["prune:0.9"] < 5e-3
    assert measured["prune:0.99"] > 3e-2 > measured["prune:0.9"]


@pytest.mark.slow  # CNN6's defended R-GAP runs and FedAvg training: minutes on two cores
def test_adadefense_turns_cnn6_rgap_into_a_failure(cnn6_defended):
    """First-round stand-in (zero moments, ≈ sign(g)): R-GAP's MSE 1.4e-26 -> 1.8e10, PSNR 259 -> 4 dB."""
    row = _row(cnn6_defended, "adadefense", "rgap")
    assert row["without"] < 1e-20 and row["with"] > 1e-2 and row["psnr_with"] < 10
    assert row["degrades"] and row["fails_with"] and not row["fails_without"]


def test_adadefense_defeats_inverting_gradients_but_not_label_inference():
    """Over-determined MLP, three digits: median MSE 2.0e-10 -> 0.082 (PSNR 97 -> 11 dB). The stand-in keeps the gradient's signs, and
    the output bias gradient p - e_y is negative at the label only, so iDLG still reads every label."""
    model, images = over_determined_mlp(), digit_patches(3)
    plain = run_inverting(model, images, "cross-entropy", steps=300, restarts=1, device="cpu", seed=0)
    defended = run_inverting(
        model,
        images,
        "cross-entropy",
        steps=300,
        restarts=1,
        device="cpu",
        seed=0,
        defense=parse_defense("adadefense").client(),
    )
    assert plain.median_mse < 1e-8 and defended.median_mse > 5e-2
    assert defended.recovered_labels == defended.labels


# --------------------------------------------------------------------------- label recovery (GDBR, batch 64)


@pytest.fixture(scope="module")
def lenet10_defended():
    spec = str(EXAMPLES / "lenet10.py")
    result = audit(spec, batch_size=64, withheld_layers=["fc2"])
    run.verify_defenses(
        result,
        spec,
        [parse_defense(s) for s in ("noise", "prune", "adadefense", "adadefense:warmup=5")],
        attacks=("gdbr",),
        trials=5,
        seed=0,
        device="cpu",
        show_progress=False,
        training_rounds=20,
    )
    return result


def test_adadefense_turns_lenet10_gdbr_into_a_failure(lenet10_defended):
    """fc1's gradient, B=64, random classes, dummy features (the CLI's defaults). InsAcc 0.922 -> 0.531 (first
    round), 0.375 after 5 warm-up rounds; ClsAcc 1.0 -> 0.4. Guessing 6-7 per class scores 0.828: the
    defended attack does worse than reading nothing."""
    first, warm = (_row(lenet10_defended, label, "gdbr") for label in ("adadefense", "adadefense (warmup=5)"))
    assert first["without"] > 0.9 and first["cls_acc_without"] == 1.0
    assert first["with"] < 0.6 and first["cls_acc_with"] <= 0.5 and warm["with"] < 0.45
    assert abs(first["chance"] - 0.828) < 0.01
    for row in (first, warm):
        assert row["degrades"] and row["fails_with"] and not row["fails_without"]


def test_noise_and_pruning_against_gdbr_on_lenet10(lenet10_defended):
    """σ = 0.01 (44x fc1's gradient RMS) pulls InsAcc 0.922 -> 0.828, down to chance; pruning 90 % leaves
    0.875: GDBR reads a projection of the whole gradient, which averages noise and survives sparsification."""
    noise, prune = _row(lenet10_defended, "noise σ=0.01", "gdbr"), _row(lenet10_defended, "prune 90%", "gdbr")
    assert noise["degrades"] and noise["with"] <= noise["chance"] + 1e-9 and "43.7× the RMS" in noise["notes"][0]
    assert not prune["degrades"] and prune["with"] > 0.85


@pytest.mark.slow  # an end-to-end attack of half a minute or more on two cores
def test_adadefense_turns_mlp6_gdbr_into_a_failure():
    """MLP6, fc2's gradient through a five-layer bridge, B=64, held-out digits as features: InsAcc 0.984 ->
    0.516 (random classes), 1.0 -> 0.297 (imbalanced: chance 0.44), 0.984 -> 0.062 (one class: chance 0.09)."""
    build, shape = load_example("mlp6.py", "MLP6")
    torch.manual_seed(0)
    model = gdbr_victims.init_like_paper(build(), ["fc2", "fc3", "fc4", "fc5", "fc6", "classifier"], seed=0)
    aux = gdbr_victims.held_out_images(shape)
    ada = parse_defense("adadefense")
    figures = {}
    for dist in ("random", "imbalanced", "single"):
        kwargs = dict(trials=5, class_dist=dist, aux=aux, device="cpu", seed=0, input_shape=shape)
        figures[dist] = (
            gdbr.run_gdbr(model, "fc2", 64, **kwargs).ins_acc,
            gdbr.run_gdbr(model, "fc2", 64, defense=ada.client(), **kwargs).ins_acc,
        )
    assert figures["random"][0] > 0.95 and figures["random"][1] < 0.6
    assert figures["imbalanced"][0] > 0.95 and figures["imbalanced"][1] < 0.4
    assert figures["single"][0] > 0.95 and figures["single"][1] < 0.15


def test_first_round_adadefense_still_leaks_single_class_batches():
    """The limit of the first round: with zero moments the stand-in is sign(g), and a one-class batch's signs
    name its class. LeNet10, B=64: InsAcc 0.766 without, 0.969 with the first-round stand-in; 5 warm-up rounds
    on other batches (moments the server never sees) bring it to 0.50 (chance 0.09)."""
    spec = str(EXAMPLES / "lenet10.py")
    result = audit(spec, batch_size=64, withheld_layers=["fc2"])
    run.verify_defenses(
        result,
        spec,
        [parse_defense("adadefense"), parse_defense("adadefense:warmup=5")],
        attacks=("gdbr",),
        class_dist="single",
        device="cpu",
        show_progress=False,
        training=False,
    )
    first, warm = result.verification["defenses"]
    assert first["without"] > 0.7 and first["with"] > 0.9 and not first["degrades"]
    assert warm["with"] < 0.6 and warm["degrades"] and not warm["fails_with"]


# --------------------------------------------------------------------------- the price in accuracy


@pytest.mark.slow  # CNN6's defended R-GAP runs and FedAvg training: minutes on two cores
def test_fedavg_with_the_stand_in_trains_as_well(cnn6_defended):
    """300 FedAvg rounds, 4 clients x 5 local SGD steps, MLP on scikit-learn digits: test accuracy 0.970 sharing
    the update, 0.976 sharing AdaDefense's stand-in (server step 1e-3, as in the paper's code)."""
    training = cnn6_defended.verification["adadefense_training"]
    assert training["rounds"] == 300 and training["clients"] == 4
    assert training["server_lr_with"] == ADADEFENSE_SERVER_LR and training["server_lr_without"] == 1.0
    assert training["accuracy_without"] > 0.95 and training["accuracy_with"] > 0.95
    assert abs(training["accuracy_without"] - training["accuracy_with"]) < 0.02


def test_fedavg_accuracy_is_seeded_and_learns():
    short = fedavg_accuracy(None, rounds=20, clients=2, seed=1)
    assert short == {**fedavg_accuracy(None, rounds=20, clients=2, seed=1), "seconds": short["seconds"]}
    assert short["accuracy"] > 0.5 and short["clients"] == 2 and short["defense"] is None


# --------------------------------------------------------------------------- what the reports show


@pytest.mark.slow  # CNN6's defended R-GAP runs and FedAvg training: minutes on two cores
def test_rows_are_json_and_reach_table_and_html(cnn6_defended, lenet10_defended):
    for result in (cnn6_defended, lenet10_defended):
        rows = json.loads(json.dumps(result.verification, allow_nan=False))["defenses"]
        for row in rows:
            assert {
                "defense",
                "param",
                "attack",
                "metric",
                "without",
                "with",
                "degrades",
                "fails_with",
                "notes",
            } <= row.keys()
    text = table.render([cnn6_defended, lenet10_defended])
    assert "Defenses (the same attack" in text and "yes, attack fails" in text
    line = next(line for line in text.splitlines() if line.lstrip().startswith("adadefense ") and "GDBR" in line)
    assert line.split() == ["adadefense", "GDBR", "InsAcc", "92.2%", "53.1%", "yes,", "attack", "fails"]
    assert "test accuracy 97.0% without, 97.6% with the stand-in" in text
    assert "chance level" in text and text.count("chance level") == 1
    page = html.render([cnn6_defended, lenet10_defended])
    assert page.count('<table class="defenses">') == 2 and "AdaDefense&#39;s cost in training" not in page
    assert "AdaDefense's cost in training" in page and "<b>97.0%</b> without" in page
    assert "53.1%" in page and "http" not in page.lower()
    assert math.isfinite(lenet10_defended.verification["adadefense_training"]["accuracy_with"])


def test_runner_rejects_unknown_attacks(lenet10_defended):
    with pytest.raises(UsageError, match="rgap and/or gdbr"):
        run.verify_defenses(lenet10_defended, str(EXAMPLES / "lenet10.py"), [parse_defense("noise")], attacks=("dlg",))
    assert run.verify_defenses(lenet10_defended, str(EXAMPLES / "lenet10.py"), []) == {}


@pytest.mark.slow  # an end-to-end attack of half a minute or more on two cores
def test_optimisation_attack_rows_where_rgap_cannot_go_or_as_a_cross_check():
    """ResNet: R-GAP stops, inverting gradients attacks with and without the defense. Fig. 2(a) with
    optimisation=True: R-GAP rows and inverting-gradients rows for the same defense. Tiny budgets (wiring only)."""
    resnet = str(EXAMPLES / "resnet18_w16_cut3.py")
    result = audit(resnet)
    rows = run.verify_defenses(
        result,
        resnet,
        [parse_defense("adadefense")],
        samples=1,
        steps=5,
        restarts=1,
        training=False,
        device="cpu",
        show_progress=False,
    )["defenses"]
    assert [row["attack"] for row in rows] == ["inverting-gradients"]
    assert "R-GAP stops at" in rows[0]["attack_notes"][0] and "adadefense_training" not in result.verification
    fig2a = str(EXAMPLES / "fig2_a.py")
    result = audit(fig2a)
    rows = run.verify_defenses(
        result,
        fig2a,
        [parse_defense("noise:1e-3")],
        samples=1,
        steps=5,
        restarts=1,
        optimisation=True,
        device="cpu",
        show_progress=False,
    )["defenses"]
    assert [row["attack"] for row in rows] == ["rgap", "inverting-gradients"]
    assert rows[0]["without"] < 1e-20 and rows[0]["degrades"]  # measured: 2.0e-28 -> 0.049
    assert all(row["samples"] == 1 and row["metric"] == "median_mse" for row in rows)
