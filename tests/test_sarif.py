"""SARIF output validated against the official SARIF 2.1.0 schema, with stable rule ids and source locations."""

import json
import os
import shutil
import subprocess
import tarfile

import pytest
from conftest import EXAMPLES, REPO

# The OASIS schema ships inside this npm package; fetched at test time, never copied into the repo.
SCHEMA_PACKAGE = "@microsoft/jest-sarif@1.0.0-beta.0"
SCHEMA_MEMBER = "package/lib/schemas/sarif-2.1.0-rtm.5.json"
SCHEMA_CACHE = REPO / "tests" / ".cache" / "sarif-2.1.0-rtm.5.json"


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must have it: .ci/run installs node/npm)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sarif_schema(tmp_path_factory):
    if not SCHEMA_CACHE.exists():
        npm = shutil.which("npm")
        if npm is None:
            _unavailable("npm is needed to fetch the SARIF 2.1.0 schema")
        work = tmp_path_factory.mktemp("npm")
        done = subprocess.run(
            [npm, "pack", SCHEMA_PACKAGE, "--silent"], cwd=work, capture_output=True, text=True, timeout=120
        )
        tarballs = list(work.glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            _unavailable(f"could not fetch {SCHEMA_PACKAGE}: {done.stderr.strip()[:200]}")
        with tarfile.open(tarballs[0]) as archive:
            data = archive.extractfile(SCHEMA_MEMBER).read()
        SCHEMA_CACHE.parent.mkdir(parents=True, exist_ok=True)
        SCHEMA_CACHE.write_bytes(data)
    return json.loads(SCHEMA_CACHE.read_text())


def sarif_of(run_cli, *models):
    code, out, _ = run_cli(*models, "--format", "sarif")
    return code, json.loads(out)


@pytest.mark.parametrize("example", ["resnet18_w16.py", "fig2_b.py", "mlp6.py", "cnn6.py"])
def test_output_validates_against_the_official_schema(run_cli, sarif_schema, example):
    import jsonschema

    _, log = sarif_of(run_cli, EXAMPLES / example)
    jsonschema.Draft7Validator(sarif_schema).validate(log)
    assert log["version"] == "2.1.0"


def test_the_validator_rejects_a_broken_log(sarif_schema):
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(sarif_schema).validate({"version": "2.1.0", "runs": [{"results": []}]})


def test_exposed_model_result_points_at_the_critical_layer_line(run_cli):
    code, log = sarif_of(run_cli, EXAMPLES / "resnet18_w16.py")
    run = log["runs"][0]
    exposed = [r for r in run["results"] if r["ruleId"] == "RA001"]
    assert code == 1 and len(exposed) == 1
    location = exposed[0]["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "examples/resnet18_w16.py"
    line = location["region"]["startLine"]
    source = (EXAMPLES / "resnet18_w16.py").read_text().splitlines()[line - 1]
    assert "self.conv1(x)" in source  # layer2.0.conv1 is called from BasicBlock.forward
    # The verdict's result (no certified deficit) points at the same line, not at the file's first line, and its
    # message ends with the command to run next.
    (verdict,) = [r for r in run["results"] if r["ruleId"] == "RA004"]
    assert verdict["locations"][0]["physicalLocation"] == location
    step = f"Next step: `rankaudit suggest {EXAMPLES / 'resnet18_w16.py'} --max-reconstruction 0.05`"
    assert step in verdict["message"]["text"]
    rules = {rule["id"]: rule for rule in run["tool"]["driver"]["rules"]}
    assert float(rules["RA001"]["properties"]["security-severity"]) >= 7.0
    assert {"RA001", "RA002", "RA003", "RA102"} <= rules.keys()
    assert any(r["ruleId"] == "RA003" for r in run["results"])  # fc's gradient reveals the labels


def test_protected_model_has_no_exposure_result_and_stable_rule_ids(run_cli):
    # 90 % of photographs keep 0.0064 % of their detail hidden by the strided stem: protected only when that is all one asks
    code, log = sarif_of(
        run_cli, EXAMPLES / "strided_stem.py", "--exposed-below", "0.00005", "--max-recoverable", "0.99995"
    )
    results = log["runs"][0]["results"]
    assert code == 0 and not [r for r in results if r["ruleId"] in ("RA001", "RA002", "RA004", "RA007")]
    ids = [rule["id"] for rule in log["runs"][0]["tool"]["driver"]["rules"]]
    assert ids[:3] == ["RA001", "RA002", "RA003"] and "RA007" in ids


def test_partial_is_its_own_rule(run_cli):
    # The strided stem: 90 % of photographs keep 0.0064 % of their detail hidden, partial above --exposed-below 0.00005
    code, log = sarif_of(run_cli, EXAMPLES / "strided_stem.py", "--exposed-below", "0.00005")
    run = log["runs"][0]
    partial = [r for r in run["results"] if r["ruleId"] == "RA007"]
    assert code == 1 and len(partial) == 1 and not [r for r in run["results"] if r["ruleId"] == "RA004"]
    assert partial[0]["level"] == "warning" and ": partial." in partial[0]["message"]["text"]
    assert (partial[0]["properties"]["rank_bound"], partial[0]["properties"]["max_recoverable"]) == (452, 0.5)
    assert partial[0]["properties"]["certified_hidden_energy"] == pytest.approx(6.4e-5, abs=1e-6)
    rule = next(rule for rule in run["tool"]["driver"]["rules"] if rule["id"] == "RA007")
    assert rule["name"] == "input-partial"


def test_caveats_become_note_results_with_their_own_rules(run_cli, tmp_path):
    model = tmp_path / "gelu.py"
    model.write_text(
        "import torch.nn as nn\nINPUT_SHAPE = (8,)\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        "        self.act = nn.GELU()\n        self.out = nn.Linear(8, 1)\n"
        "    def forward(self, x):\n        return self.out(self.act(self.fc(x)))\n"
    )
    _, log = sarif_of(run_cli, model)
    notes = [r for r in log["runs"][0]["results"] if r["ruleId"] == "RA101"]
    assert len(notes) == 1 and notes[0]["level"] == "note" and "GELU" in notes[0]["message"]["text"]
    assert notes[0]["locations"][0]["physicalLocation"]["region"]["startLine"] == 10


def test_no_certified_deficit_is_its_own_rule(run_cli):
    # ViT-tiny: R-GAP's index is positive (its closed form stops at the class token), yet nothing certifies a
    # deficit: RA004 fires with the bound's numbers, RA001 (RA-i < 0) does not.
    code, log = sarif_of(run_cli, EXAMPLES / "vit_tiny.py")
    run = log["runs"][0]
    by_rule = {}
    for result in run["results"]:
        by_rule.setdefault(result["ruleId"], []).append(result)
    assert code == 1 and len(by_rule["RA004"]) == 1 and "RA001" not in by_rule
    assert by_rule["RA004"][0]["properties"]["rank_bound"] == by_rule["RA004"][0]["properties"]["unknowns"] == 768
    rules = {rule["id"]: rule for rule in run["tool"]["driver"]["rules"]}
    assert (
        rules["RA004"]["name"] == "no-certified-deficit" and rules["RA004"]["defaultConfiguration"]["level"] == "error"
    )
    # A partial model gets neither.
    _, log = sarif_of(run_cli, EXAMPLES / "strided_stem.py", "--exposed-below", "0.00005")
    assert not [r for r in log["runs"][0]["results"] if r["ruleId"] in ("RA001", "RA004")]


def test_every_rule_links_its_section_of_the_rules_page_and_every_result_has_a_region(run_cli):
    """helpUri: docs/rules.md on the default branch (no release is tagged), at the rule's own heading; a result without a known line sits
    at the file's first line (code scanning needs a region)."""
    import re

    from rankaudit import REPOSITORY
    from rankaudit.report.sarif import RULES

    anchors = {f"ra{m}" for m in re.findall(r"^## RA(\d{3})$", (REPO / "docs" / "rules.md").read_text(), re.M)}
    assert anchors == {rule.lower() for rule in RULES}, "docs/rules.md needs one '## RAnnn' heading per rule"
    _, log = sarif_of(run_cli, EXAMPLES / "cnn6.py", EXAMPLES / "gpt2_tiny.py", EXAMPLES / "mlp_bias.py")
    run = log["runs"][0]
    for rule in run["tool"]["driver"]["rules"]:
        assert rule["helpUri"] == f"{REPOSITORY}/blob/main/docs/rules.md#{rule['id'].lower()}"
    assert len(run["results"]) >= 4
    for result in run["results"]:
        region = result["locations"][0]["physicalLocation"]["region"]
        assert isinstance(region["startLine"], int) and region["startLine"] >= 1, result["ruleId"]
