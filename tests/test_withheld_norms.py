"""Normalisation layers kept on the client (FedBN): withheld-layers takes norms, modules and single parameters; the
bound leaves a withheld norm's scale and shift out of what the server reads, never more than is withheld, and the
exact rank check measures the same parameters."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from conftest import APPS, line_of

from rankaudit.audit import audit
from rankaudit.errors import UsageError
from rankaudit.verify.client import draw_labels
from rankaudit.verify.model import build_real_model
from rankaudit.verify.rank import jacobian as rank

pytestmark = pytest.mark.usefixtures("no_flower_configuration")

# A BatchNorm in front of a 1x1 convolution the client keeps: the norm's scale and shift read the input itself
# (36 unknowns), so whether they are sent decides how much of it the server can read.
NORM_FIRST = textwrap.dedent('''
    """A normalisation that reads the input, a convolution and a classifier."""
    import torch
    import torch.nn as nn

    INPUT_SHAPE = (4, 3, 3)


    class NormFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn1 = nn.BatchNorm2d(4)
            self.conv1 = nn.Conv2d(4, 2, 1)
            self.fc = nn.Linear(18, 3)

        def forward(self, x):
            return self.fc(torch.tanh(self.conv1(self.bn1(x))).flatten(1))
''')


@pytest.fixture
def norm_first(tmp_path):
    path = tmp_path / "norm_first.py"
    path.write_text(NORM_FIRST)
    return path


def _measured(spec, withheld: list[str]) -> int:
    """rank(∂g/∂x) of the gradient of the parameters sent, at one uniform random sample and real weights."""
    model, _ = build_real_model(str(spec), (4, 3, 3), 0)
    images = torch.rand((1, 4, 3, 3), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = draw_labels(1, "cross-entropy", 3, 0)
    shared = rank.shared_parameter_names(model, withheld_layers=withheld)
    return rank.measure(model, images, labels, shared, loss="cross-entropy").rank


def test_a_withheld_norm_lowers_the_bound_and_the_measured_rank_stays_under_it(norm_first, run_cli):
    def bound(withheld):
        return audit(str(norm_first), withheld_layers=withheld).identifiability.rank_bound

    sent, norm_kept = bound(["conv1"]), bound(["conv1", "bn1"])
    # Withholding only lowers the bound; a norm's scale alone leaves its shift sent, between the two.
    assert norm_kept < sent and norm_kept <= bound(["conv1", "bn1.weight"]) <= sent
    # A running statistic the client sends moves with the batch's mean of the norm's input (4 channels): kept back
    # by name, those 4 values leave the bound.
    assert bound(["conv1", "bn1.running_mean"]) == sent - 4
    measured_sent = _measured(norm_first, ["conv1"])
    assert measured_sent <= sent
    # The CLI's exact check takes the same withheld set: the norm's parameters are not among those it measures.
    code, out, err = run_cli(
        norm_first, "--withheld-layers", "conv1,bn1", "--verify", "rank", "--samples", "1", "--format", "json"
    )
    payload = json.loads(out)
    verification = payload["verification"]["rank"]
    assert verification["shared_parameters"] == ["fc.weight", "fc.bias"], err
    assert verification["rank"] <= payload["identifiability"]["rank_bound"] == norm_kept
    # Measured, the server reads less of the sample once the norm stays local: the static figure's direction.
    assert verification["rank"] < measured_sent


def test_names_withheld_layers_cannot_stand_for_are_refused(norm_first):
    with pytest.raises(UsageError) as raised:
        audit(str(norm_first), withheld_layers=["bn9"])
    assert "no layer, module or parameter named bn9" in str(raised.value)
    assert "bn1" in str(raised.value)  # the normalisation is offered among the names
    with pytest.raises(UsageError, match="no trainable parameter belongs to bn9"):
        rank.shared_parameter_names(build_real_model(str(norm_first), (4, 3, 3), 0)[0], withheld_layers=["bn9"])


def test_fedbn_app_judges_its_local_norms_as_withheld(run_cli, monkeypatch):
    app = APPS / "fedbn"
    client = app / "fedbn_app" / "client.py"
    monkeypatch.chdir(APPS)
    given = ("--input-shape", "1,8,8", "--local-samples", "32", "--format", "json")
    code, out, err = run_cli("fedbn", *given)
    read = json.loads(out)
    deployment = read["deployment"]
    filtered = line_of(client, "not in key")
    assert [setting["value"] for setting in deployment["settings"] if setting["setting"] == "withheld-layers"] == [
        "bn1,bn2"
    ], deployment["settings"]
    assert any(
        note.startswith(f"LocalNormClient.get_parameters at fedbn_app/client.py:{filtered} keeps the normalisation")
        for note in deployment["notes"]
    )
    # The same model file and round, every parameter sent, and with the norms named by hand.
    model = "fedbn/fedbn_app/models.py:NormNet"
    round_flags = ("-b", "20", "--local-epochs", "2", "--server-rounds", "8", "--lr", "0.03")
    flags = (*given, *round_flags, "--model-arg", "num_classes=6")
    code, out, err = run_cli(model, *flags)
    sent = json.loads(out)
    code, out, err = run_cli(model, *flags, "--withheld-layers", "bn1,bn2")
    by_hand = json.loads(out)
    norms = 4 * (4 + 16)  # bn1's and bn2's scale and shift, running mean and running variance
    assert (
        read["identifiability"]["round"]["update_values"] == sent["identifiability"]["round"]["update_values"] - norms
    )
    assert read["identifiability"]["round"] == by_hand["identifiability"]["round"]
    assert read["identifiability"]["rank_bound"] <= sent["identifiability"]["rank_bound"]
    levels = ["protected", "partial", "exposed"]
    assert levels.index(read["verdict"]) <= levels.index(sent["verdict"])
