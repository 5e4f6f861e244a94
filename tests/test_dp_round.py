"""Issue 22: DP follows the round (q and T from N, B, E, the server rounds and the client sampling), and `suggest`
reads the configuration as `check` does."""

from __future__ import annotations

import json
import re
import shutil
import textwrap

import pytest

pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")

from conftest import EXAMPLES

from rankaudit.bound import dp
from rankaudit.settings.round import DPSettings, Round, build_round, dp_for_round, round_sampling

# The issue's example: --local-samples 4000 --batch-size 32 --dp-noise 1.
ISSUE_ROUND = ("--local-samples", "4000", "--batch-size", "32", "--dp-noise", "1")


@pytest.mark.parametrize(
    "round_, level, rate, steps",
    [
        (Round(), "sample", 1.0, 1),  # FedSGD: the old defaults
        (Round(batch_size=32, local_samples=4000), "sample", 0.008, 125),
        (Round(batch_size=32, local_samples=100, local_epochs=3), "sample", 0.32, 12),  # ⌈100/32⌉ = 4 steps an epoch
        (Round(batch_size=32, local_samples=4000, server_rounds=10), "sample", 0.008, 1250),
        (Round(clients=10, available_clients=100, server_rounds=50), "client", 0.1, 50),
        (Round(clients=10, server_rounds=3), "client", 1.0, 3),  # all available clients take part
    ],
)
def test_q_and_t_come_from_the_round(round_, level, rate, steps):
    got_rate, rate_source, got_steps, steps_source = round_sampling(round_, level)
    assert got_rate == pytest.approx(rate) and got_steps == steps
    assert rate_source.startswith("round: ") and steps_source.startswith("round: ")


def test_sources_name_the_round_values():
    settings = dp_for_round(Round(batch_size=32, local_samples=4000, server_rounds=2), DPSettings(1.0), {})
    assert settings.sample_rate_source == "round: B/N = 32/4000"
    assert settings.steps_source == "round: E·⌈N/B⌉ = 1·125 local steps × 2 server rounds"
    assert (settings.sample_rate, settings.steps, settings.notes) == (0.008, 250, ())
    client = dp_for_round(Round(clients=5, available_clients=20, server_rounds=1), DPSettings(1.0, level="client"), {})
    assert client.sample_rate == 0.25 and client.steps == 1
    assert client.sample_rate_source == "round: C/M = 5/20 clients sampled per round"
    assert client.steps_source == "round: 1 server round"


def test_a_given_value_is_used_and_a_disagreement_is_one_note():
    round_ = Round(batch_size=32, local_samples=4000)
    settings = dp_for_round(
        round_, DPSettings(1.0, sample_rate=0.01, steps=125), {"sample_rate": "--dp-sample-rate", "steps": "--dp-steps"}
    )
    assert (settings.sample_rate, settings.steps) == (0.01, 125)  # the given values win
    assert settings.sample_rate_source == "--dp-sample-rate" and settings.steps_source == "--dp-steps"
    assert settings.notes == (
        "q = 0.01 from --dp-sample-rate used as given; the round gives q = 0.008 (B/N = 32/4000)",
    )  # T agrees: not mentioned
    agreeing = dp_for_round(round_, DPSettings(1.0, sample_rate=0.008), {"sample_rate": "--dp-sample-rate"})
    assert agreeing.notes == () and agreeing.steps == 125


def test_build_round_derives_once_for_every_step():
    round_ = build_round({"batch_size": 32, "local_samples": 4000}, None, dp=DPSettings(1.0))
    assert round_.dp.sample_rate == 0.008 and round_.dp.steps == 125
    assert build_round({"batch_size": 4}, None).dp is None


def test_the_issue_example_bounds_the_round_not_one_full_batch():
    """q = 32/4000, T = 125 at σ = 1: ε 0.61 (Opacus' PRV accountant, an independent implementation: 0.624), not the
    4.38 of q = 1, T = 1."""
    settings = dp_for_round(Round(batch_size=32, local_samples=4000), DPSettings(1.0), {})
    bound = dp.dp_bound(settings, curve=False)
    assert bound.epsilon == pytest.approx(0.614, abs=0.01)
    assert bound.bounds["0.01"] == pytest.approx(0.0144, abs=5e-4)
    assert bound.bounds["0.1"] == pytest.approx(0.124, abs=2e-3)
    assert bound.sample_rate_source == "round: B/N = 32/4000" and bound.notes == []
    opacus = pytest.importorskip(
        "opacus.accountants", reason="needs Opacus, not installed: not a test extra (pip install opacus, as CI does)"
    )
    accountant = opacus.PRVAccountant()
    accountant.history = [(1.0, 0.008, 125)]
    assert bound.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=0.03)


def test_cli_json_and_table_carry_q_t_and_their_sources(run_cli):
    code, out, _ = run_cli(EXAMPLES / "fig2_a.py", *ISSUE_ROUND, "--fail-on", "never", "--format", "json")
    section = json.loads(out)["dp"]
    assert code == 0 and section["sample_rate"] == 0.008 and section["steps"] == 125
    assert section["sample_rate_source"] == "round: B/N = 32/4000"
    assert section["steps_source"] == "round: E·⌈N/B⌉ = 1·125 local steps × 1 server round"
    assert section["notes"] == [] and section["epsilon"] == pytest.approx(0.614, abs=0.01)
    _, table, _ = run_cli(EXAMPLES / "fig2_a.py", *ISSUE_ROUND, "--fail-on", "never")
    assert (
        "  σ 1, clip 1; q 0.008 (round: B/N = 32/4000); T 125 (round: E·⌈N/B⌉ = 1·125 local steps × 1 server "
        "round)" in table
    )
    assert "note:" not in table


def test_cli_flag_that_disagrees_is_used_and_flagged_once(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "fig2_a.py", *ISSUE_ROUND, "--dp-steps", "1000", "--fail-on", "never", "--format", "json"
    )
    section = json.loads(out)["dp"]
    assert section["steps"] == 1000 and section["steps_source"] == "--dp-steps" and section["sample_rate"] == 0.008
    assert section["notes"] == [
        "T = 1,000 from --dp-steps used as given; the round gives T = 125 (E·⌈N/B⌉ = 1·125 "
        "local steps × 1 server round)"
    ]
    _, table, _ = run_cli(EXAMPLES / "fig2_a.py", *ISSUE_ROUND, "--dp-steps", "1000", "--fail-on", "never")
    assert table.count("note: T = 1,000 from --dp-steps used as given") == 1


def test_client_level_from_the_config(run_cli, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent("""
        [tool.rankaudit]
        fail-on = "never"
        [tool.rankaudit.round]
        clients = 10
        available-clients = 100
        server-rounds = 50
        [tool.rankaudit.dp]
        noise = 1.0
        level = "client"
        sample-rate = 0.2
    """)
    )
    model = tmp_path / "net.py"
    shutil.copy(EXAMPLES / "fig2_a.py", model)
    code, out, _ = run_cli(model, "--format", "json")
    section = json.loads(out)["dp"]
    assert code == 0 and section["level"] == "client" and section["steps"] == 50
    assert section["steps_source"] == "round: 50 server rounds"
    assert section["sample_rate"] == 0.2 and section["sample_rate_source"] == "[tool.rankaudit.dp] sample-rate"
    assert section["notes"] == [
        "q = 0.2 from [tool.rankaudit.dp] sample-rate used as given; the round gives q = 0.1 "
        "(C/M = 10/100 clients sampled per round)"
    ]


# --- suggest reads the configuration as check does -----------------------------------------------------------------

DENSE_NO_SHAPE = '''
import torch.nn as nn


class Dense(nn.Module):
    """Every layer dense; no INPUT_SHAPE: the shape comes from [[tool.rankaudit.models]]."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x):
        return self.fc2(self.fc1(x.flatten(1)).relu())
'''


def _suggest_project(tmp_path, extra: str = "") -> str:
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent("""
        [tool.rankaudit]
        [[tool.rankaudit.models]]
        path = "models/*.py"
        input-shape = [3, 2, 2]
        [tool.rankaudit.round]
        batch-size = 4
    """)
        + textwrap.dedent(extra)
    )
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "dense.py"
    model.write_text(DENSE_NO_SHAPE)
    return str(model)


def test_suggest_reads_the_models_table_and_the_rounds_batch_size(run_cli, tmp_path):
    model = _suggest_project(tmp_path)
    code, out, err = run_cli("suggest", model, "--format", "json")
    payload = json.loads(out)
    assert code == 0, err
    assert payload["input_shape"] == [3, 2, 2] and payload["batch_size"] == 4
    code, out, _ = run_cli("suggest", model, "--format", "json", "--batch-size", "2")  # the flag wins
    assert json.loads(out)["batch_size"] == 2


def test_suggest_never_prints_ra_i_at_none(run_cli, tmp_path):
    code, out, _ = run_cli("suggest", _suggest_project(tmp_path))
    assert code == 0 and "at None" not in out
    assert "RA-i undefined (every layer dense)" in out.splitlines()[0]
    code, out, _ = run_cli("compare", EXAMPLES / "mlp6.py", EXAMPLES / "mlp6.py")
    assert "at None" not in out and "RA-i undefined (every layer dense)" in out


def test_suggest_noise_search_follows_the_round(run_cli, tmp_path):
    model = _suggest_project(
        tmp_path,
        """
        local-samples = 40
    """,
    )
    code, out, _ = run_cli("suggest", model, "--dp-noise", "1", "--max-reconstruction", "0.05", "--format", "json")
    noise = json.loads(out)["dp_noise"]
    assert code == 0 and noise["sample_rate"] == 0.1 and noise["steps"] == 10
    assert noise["sample_rate_source"] == "round: B/N = 4/40" and noise["bound"] <= 0.05
    assert noise["noise_multiplier"] == pytest.approx(dp.least_noise(0.05, 0.01, 0.1, 10, 1e-5).noise_multiplier)
    _, table, _ = run_cli("suggest", model, "--dp-noise", "1", "--max-reconstruction", "0.05")
    assert re.search(r"DP noise \(q 0.1, T 10, prior 0.01, --max-reconstruction 0.05\)", table)
    assert "  q: round: B/N = 4/40; T: round: E·⌈N/B⌉ = 1·10 local steps × 1 server round" in table


def test_html_card_shows_the_sources_and_the_note(run_cli, tmp_path):
    page = tmp_path / "r.html"
    run_cli(EXAMPLES / "fig2_a.py", *ISSUE_ROUND, "--dp-steps", "1000", "--fail-on", "never", "--html", page, "-q")
    text = page.read_text()
    assert "0.008 <small>(round: B/N = 32/4000)</small>" in text
    assert "1,000 <small>(--dp-steps)</small>" in text
    assert '<p class="note">T = 1,000 from --dp-steps used as given; the round gives T = 125' in text
