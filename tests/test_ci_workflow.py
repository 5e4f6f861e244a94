"""The GitHub Actions workflow docs/ci.md gives to paste: it parses, and it gates, installs and uploads as it says."""

import re
from pathlib import Path

import yaml

CI_PAGE = Path(__file__).resolve().parents[1] / "docs" / "ci.md"


def _workflow() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", CI_PAGE.read_text(), re.S)
    workflows = [yaml.safe_load(block) for block in blocks if block.startswith("name:") and "jobs:" in block]
    assert len(workflows) == 1, "docs/ci.md should hold exactly one complete workflow"
    return workflows[0]


def test_the_workflow_parses_and_has_every_step_a_fresh_runner_needs():
    workflow = _workflow()
    # YAML reads a bare `on:` key as True.
    triggers = workflow.get("on", workflow.get(True))
    assert "pull_request" in triggers and "push" in triggers
    assert workflow["permissions"]["security-events"] == "write"
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    uses = [step.get("uses", "") for step in steps]
    # The newest major versions the actions tag (checked against their repositories in November 2026).
    assert "actions/checkout@v7" in uses and "actions/setup-python@v7" in uses
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs and "rankaudit-fl" in runs
    # The install comes before the audit, the audit before the upload.
    install = next(i for i, step in enumerate(steps) if "pip install" in step.get("run", ""))
    audit = next(i for i, step in enumerate(steps) if step.get("run", "").startswith("rankaudit "))
    upload = next(i for i, use in enumerate(uses) if "upload-sarif" in use)
    assert install < audit < upload


def test_the_workflow_gates_and_uploads_with_a_supported_action():
    steps = next(iter(_workflow()["jobs"].values()))["steps"]
    audit = next(step for step in steps if step.get("run", "").startswith("rankaudit "))
    words = audit["run"].split()
    assert "--fail-on" in words and words[words.index("--fail-on") + 1] in ("exposed", "partial", "boundary")
    assert "continue-on-error" not in audit  # a failing policy must fail the job
    sarif = words[words.index("-o") + 1]
    assert words[words.index("--format") + 1] == "sarif"
    upload = next(step for step in steps if "upload-sarif" in step.get("uses", ""))
    assert upload["uses"] == "github/codeql-action/upload-sarif@v4"  # v3 is deprecated in December 2026
    assert upload["with"]["sarif_file"] == sarif
    assert "always()" in upload["if"]  # the findings of a failing model are uploaded too
