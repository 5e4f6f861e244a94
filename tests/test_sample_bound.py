"""method.md: each sample: the per-sample bound R_s = min(|x|, |θ_s|, E_i·R(1)), its verdict and its findings."""

import json
import textwrap

import numpy as np
import pytest
import torch
from conftest import EXAMPLES
from torch import nn

from rankaudit.audit import audit
from rankaudit.bound.identifiability import round_identifiability, sample_identifiability
from rankaudit.count.calls import trace_and_count
from rankaudit.design.round_review import round_review
from rankaudit.report import table
from rankaudit.report.json import to_dict
from rankaudit.settings.round import DPSettings, Round

MLP = EXAMPLES / "mlp_bias.py"


def traced_example(name: str):
    from rankaudit.model.load import load_model

    loaded = load_model(str(EXAMPLES / f"{name}.py"), None, device="meta")
    return trace_and_count(loaded.module, loaded.input_shape)


class PooledMLP(nn.Module):
    """3x8x8 -> 2x2 average pool (48 values) -> Linear 6 -> ReLU -> Linear 300: R(1) = 48 with every gradient
    shared (the pooled tensor is the cut), 6 with fc1 withheld (the hidden units are), |θ_s| = 6·300 + 300."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AvgPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(48, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 300)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(self.pool(x)))))


def traced_pooled():
    with torch.device("meta"):
        model = PooledMLP()
    return trace_and_count(model, (3, 8, 8))


# The MLP of method.md: each sample (examples/mlp_bias.py): |x| = 3·8·8 = 192; |θ_s| = 192·6 + 6 + 6·10 + 10 = 1,228; R(1) = 192
# (the input feeds fc1's 1,158-value gradient directly). R_s = min(192, 1,228, E·192) = 192 for every round:
# exposed, while the round's bound at N = 32, B = 8, E = 1 is min(6,144, 1,228, 4·R(8)) = 1,228 (ρ 0.20).
@pytest.mark.parametrize(
    "round_",
    [
        Round(),
        Round(batch_size=8),
        Round(batch_size=8, local_samples=32),
        Round(batch_size=4, local_samples=16, local_epochs=2),
        Round(batch_size=32, local_samples=5000, clients=10),
    ],
)
def test_mlp_sample_bound_is_the_whole_sample_at_every_round(round_):
    bound = round_identifiability(traced_example("mlp_bias"), round_)
    sample = bound.sample
    assert (sample.rank_bound, sample.unknowns, sample.single_sample_bound) == (192, 192, 192)
    assert sample.level == "exposed" and sample.recoverable_fraction == 1.0 and sample.binding == "unknowns"
    assert sample.steps_per_sample == round_.local_epochs


def test_mlp_round_of_the_issue_is_protected_as_a_batch_only():
    bound = round_identifiability(traced_example("mlp_bias"), Round(batch_size=8, local_samples=32))
    assert (bound.rank_bound, bound.unknowns, bound.verdict) == (1228, 6144, "protected")
    assert bound.sample.level == "exposed"


def test_fig2_b_sample_bound_is_r1_times_epochs_capped():
    traced = traced_example("fig2_b")  # method.md: the bound: R(1) = 2,667 of 3,072; |θ_s| = 2,667 too
    for round_ in (Round(), Round(batch_size=8), Round(batch_size=8, local_samples=16)):
        sample = sample_identifiability(traced, round_)
        assert (sample.rank_bound, sample.binding, sample.level) == (2667, "steps", "partial")
        assert sample.recoverable_fraction == pytest.approx(2667 / 3072)
    sample = sample_identifiability(traced, Round(batch_size=8, local_epochs=2))
    # min(3,072, 2,667, 2·2,667): the update's values bind
    assert (sample.rank_bound, sample.binding, sample.steps_per_sample) == (2667, "update-values", 2)


def test_withheld_gradients_follow_the_round_rule_per_sample():
    traced = traced_pooled()
    withheld = {"withheld_layers": ["fc1"]}
    # FedSGD: the one step is the last, only fc2's gradient leaves: R_shared(1) = 6 at any batch size.
    for batch in (1, 8):
        sample = sample_identifiability(traced, Round(batch_size=batch), **withheld)
        assert (sample.rank_bound, sample.single_sample_bound, sample.binding) == (6, 6, "steps")
        assert sample.level == "protected"
    # N = B = 1, E = 3: the sample is read by all three steps; the first two carry fc1 on (R_all(1) = 48) and the
    # last does not (6): 2·48 + 6 = 102 of 192.
    sample = sample_identifiability(traced, Round(batch_size=1, local_epochs=3), **withheld)
    assert (sample.rank_bound, sample.steps_per_sample, sample.single_sample_bound) == (102, 3, 48)
    assert sample.binding == "steps" and sample.level == "partial"
    # N = 2, B = 1, E = 3: the first sample is never in the last step: 3·48 = 144.
    sample = sample_identifiability(traced, Round(batch_size=1, local_samples=2, local_epochs=3), **withheld)
    assert sample.rank_bound == 144
    # every gradient shared: 3·48 = 144 whatever the order; one epoch: 48
    assert sample_identifiability(traced, Round(batch_size=1, local_epochs=3)).rank_bound == 144
    assert sample_identifiability(traced, Round(batch_size=4, local_samples=8)).rank_bound == 48


def test_update_values_bind_when_few_gradients_are_shared():
    # mlp_bias with only fc2 shared: |θ_s| = 70 < |x| = 192 <= E·R_all(1) = 192
    traced = traced_example("mlp_bias")
    sample = sample_identifiability(traced, Round(batch_size=8, local_samples=16), shared_layers=["fc2"])
    assert (sample.rank_bound, sample.binding, sample.level) == (70, "update-values", "protected")


def test_sample_bound_uses_the_round_cache():
    traced = traced_example("mlp_bias")
    cache = {}
    round_identifiability(traced, Round(batch_size=8, local_samples=32), cache=cache)
    assert (1, False) in cache and cache["update_values"] == 1228
    before = dict(cache)
    round_identifiability(traced, Round(batch_size=4, local_samples=32, local_epochs=3), cache=cache)
    assert cache[(1, False)] is before[(1, False)]


def test_fedsgd_batch_one_sample_level_equals_the_batch_level():
    for name in ("fig2_b", "fig2_e", "mlp_bias", "lenet"):
        bound = round_identifiability(traced_example(name), Round())
        assert bound.sample.rank_bound == bound.rank_bound and bound.sample.unknowns == bound.unknowns
        assert bound.sample.level == bound.verdict


# ---- FedSGD at batch 1: nothing changes (the sample is the batch) -----------------------------------------------


@pytest.mark.parametrize("example", sorted(path.name for path in EXAMPLES.glob("*.py")))
def test_fedsgd_batch_one_reads_as_before_on_every_example(example):
    result = audit(str(EXAMPLES / example))
    bound, payload = result.identifiability, to_dict(result)
    assert (bound.sample.rank_bound, bound.sample.unknowns) == (bound.rank_bound, bound.unknowns)
    assert result.verdict == bound.verdict == bound.sample.level == payload["verdict"]
    assert payload["identifiability"]["rank_bound"] == payload["identifiability"]["sample"]["rank_bound"]
    assert result.summary.startswith(
        f"Rank bound {bound.rank_bound:,} of {bound.unknowns:,} unknowns: {bound.verdict}."
    )
    assert "Bound (each sample)" not in table.render([result]) and "as a whole" not in result.summary


# ---- the MLP round (the per-sample section's first measured row) -------------------------------------------------


def test_mlp_round_fails_per_sample_with_the_round_line_beside_it(run_cli):
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8)
    assert code == 1
    assert (
        "Bound (each sample): rank <= 192 of 192 unknowns per sample (100 % of its directions recoverable): "
        "exposed. Each sample is read by 1 local step; one step's gradient can determine one sample (at "
        "batch size 1 no cut through the graph certifies anything)"
    ) in out
    assert (
        "The round as a whole: rank <= 1,228 of 6,144 (20 %): no attack recovers all 32 samples at once; this is "
        "no guarantee for any one of them."
    ) in out
    assert "Sample readout: fc1 (Linear with bias, 6 units, ReLU) reads each sample's 192-value input" in out
    assert "Policy: FAIL: verdict is exposed (each sample)" in out
    assert out.index("Bound (each sample)") < out.index("The round as a whole")
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    # the batch/round fields keep their meaning: 1,228 of 6,144 as a whole; read on energy (90 % of rounds keep
    # 0.7 % of the 32 samples' detail hidden; 0.9 % on average), even the round as a whole is exposed
    bound = payload["identifiability"]
    assert (bound["rank_bound"], bound["unknowns"], bound["verdict"]) == (1228, 6144, "exposed")
    assert bound["certified_hidden_energy"] == pytest.approx(0.0070, abs=0.0005)
    assert {key: bound["sample"][key] for key in list(bound["sample"])[:10]} == {
        "rank_bound": 192,
        "unknowns": 192,
        "recoverable_fraction": 1.0,
        "level": "exposed",
        "steps_per_sample": 1,
        "single_sample_bound": 192,
        "binding": "unknowns",
        "certified_hidden_energy": 0.0,
        "visible_psnr_ceiling": None,
        "rounds": 1,
    }
    # one round counted (the server rounds were not given), no BatchNorm to couple the samples
    assert (bound["sample"]["rounds"], bound["sample"]["rounds_known"], bound["sample"]["round_bound"]) == (
        1,
        False,
        192,
    )
    assert bound["sample"]["batch_statistics"] == []
    (readout,) = payload["bias_readout"]
    assert (readout["name"], readout["units"], readout["width"], readout["reads_input"], readout["exact"]) == (
        "fc1",
        6,
        192,
        True,
        True,
    )
    assert (readout["batch_size"], readout["samples"], readout["whole_batch"]) == (8, 32, False)
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, "--quiet")
    assert code == 1 and f"{MLP}: exposed (each sample), " in out and out.count("\n") == 1


def test_mlp_round_sarif_and_html_read_each_sample(run_cli, tmp_path):
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, "--format", "sarif")
    results = json.loads(out)["runs"][0]["results"]
    verdict = next(r for r in results if r["ruleId"] == "RA004")
    assert verdict["properties"]["sample"]["level"] == "exposed" and verdict["properties"]["rank_bound"] == 1228
    readout = next(r for r in results if r["ruleId"] == "RA010")
    assert readout["properties"]["layer"] == "fc1" and readout["properties"]["units"] == 6
    # The location is the forward's call of fc1 (line 17 of the file today), read from the file so a reformat moves both.
    call_line = next(i for i, line in enumerate(MLP.read_text().splitlines(), 1) if "self.fc1(" in line)
    assert call_line == 17 and readout["locations"][0]["physicalLocation"]["region"]["startLine"] == call_line
    rules = {rule["id"]: rule for rule in json.loads(out)["runs"][0]["tool"]["driver"]["rules"]}
    assert rules["RA010"]["name"] == "bias-readout"
    page = tmp_path / "m.html"
    code, _, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, "--format", "html", "-o", page)
    text = page.read_text()
    assert code == 1 and "of 192 unknowns per sample" in text and "The round as a whole: rank &lt;= 1,228" in text
    assert "Sample readout (RA010): fc1" in text
    assert (
        "The directions the round&#39;s update can show hold all of a sample&#39;s detail: nothing of it is certified hidden"
        in text
    )
    assert "R_s = min(|x|, |θ_s|, E_i·R(1)) = 192 of 192" in text


# ---- the twelve-app situation: a real CNN at a real round --------------------------------------------------------


def test_cnn6_at_a_real_round_is_no_longer_protected():
    # N = 5,000, B = 32, E = 1: the round's bound is the 125,456 update values of 15,360,000 unknowns (ρ 0.008,
    # 25 of each sample's principal directions as a whole: partial on energy); each sample: R(1) = 3,072 = |x|
    # (method.md: numerical check: full rank): exposed.
    result = audit(str(EXAMPLES / "cnn6.py"), round_=Round(batch_size=32, local_samples=5000))
    bound = result.identifiability
    assert (bound.rank_bound, bound.unknowns, bound.verdict) == (125_456, 15_360_000, "partial")
    assert (bound.sample.rank_bound, bound.sample.unknowns, result.verdict) == (3072, 3072, "exposed")
    assert not result.policy.passed


# ---- structure or noise (method.md: DP + method.md: each sample) -------------------------------------------------------------------------


def test_client_noise_carries_a_sample_the_structure_exposes(run_cli):
    dp = ("--dp-noise", 4, "--max-reconstruction", 0.05)  # q = B/N = 0.25, T = 4 from the round: B(0.01) = 0.0144
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, *dp, "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["verdict"] == "exposed"
    assert payload["policy"]["carried_by"] == "noise" and payload["policy"]["reasons"] == []
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, *dp)
    assert code == 0 and "carried by the noise, not the structure: the architecture leaves each sample exposed" in out
    code, out, _ = run_cli(MLP, "--local-samples", 32, "--batch-size", 8, *dp, "--format", "sarif")
    verdict = next(r for r in json.loads(out)["runs"][0]["results"] if r["ruleId"] == "RA004")
    assert "The policy passes, carried by the noise, not the structure" in verdict["message"]["text"]
    # the same noise added by the server bounds the released model, never what the server sees
    code, out, _ = run_cli(
        MLP, "--local-samples", 32, "--batch-size", 8, *dp, "--noise-by", "server", "--format", "json"
    )
    payload = json.loads(out)
    assert code == 1 and payload["policy"]["carried_by"] == "none"
    assert "it bounds what the released model reveals, not what the server sees" in payload["policy"]["reasons"][0]
    assert payload["dp"]["noise_by"] == "server" and "not what the server sees" in payload["summary"] + out
    # noise above the ceiling carries nothing
    code, out, _ = run_cli(
        MLP,
        "--local-samples",
        32,
        "--batch-size",
        8,
        "--dp-noise",
        4,
        "--max-reconstruction",
        0.012,
        "--format",
        "json",
    )
    assert code == 1 and json.loads(out)["policy"]["carried_by"] == "none"


def test_structure_carries_a_protected_sample(tmp_path):
    # Feature vectors given as --data whose variance spreads over every direction: 4-fold pooling leaves R_s = 10 of
    # 40, and 90 % of the samples keep more than half of their detail hidden.
    model = tmp_path / "features.py"
    model.write_text(
        "import torch.nn as nn\nINPUT_SHAPE = (1, 40)\nclass Features(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.pool = nn.AvgPool1d(4)\n        self.fc = nn.Linear(10, 3)\n"
        "    def forward(self, x):\n        return self.fc(self.pool(x).flatten(1))\n"
    )
    samples = tmp_path / "samples.npy"
    np.save(samples, np.random.default_rng(0).standard_normal((4000, 1, 40)))
    dp = DPSettings(noise_multiplier=4.0, max_reconstruction=0.05)
    result = audit(str(model), round_=Round(dp=dp), data=str(samples))
    assert result.verdict == "protected" and result.policy.passed and result.policy.carried_by == "structure"


# ---- the static bias readout -------------------------------------------------------------------------------------

READOUT_MODELS = """
import torch.nn as nn
INPUT_SHAPE = (3, 8, 8)
class OnePositionConv(nn.Module):      # a conv whose output is one position reads the whole image per unit
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=8)
        self.act = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(4, 10)
    def forward(self, x):
        return self.fc(self.flatten(self.act(self.conv(x))))
class Features(nn.Module):             # no bias on fc1: the readout moves to fc2, which reads features
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(192, 6, bias=False)
        self.fc2 = nn.Linear(6, 5)
        self.fc3 = nn.Linear(5, 10)
        self.act = nn.ReLU()
    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(self.flatten(x))))))
class Spatial(nn.Module):              # a conv at many positions, a Tanh: no readout
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3)
        self.fc1 = nn.Linear(144, 6)
        self.act = nn.Tanh()
        self.flatten = nn.Flatten()
        self.fc2 = nn.Linear(6, 10)
    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(nn.functional.relu(self.conv(x))))))
"""


@pytest.fixture(scope="module")
def readout_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("readout") / "readout.py"
    path.write_text(textwrap.dedent(READOUT_MODELS))
    return str(path)


def test_readout_finds_one_position_convs_and_feature_layers_only(readout_file):
    (conv,) = audit(f"{readout_file}:OnePositionConv", batch_size=4).bias_readout
    assert (conv.name, conv.units, conv.width, conv.reads_input, conv.whole_batch) == ("conv", 4, 192, True, True)
    (fc2,) = audit(f"{readout_file}:Features", batch_size=8).bias_readout
    assert (fc2.name, fc2.units, fc2.width, fc2.reads_input, fc2.whole_batch) == ("fc2", 5, 6, False, False)
    assert "its 6 features at this layer" in fc2.message
    assert audit(f"{readout_file}:Spatial").bias_readout == []
    # a withheld layer's bias is never sent: no finding
    assert audit(str(MLP), withheld_layers=["fc1"]).bias_readout == []


def test_leaky_relu_readout_is_flagged_as_not_exact(tmp_path):
    path = tmp_path / "leaky.py"
    path.write_text(textwrap.dedent(READOUT_MODELS.replace("self.act = nn.ReLU()", "self.act = nn.LeakyReLU()")))
    (finding,) = audit(f"{path}:OnePositionConv").bias_readout
    assert not finding.exact and "up to its negative slope" in finding.message


# ---- design review per sample ------------------------------------------------------------------------------------


def test_round_review_epochs_per_sample():
    # PooledMLP: R(1) = 48 of |x| = 192, |θ_s| = 2,394. On directions E·48 <= 96 would be protected up to E = 2;
    # on energy, as `check` reads it, one epoch's 48 directions already show over half of a typical 3x8x8
    # photograph's energy: no E protects a sample, and N and C never do.
    review = round_review(traced_pooled(), Round(batch_size=4, local_samples=8, local_epochs=3))
    assert (review.verdict, review.rank_bound, review.unknowns) == ("exposed", 144, 192)
    settings = {setting.knob: setting for setting in review.settings}
    assert settings["local-epochs"].value is None and "R(1) = 48 of 192" in settings["local-epochs"].explanation
    from rankaudit.bound.energy import hidden_share, photo_eigenvalues
    from rankaudit.settings.levels import DEFAULT_EXPOSED_BELOW

    one_epoch = hidden_share(photo_eigenvalues(3, 8, 8), 48)
    assert one_epoch < 0.5 and hidden_share(photo_eigenvalues(3, 8, 8), 144) < DEFAULT_EXPOSED_BELOW
    assert settings["local-samples"].value is None and "N does not enter" in settings["local-samples"].explanation
    assert settings["clients"].value is None and not settings["clients"].unbounded


def test_suggest_says_when_only_noise_protects_a_sample(run_cli):
    code, out, _ = run_cli("suggest", EXAMPLES / "fig2_d.py", "--format", "json")
    payload = json.loads(out)
    # Withholding fc leaves 252 of 3,072 directions per sample (protected on directions), but they show all but
    # 0.9 % of a typical photograph's energy: on energy only noise protects a sample of fig2_d.
    assert payload["noise_is_the_way"] is True and payload["certifying_withheld"] is None
    code, out, _ = run_cli("suggest", str(EXAMPLES / "strided_stem.py"))
    # 452 of 3,072 directions per sample (14.7 %: protected on directions) show all but under 0.01 % of the detail of one
    # photograph in ten: exposed, as `check` says, and noise is the way.
    assert (
        "452 of 3,072 (14.7 % recoverable, 90 % of samples like yours keep 0.01 % of their detail hidden), exposed"
        in out
    )
    assert "No structural edit protects a sample" in out
    code, out, _ = run_cli("suggest", MLP, "--local-samples", 32, "--batch-size", 8)
    assert "stops the exact bias readout of a sample" in out and "Bias readout: fc1" in out


def test_batchnorm_models_say_which_mode_the_bound_covers():
    """Training mode by default (the bound counts the batch statistics' paths); eval mode named as such."""
    train = audit(str(EXAMPLES / "resnet18_w16.py"), batch_size=2).identifiability.sample
    assert train.batch_statistics[:2] == ["bn1", "layer1.0.bn1"]
    assert (
        "BatchNorm in training mode: the batch statistics of bn1, layer1.0.bn1, layer1.0.bn2 ... carry each sample "
        "into the other 1 sample of its batch, and the bound counts these paths" in train.covers
    )
    evaluated = audit(str(EXAMPLES / "resnet18_w16.py"), round_=Round(batch_size=2, bn_mode="eval"))
    assert evaluated.identifiability.sample.batch_statistics == []
    assert "BatchNorm in eval mode (bn1, layer1.0.bn1, layer1.0.bn2 ...: running statistics, --bn-mode eval)" in (
        evaluated.identifiability.sample.covers
    )
    assert "BatchNorm" not in audit(str(EXAMPLES / "resnet2_tiny.py"), batch_size=2).identifiability.sample.covers


def test_a_frozen_weight_sends_no_row_to_read_out(tmp_path):
    path = tmp_path / "frozen.py"
    path.write_text(
        textwrap.dedent(READOUT_MODELS)
        + textwrap.dedent("""
        class FrozenWeight(OnePositionConv):
            def __init__(self):
                super().__init__()
                self.conv.weight.requires_grad_(False)
    """)
    )
    assert audit(f"{path}:FrozenWeight").bias_readout == []
    assert len(audit(f"{path}:OnePositionConv").bias_readout) == 1
