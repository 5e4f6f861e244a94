"""suggest and compare on an app folder judge what the app sends, as `check` does: a FedBN client's local norms and
a FedRep client's local head are left out of every bound they print."""

from __future__ import annotations

import json

import pytest
from conftest import APPS

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def _check(run_cli, app: str, *given: str) -> dict:
    code, out, err = run_cli(app, *given, "--format", "json")
    assert out, err
    return json.loads(out)


def _suggest(run_cli, app: str, *given: str) -> dict:
    code, out, err = run_cli("suggest", app, *given, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def _withheld_setting(checked: dict) -> list[str]:
    rows = [row["value"] for row in checked["deployment"]["settings"] if row["setting"] == "withheld-layers"]
    return rows[0].split(",") if rows else []


def test_suggest_on_a_fedbn_app_judges_its_norms_as_kept_local(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    given = ("--input-shape", "1,8,8", "--local-samples", "32")
    checked, suggested = _check(run_cli, "fedbn", *given), _suggest(run_cli, "fedbn", *given)
    assert suggested["withheld_layers"] == _withheld_setting(checked) == ["bn1", "bn2"]
    assert suggested["shared_layers"] is None
    bound = checked["identifiability"]
    for key in ("rank_bound", "single_sample_bound", "round_bound", "batch_statistics"):
        assert suggested["sample"][key] == bound["sample"][key], key
    assert suggested["round_review"]["whole_rank_bound"] == bound["rank_bound"]
    assert suggested["check_command"] == "rankaudit check fedbn --input-shape 1,8,8 --local-samples 32"


def test_suggest_and_compare_on_a_fedrep_app_leave_its_head_out(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    given = ("--input-shape", "3,32,32", "--local-samples", "500")
    checked = _check(run_cli, "fedrep", *given)
    head = 32 * 10 + 10  # the personal head's weight and bias: never sent
    assert _withheld_setting(checked) == ["head"]
    assert checked["identifiability"]["rank_bound"] == 51146 - head
    suggested = _suggest(run_cli, "fedrep", *given)
    assert suggested["withheld_layers"] == ["head"]
    # The batch of 50 (|x| = 3,072 each) is capped by the gradient sent: the body's values alone.
    assert suggested["batch_size"] == 50 and suggested["rank_bound"] == 51146 - head
    assert suggested["round_review"]["whole_rank_bound"] == checked["identifiability"]["rank_bound"]
    assert suggested["sample"]["single_sample_bound"] == checked["identifiability"]["sample"]["single_sample_bound"]
    code, out, err = run_cli("compare", "fedrep", "fedrep", *given, "--format", "json")
    compared = json.loads(out)
    for side in ("a", "b"):
        assert compared[side]["identifiability"]["rank_bound"] == 51146 - head, err
        assert compared[side]["identifiability"]["round"] == checked["identifiability"]["round"]
