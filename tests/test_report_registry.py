"""The reports read the verifier records: a newly registered verifier shows in the table and the HTML page."""

import json
import re
from types import SimpleNamespace

import pytest
from conftest import EXAMPLES

from rankaudit.audit import audit
from rankaudit.report import html, records
from rankaudit.report.table_verify import SECTIONS, verification_lines
from rankaudit.verify import registry
from rankaudit.verify.registry import Verifier


def _fake_record(context):
    """A record with each kind of field: sentences, scalars, a non-finite float, short and long lists, a mapping."""
    return {
        "judgement": f"read {context.result.batch_size} samples of the request",
        "batch_size": context.result.batch_size,
        "seed": context.seed,
        "psnr": 31.256789,
        "gap": float("inf"),
        "confirms": True,
        "layers_read": ["conv1", "fc3"],
        "trace": list(range(20)),
        "per_sample": [{"index": 0}, {"index": 1}],
        "label": "<b>not markup</b>",
        "notes": ["the fake reads the request only"],
        "internal_error": None,
    }


FAKE = Verifier(name="fake", help="a verifier the report test registers.", needs=frozenset(), run=_fake_record)


@pytest.fixture
def fake_registered(monkeypatch):
    monkeypatch.setitem(registry.verifiers(), "fake", FAKE)


GDBR = {
    "shared_layer": "fc2",
    "batch_size": 4,
    "trials": 1,
    "seconds": 0.5,
    "ins_acc": 0.75,
    "cls_acc": 1.0,
    "features_from": "dummy inputs",
    "chance_ins_acc": 0.25,
    "beats_chance": True,
    "recovered": {0: 3},
    "true": {0: 4},
}


def test_a_registered_verifier_is_in_the_table_and_the_html(run_cli, fake_registered, tmp_path):
    page = tmp_path / "report.html"
    code, out, err = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--seed", "5", "-b", "2", "--html", page)
    assert code in (0, 1) and "error" not in err
    lines = out.splitlines()
    start = lines.index("Verification (--verify fake): a verifier the report test registers.")
    assert lines[start + 1 : start + 12] == [
        "  read 2 samples of the request.",
        "  batch_size: 2",
        "  confirms: yes",
        "  gap: n/a",  # infinity is no figure
        "  label: <b>not markup</b>",
        "  layers_read: conv1, fc3",
        "  psnr: 31.26",
        "  seed: 5",
        "  the fake reads the request only.",
        "  in the JSON only: per_sample (list of 2), trace (list of 20)",
        "",  # the section ends; the policy line follows
    ]
    document = page.read_text(encoding="utf-8")
    card = re.search(r'<section class="card verify verify-record".*?</section>', document, re.S).group(0)
    assert '<h2 id="m1-verify-1">Verification: <code>--verify fake</code></h2>' in card
    assert '<p class="verdict-check ok">Read 2 samples of the request.</p>' in card
    for key, value in (("batch_size", "2"), ("seed", "5"), ("psnr", "31.26"), ("gap", "n/a"), ("confirms", "yes")):
        assert f"<dt>{key}</dt><dd>{value}</dd>" in card
    assert "<dd>&lt;b&gt;not markup&lt;/b&gt;</dd>" in card and "<b>not markup" not in document
    assert "<li>The fake reads the request only.</li>" in card
    assert "In the JSON report only: per_sample (list of 2), trace (list of 20)." in card
    assert "http" not in document.lower()


def test_the_json_keeps_the_record_as_the_verifier_returned_it(run_cli, fake_registered):
    code, out, _ = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--format", "json")
    record = json.loads(out)["verification"]["fake"]
    assert record["trace"] == list(range(20)) and record["per_sample"] == [{"index": 0}, {"index": 1}]
    assert record["psnr"] == 31.256789


def test_a_verifier_with_a_section_of_its_own_is_not_repeated_generically(fake_registered):
    """The known sections first in their order, then the other records in filing order; --defense's rows are not a
    verifier's record and stay out of the generic path, as does a key no verifier is registered under."""
    result = SimpleNamespace(
        verification={
            "fake": {"judgement": "first filed", "seed": 1},
            "defenses": [],
            "adadefense_training": None,
            "gdbr": GDBR,
            "stray": {"seed": 2},
        }
    )
    lines = verification_lines(result)
    headings = [line for line in lines if line.startswith("Verification")]
    assert headings[0].startswith("Verification (GDBR from fc2's gradient, batch 4")
    assert headings[1:] == ["Verification (--verify fake): a verifier the report test registers."]
    assert "  seed: 2" not in lines and records.without_section(result.verification, SECTIONS) == ["fake"]


def test_the_table_has_a_section_for_each_of_today_s_verifiers():
    assert list(SECTIONS) == ["bias", "rgap", "gdbr", "rank", "fisher", "dager", "dp"]
    assert set(SECTIONS) == set(registry.names())
    assert set(html.CARDS) | set(html.IN_OTHER_CARDS) == set(registry.names())


def test_a_record_that_is_not_a_mapping_is_said_not_dropped(fake_registered):
    lines = verification_lines(SimpleNamespace(verification={"fake": [1.5, float("nan")]}))
    assert lines == ["", "Verification (--verify fake): a verifier the report test registers.", "  record: 1.5, n/a"]
    assert records.read("fake", {"table": {"a": 1}}).json_only == ["table (1 fields)"]


def test_several_generic_cards_have_ids_of_their_own(monkeypatch, fake_registered):
    monkeypatch.setitem(registry.verifiers(), "other", Verifier("other", "another.", frozenset(), _fake_record))
    result = audit(str(EXAMPLES / "lenet.py"))
    result.verification = {"other": {"judgement": "does not confirm", "confirms": False}, "fake": {"seed": 3}}
    document = html.render([result, result])
    ids = re.findall(r'<h2 id="(m\d-verify-\d)">Verification: <code>--verify (\w+)</code>', document)
    assert ids == [("m1-verify-1", "other"), ("m1-verify-2", "fake"), ("m2-verify-1", "other"), ("m2-verify-2", "fake")]
    assert '<p class="verdict-check warn">Does not confirm.</p>' in document
    assert document.count('class="card verify"') == 0  # no record of R-GAP or GDBR: no card of theirs
