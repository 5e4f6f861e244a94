"""`suggest` re-counts single edits without re-tracing; each must equal a full analysis of the edited model."""

import json
import textwrap

import pytest
from conftest import EXAMPLES

from rankaudit.audit import audit
from rankaudit.design.suggest import suggest
from rankaudit.model.load import load_model
from rankaudit.report import design


@pytest.fixture(scope="module")
def resnet_report():
    return suggest(str(EXAMPLES / "resnet18_w16.py"))


def by(report, edit, target):
    return next(s for s in report.suggestions if s.edit == edit and s.target == target)


def test_resnet_top_skip_cut_is_block_3_and_block_8_changes_nothing(resnet_report):
    cuts = [s for s in resnet_report.suggestions if s.edit == "cut-skip"]
    assert len(cuts) == 8 and cuts[0].target == "layer2.0"
    assert cuts[0].ra_i == audit(str(EXAMPLES / "resnet18_w16_cut3.py")).ra_i == -7808
    assert cuts[0].critical_layer == "avgpool" and cuts[0].delta_params == -(16 * 32 + 2 * 32)
    block8 = by(resnet_report, "cut-skip", "layer4.1")
    assert block8.ra_i == resnet_report.ra_i == audit(str(EXAMPLES / "resnet18_w16_cut8.py")).ra_i
    assert not block8.crosses_verdict and block8.delta_params == 0


def test_ranking_is_by_the_recoverable_fraction_then_the_ra_i_reached(resnet_report):
    reached = [(s.recoverable_fraction, -s.ra_i) for s in resnet_report.suggestions]
    assert reached == sorted(reached)
    # method.md: each sample: a batch size protects the batch as a whole, never one sample, so it is no edit row any more; the
    # two batch sizes (the first with any certified deficit, the first protected) are reported beside the rows.
    assert not [s for s in resnet_report.suggestions if s.edit == "batch-size"]
    smallest = {"partial": resnet_report.certifying_batch, "protected": resnet_report.protecting_batch}
    assert smallest["partial"] == 230

    # The first certified deficit is counted on directions; the first protected batch is read on energy, as `check`
    # reads the batch line: at least half of the B samples' energy hidden (each sample stays exposed).
    result = audit(str(EXAMPLES / "resnet18_w16.py"), batch_size=smallest["partial"])
    assert result.identifiability.certified_deficit > 0 and result.verdict == "exposed"
    assert audit(str(EXAMPLES / "resnet18_w16.py"), batch_size=229).identifiability.certified_deficit == 0
    result = audit(str(EXAMPLES / "resnet18_w16.py"), batch_size=smallest["protected"])
    before = audit(str(EXAMPLES / "resnet18_w16.py"), batch_size=smallest["protected"] - 1).identifiability
    assert (result.identifiability.verdict, before.verdict, result.verdict) == ("protected", "partial", "exposed")
    # 891,953 samples, all 701,466 parameters and the BatchNorms' 2,400 running statistics reachable (0.79 per
    # sample): the certified share of 90 % of such batches crosses 1/2 there.
    assert smallest["protected"] == 891_953 and result.identifiability.rank_bound == 701_466 + 2_400
    assert result.identifiability.certified_hidden_energy >= 0.5 > before.certified_hidden_energy


NARROW_FIG2_D = """
import torch.nn as nn
INPUT_SHAPE = (3, 32, 32)
class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, {c1}, kernel_size=3, bias=False)
        self.conv2 = nn.Conv2d({c1}, {c2}, kernel_size=3, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear({c2} * 28 * 28, 1, bias={bias})
    def forward(self, x):
        return self.fc(self.flatten(self.act(self.conv2(self.act(self.conv1(x))))))
"""


def write_model(tmp_path, name, **dims):
    path = tmp_path / name
    path.write_text(textwrap.dedent(NARROW_FIG2_D.format(**dims)))
    return str(path)


def test_narrowing_a_two_conv_net_matches_the_narrowed_model(tmp_path):
    report = suggest(str(EXAMPLES / "fig2_d.py"))
    conv1 = by(report, "narrow", "conv1")
    # |x| 3072 / (27 weights per channel + 900 positions) = 3.3 -> 3 channels: 3072 - 81 - 2700 = 291 > 0.
    assert conv1.detail == "out_channels 4 -> 3"
    narrowed = audit(write_model(tmp_path, "n1.py", c1=3, c2=4, bias=False))
    assert (conv1.ra_i, conv1.critical_layer) == (narrowed.ra_i, narrowed.critical_layer) == (291, "conv1")
    assert conv1.delta_params == narrowed.parameters - (108 + 144 + 3136) == -27 - 36
    # Read on energy, as `check` reads it: the 264 directions certified hidden hold under 5 % of a typical
    # photograph's energy, so the edited model stays exposed like the unedited one (on directions it was partial).
    assert not conv1.crosses_verdict and conv1.verdict == narrowed.verdict == "exposed"
    # The re-counted graph's per-sample bound stays at or over the re-traced model's (an upper bound, 27 looser).
    assert narrowed.identifiability.sample.rank_bound == 2781 <= conv1.rank_bound == 2808
    assert narrowed.identifiability.sample.certified_hidden_energy < 0.05
    # conv2 is already locally deficient (3600 - 144 - 3136 = 320 > 0; only V makes its RA_i negative).
    assert not [s for s in report.suggestions if s.edit == "narrow" and s.target == "conv2"]
    assert not [s for s in report.suggestions if s.edit == "stride"]  # every stride change breaks fc's input
    assert any(line.startswith("stride conv1") for line in report.skipped)


def test_removing_a_bias_matches_the_model_without_it(tmp_path):
    with_bias = write_model(tmp_path, "b.py", c1=4, c2=4, bias=True)
    report = suggest(with_bias, batch_size=2)
    edit = by(report, "remove-bias", "fc")
    without = audit(write_model(tmp_path, "nb.py", c1=4, c2=4, bias=False), batch_size=2)
    assert (edit.ra_i, edit.delta_params) == (without.ra_i, -1)


def test_suggest_cli_json_and_top(run_cli):
    code, out, _ = run_cli("suggest", EXAMPLES / "resnet18_w16.py", "--top", "3", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and len(payload["suggestions"]) == 3
    assert {"model", "ra_i", "critical_layer", "suggestions"} <= payload.keys()
    assert {"edit", "target", "detail", "ra_i", "critical_layer", "delta_params", "crosses_verdict"} <= payload[
        "suggestions"
    ][0].keys()
    assert "Accuracy is not measured" in payload["note"]
    code, out, _ = run_cli("suggest", EXAMPLES / "resnet18_w16.py", "--top", "2")
    # Batch sizes are no edit rows (method.md: each sample: they protect no sample); they stand in the whole-batch line.
    assert "Accuracy is not measured" in out and out.count("batch-size") == 0 and out.count("cut-skip") == 2
    assert "No batch size protects any one sample: a sample's bound" in out
    assert "smallest protected (90 % of samples like yours keeping at least 50 % of their detail hidden): 891953" in out
    assert (
        "Levels are read on energy, as `rankaudit check` reads them (reference: photographs' per-sample reference"
        in out
    )


def test_compare_shows_the_difference_and_exits_by_the_second(run_cli):
    code, out, _ = run_cli(
        "compare", EXAMPLES / "resnet18_w16.py", EXAMPLES / "resnet18_w16_cut3.py", "--format", "json"
    )
    payload = json.loads(out)
    assert code == 1 and payload["ra_i_delta"] == -7808 - -10240
    avgpool = next(layer for layer in payload["layers"] if layer["name"] == "avgpool")
    assert (avgpool["a"], avgpool["b"], avgpool["b_critical"]) == (-11392, -7808, True)
    code, out, _ = run_cli("compare", EXAMPLES / "fig2_a.py", EXAMPLES / "fig2_b.py")
    # Figure 2(b) has a certified deficit, but its 405 hidden directions hold almost none of a typical photograph's
    # energy: exposed like 2(a), exit 1.
    assert code == 1 and "RA-i -484 -> 405 (+889); verdict exposed -> exposed" in out
    assert "A  " in out and "exposed, rank bound 3,072 of 3,072 (deficit 0, 100 % recoverable)" in out
    assert "exposed, rank bound 2,667 of 3,072 (deficit 405, 86.8 % recoverable)" in out
    code, out, _ = run_cli("compare", EXAMPLES / "fig2_a.py", EXAMPLES / "fig2_b.py", "--fail-on", "never")
    assert code == 0
    code, _, err = run_cli("compare", EXAMPLES / "fig2_a.py", EXAMPLES / "nope.py")
    assert code == 2 and "does not exist" in err


TWO_CONVS = """
import torch.nn as nn
INPUT_SHAPE = (3, 16, 16)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(2, {width}, 3, padding=1, bias=False)
        self.fc = nn.Linear({width} * 256, 10)
    def forward(self, x):
        return self.fc(self.conv2(self.conv1(x).relu()).relu().flatten(1))
"""


def test_compare_explains_the_star_only_where_a_row_has_one(run_cli, tmp_path):
    # Widening conv2 changes its RA_i and fc's, while conv1 stays critical in both: no changed row is starred.
    for width in (4, 6):
        (tmp_path / f"w{width}.py").write_text(TWO_CONVS.format(width=width))
    code, out, _ = run_cli("compare", tmp_path / "w4.py", tmp_path / "w6.py", "--fail-on", "never")
    assert code == 0 and "  conv2 " in out and "RA-i 202 -> 202" in out
    assert "*" not in out and "critical in A, B" not in out
    _, out, _ = run_cli("compare", EXAMPLES / "fig2_a.py", EXAMPLES / "fig2_b.py", "--fail-on", "never")
    assert "*" in out and "(* critical in A, B)" in out


def test_narrowing_fig2_a_gives_fig2_b():
    """Figure 2(a) with one conv channel fewer is Figure 2(b): the suggestion must count it exactly so."""
    edit = by(suggest(str(EXAMPLES / "fig2_a.py")), "narrow", "conv1")
    fig2_b = audit(str(EXAMPLES / "fig2_b.py"))
    assert edit.detail == "out_channels 4 -> 3"
    assert (
        (edit.ra_i, edit.critical_layer, edit.verdict)
        == (fig2_b.ra_i, fig2_b.critical_layer, fig2_b.verdict)
        == (405, "conv1", "exposed")  # 405 directions hidden, 0.0003 % of a typical photograph's energy
    )
    assert edit.delta_params == fig2_b.parameters - audit(str(EXAMPLES / "fig2_a.py")).parameters


def test_suggest_html_is_a_section_of_the_report(run_cli, tmp_path):
    page = tmp_path / "review.html"
    code, _, _ = run_cli("suggest", EXAMPLES / "resnet18_w16.py", "--top", "4", "--format", "html", "-o", page)
    text = page.read_text()
    assert code == 0 and "Design suggestions" in text and "Accuracy is not measured" in text
    assert text.count("<code>layer2.0</code>") == 1 and "-7808" in text and "http" not in text
    assert "RA_i per layer" in text  # the rest of the model's report is there too


def test_certifying_batch_size_and_withheld_layers():
    # fig2-a holds 192 + 3364 = 3556 gradient values: two samples (6144 unknowns) exceed them, one does not.
    report = suggest(str(EXAMPLES / "fig2_a.py"))
    assert (report.rank_bound, report.certified_deficit, report.certifying_batch) == (3072, 0, 2)
    assert not [s for s in report.suggestions if s.edit == "batch-size"]
    assert (report.verdict, report.sample.rank_bound, report.sample.unknowns) == ("exposed", 3072, 3072)
    # Keeping fc's gradient local leaves conv1's 192 values: 2,880 directions hidden (6 % recoverable, protected on
    # directions), but the 192 visible ones carry 98.8 % of a typical photograph's energy: still exposed on
    # energy. Only keeping both layers local (nothing sent, no design) would: no withheld set is offered, and noise
    # is named as the way.
    assert report.certifying_withheld is None and report.noise_is_the_way
    fc_kept = audit(str(EXAMPLES / "fig2_a.py"), withheld_layers=["fc"]).identifiability
    assert fc_kept.certified_deficit == 2880 and fc_kept.sample.rank_bound == 192
    assert fc_kept.sample.certified_hidden_energy < 0.05 and fc_kept.sample.level == "exposed"
    # The batch as a whole, on energy as `check` reads its batch line: 3,556 values over B samples leave 90 % of
    # such batches half of their detail hidden from B = 4,584 on (0.78 directions per sample; the mean share
    # reached half at 4,497).
    assert report.protecting_batch == 4584
    assert audit(str(EXAMPLES / "fig2_a.py"), batch_size=4584).identifiability.verdict == "protected"
    assert audit(str(EXAMPLES / "fig2_a.py"), batch_size=4583).identifiability.verdict == "partial"


def test_resnet_certifying_batch_is_where_the_parameters_run_out(resnet_report):
    # Every one of ResNet-18-w16's 701,466 parameters and 2,400 running statistics (the BatchNorms' means and
    # variances, sent with a state_dict) is reachable: the bound certifies once B·3072 exceeds them.
    assert resnet_report.certifying_batch == (701_466 + 2_400) // 3072 + 1 == 230
    # No set of layers reaches protected, nor even partial on energy: the norms' 2,400 directly used parameters
    # and their 2,400 running statistics are sent whatever is withheld: all 3,072 directions.
    assert resnet_report.certifying_withheld is None and resnet_report.deficit_withheld is None
    from rankaudit.count.calls import trace_and_count
    from rankaudit.count.op_counting import Role

    traced = trace_and_count(load_model(str(EXAMPLES / "resnet18_w16.py"), None, device="meta").module, (3, 32, 32))
    records = [traced.record(node) for node in traced.order]
    layers = sorted({r.name.split("#")[0] for r in records if r.counting.role is Role.LAYER and r.counting.weights})
    assert len(layers) == 21
    every = audit(str(EXAMPLES / "resnet18_w16.py"), withheld_layers=layers).identifiability.sample
    assert every.rank_bound == 3072 and every.certified_hidden_energy < 0.05 and every.level == "exposed"
    assert "no set of layers that still shares some gradient makes each sample protected" in design.suggest_table(
        resnet_report
    )


def test_resnet_sample_needs_noise_and_the_review_names_the_least(resnet_report):
    """method.md: each sample: no edit, withheld set or batch size brings a ResNet-18-w16 sample within the ceiling (R(1) = |x|;
    the norms' 2,400 parameters stay shared): the review says noise is the way, with σ when DP options are given."""
    import dataclasses

    from rankaudit.bound.dp import least_noise

    assert resnet_report.noise_is_the_way and resnet_report.verdict == "exposed"
    assert all(s.verdict == "exposed" for s in resnet_report.suggestions)
    noise = least_noise(0.05, 0.01, 1.0, 1, 1e-5)
    text = design.suggest_table(dataclasses.replace(resnet_report, noise=noise))
    assert "No structural edit protects a sample" in text
    assert f"the least noise multiplier is σ = {noise.noise_multiplier:g}" in text
    assert "give DP options with --max-reconstruction" in design.suggest_table(resnet_report)


def test_suggest_prints_the_verdict_check_prints(run_cli):
    """The unedited model's verdict in `suggest` is `check`'s, both from the CLI: on energy. Figure 2(b) hides 405
    directions (partial on directions), 0.0003 % of a typical photograph's energy: exposed; with --exposed-below 0
    any hidden energy is partial, in both commands (and in compare)."""
    for flags, expected in (((), "exposed"), (("--exposed-below", "0"), "partial")):
        _, out, _ = run_cli("check", EXAMPLES / "fig2_b.py", "--format", "json", *flags)
        checked = json.loads(out)["verdict"]
        code, out, _ = run_cli("suggest", EXAMPLES / "fig2_b.py", "--format", "json", *flags)
        suggested = json.loads(out)
        assert code == 0 and suggested["verdict"] == checked == expected
        assert suggested["exposed_below"] == (0.0 if flags else 0.05)
        _, out, _ = run_cli("compare", EXAMPLES / "fig2_a.py", EXAMPLES / "fig2_b.py", "--format", "json", *flags)
        assert json.loads(out)["b"]["verdict"] == expected  # compare reads its levels where check does


FEATURES = """
import torch.nn as nn
INPUT_SHAPE = (16,)
class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 4)
        self.act = nn.LeakyReLU(0.2)
        self.fc2 = nn.Linear(4, 3)
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
"""


def test_feature_vector_withheld_search_reaches_protected_on_energy(tmp_path):
    """--data whose variance spreads over every direction: keeping fc1 local leaves a sample's input reaching the
    shared fc2 gradient through 4 values: at most 4 of 16 directions, and 90 % of the samples keep more than half
    of their detail hidden (73 % on average): protected. Without --data nothing is certified. The exact rank of the
    shared gradient's Jacobian sits under the bound."""
    import numpy as np
    import torch

    path = tmp_path / "features.py"
    path.write_text(FEATURES)
    samples = tmp_path / "samples.npy"
    np.save(samples, np.random.default_rng(0).standard_normal((4000, 16)))
    assert suggest(str(path)).certifying_withheld is None
    report = suggest(str(path), data=str(samples))
    assert report.verdict == "exposed" and report.sample.rank_bound == 16
    assert report.spectrum.startswith("--data: 4,000 samples from samples.npy")
    assert report.certifying_withheld == ["fc1"]
    kept = audit(str(path), withheld_layers=["fc1"], data=str(samples))
    sample = kept.identifiability.sample
    assert (sample.rank_bound, kept.verdict) == (4, "protected")
    # the mean share measured 0.73, not 0.75: 4,000 samples' covariance spreads its top eigenvalues a little
    assert 0.5 <= sample.certified_hidden_energy < sample.expected_hidden_energy == pytest.approx(0.75, abs=0.04)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.LeakyReLU(0.2), torch.nn.Linear(4, 3)).double()
    target = torch.tensor([1])

    def shared_gradient(x):
        output = torch.func.functional_call(model, dict(model.named_parameters()), (x[None],))
        loss = torch.nn.functional.cross_entropy(output, target)
        weights = [model[2].weight, model[2].bias]
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, weights, create_graph=True)])

    jacobian = torch.autograd.functional.jacobian(shared_gradient, torch.randn(16, dtype=torch.float64))
    measured = int(torch.linalg.matrix_rank(jacobian))
    assert 0 < measured <= sample.rank_bound == 4  # measured 4 at these weights


POOLED_FEATURES = """
import torch.nn as nn
INPUT_SHAPE = (16,)
class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(x.reshape(-1, 4, 4).mean(-1))
"""


def test_suggest_reads_data_as_check_does(run_cli, tmp_path):
    """A 16-value input pooled to 4 before the only layer: R_s = 4. Without --data nothing is certified (exposed);
    samples whose variance spreads over every direction keep more than half hidden (protected); samples whose energy
    lies in 2 directions leave nothing certified hidden (exposed). `suggest` --data gives the verdict `check` --data
    gives, and names noise as the way where no structure protects."""
    import numpy as np

    model = tmp_path / "pooled.py"
    model.write_text(POOLED_FEATURES)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "two.npy", rng.standard_normal((200, 2)) @ rng.standard_normal((2, 16)))
    np.save(tmp_path / "spread.npy", rng.standard_normal((4000, 16)))
    for flags, expected, hidden in (
        ((), "exposed", 1e-9),
        (("--data", tmp_path / "spread.npy"), "protected", 0.5),
        (("--data", tmp_path / "two.npy"), "exposed", 1e-9),
    ):
        _, out, _ = run_cli("check", model, "--format", "json", *flags)
        checked = json.loads(out)
        _, out, _ = run_cli("suggest", model, "--format", "json", *flags)
        suggested = json.loads(out)
        assert suggested["verdict"] == checked["verdict"] == expected
        assert suggested["sample"]["rank_bound"] == checked["identifiability"]["sample"]["rank_bound"] == 4
        assert suggested["sample"]["certified_hidden_energy"] == pytest.approx(
            checked["identifiability"]["sample"]["certified_hidden_energy"], abs=1e-12
        )
        assert (checked["identifiability"]["sample"]["certified_hidden_energy"] >= hidden) == (expected != "exposed")
        assert suggested["noise_is_the_way"] == (expected == "exposed")
