"""The HTML report: self-contained (no URL of any kind), well-formed SVG, and every finding of the Result on the page."""

from __future__ import annotations

import base64
import copy
import re
import xml.etree.ElementTree as ET
from importlib.resources import files

import numpy as np
import pytest
import torch
from conftest import EXAMPLES, TABULAR_NET, analyse_module
from markupsafe import escape
from torch import nn

from rankaudit.audit import audit
from rankaudit.report import html, svg

EXAMPLE_NAMES = ("resnet18_w16", "fig2_e", "cnn6", "mlp6")
SVG_BLOCK = re.compile(r"<svg\b.*?</svg>", re.S)
URL_ATTRIBUTE = re.compile(r"""\b(?:src|href|xlink:href|action|poster|srcset)\s*=\s*["']?([^"'\s>]*)""", re.I)


@pytest.fixture(scope="module")
def results():
    return {name: audit(str(EXAMPLES / f"{name}.py")) for name in EXAMPLE_NAMES}


@pytest.fixture(scope="module")
def pages(results):
    return {name: html.render([result]) for name, result in results.items()}


def _svgs(document: str) -> list[str]:
    return SVG_BLOCK.findall(document)


def _section(document: str, css_class: str) -> str:
    """The text of the first <section> or <table> whose class list starts with css_class."""
    match = re.search(rf'<(section|table) class="{css_class}\b.*?</\1>', document, re.S)
    assert match, f"no element of class {css_class}"
    return match.group(0)


# --- self-contained -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_page_references_no_url_at_all(pages, name):
    document = pages[name]
    assert "http" not in document.lower()  # inline SVG carries no xmlns, so not even a namespace URL
    for value in URL_ATTRIBUTE.findall(document):
        assert value.startswith(("#", "data:")), f"external reference {value!r}"
    for value in re.findall(r"url\(\s*([^)]*)\)", document):
        assert value.strip("'\" ").startswith("#"), f"CSS/SVG url() to {value!r}"
    assert "@import" not in document
    assert "<link" not in document.lower() and "<script" not in document.lower() and "<iframe" not in document.lower()
    assert document.lstrip().lower().startswith("<!doctype html>")


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_svg_is_well_formed_xml(pages, name):
    blocks = _svgs(pages[name])
    assert len(blocks) >= 2, "expected at least the RA_i chart and the architecture graph"
    for block in blocks:
        root = ET.fromstring(block)
        assert root.tag == "svg" and root.get("viewBox")
        assert root.get("width") == "100%"


def test_ids_are_unique_across_several_models(results):
    document = html.render(list(results.values()))
    ids = re.findall(r'\bid="([^"]+)"', document)
    assert len(ids) == len(set(ids)), "duplicate ids would cross-wire SVG markers and anchors"
    for ref in re.findall(r'href="#([^"]+)"', document) + re.findall(r"url\(#([^)]+)\)", document):
        assert ref in ids, f"dangling reference #{ref}"
    assert document.count('<section class="model"') == len(results)
    assert '<nav class="toc' in document


# --- the findings are on the page --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_verdict_and_critical_layer_lead_the_page(results, pages, name):
    result, document = results[name], pages[name]
    summary = _section(document, "summary card")
    assert f'<p class="badge">{result.verdict}</p>' in summary
    assert escape(result.meaning[1:]) in summary
    if result.ra_i is None:
        assert "undefined" in summary
    else:
        assert svg.fmt_int(result.ra_i) in summary
        assert f"<code>{result.critical_layer}</code>" in summary
        # The critical layer is marked in the table, the chart and the graph.
        assert document.count('class="node critical"') == 1
        assert f"{result.critical_layer} ({result.critical_row.op}): RA_i = " in document


def test_verdicts_have_distinct_colours(results):
    css = (files("rankaudit.templates") / "report.css").read_text(encoding="utf-8")
    colours = {}
    for verdict in ("exposed", "partial", "protected"):
        match = re.search(rf"\.v-{verdict} \.badge \{{ background: var\(--([\w-]+)\)", css)
        assert match, verdict
        colours[verdict] = re.search(rf"--{match.group(1)}: (#[0-9a-f]+)", css).group(1)
    assert len(set(colours.values())) == 3
    partial = audit(str(EXAMPLES / "strided_stem.py"), exposed_below=0.00005)  # 0.0064 % certified hidden
    page = html.render([partial])
    assert 'class="summary card v-partial"' in page and "not protection" in page
    assert '<li class="partial current"><b>partial</b>' in page


def test_the_bound_and_its_min_cut_are_drawn(results):
    """fig2-e: the bound's bar says 3,056 of 3,072, and the three layers whose gradients form the cut are ringed."""
    document = html.render([results["fig2_e"]])
    bound = _section(document, "card bound-card")
    assert "rank ≤ 3,056 (99.5 %)" in bound and "certified deficit 16 of 3,072" in bound
    assert "∇conv1, ∇conv2, ∇fc" in bound
    graph = document[document.index('id="m1-graph"') :]
    assert graph.count('<rect class="cut"') == 3
    exposed = html.render([results["cnn6"]])
    assert exposed.count('<rect class="cut"') == 1
    assert "less than 5 % of the detail of 90 % of samples like yours certified hidden" in exposed


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_layer_row_is_in_the_table(results, pages, name):
    table = _section(pages[name], "layers")
    body = table.split("<tbody>", 1)[1]
    assert body.count("<tr") == len(results[name].layers)
    for row in results[name].layers:
        assert f"<code>{escape(row.name)}</code></th>" in body or f">{escape(row.name)}</code>" in body
        assert f'<td class="n ra">{svg.fmt_int(row.ra_i)}</td>' in body


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_label_leakage_layers_appear(results, pages, name):
    leakage = results[name].label_leakage
    section = _section(pages[name], "card leakage")
    assert leakage.risk in section
    for layer in leakage.leaking:
        assert f"<code>{layer}</code>" in section
    for bridge in leakage.layers:
        if bridge.shared and not bridge.bridge:
            assert f"<code>{bridge.name}" in section


def test_residual_blocks_and_projections_are_drawn(results, pages):
    graph = next(block for block in _svgs(pages["resnet18_w16"]) if 'class="graph"' in block)
    root = ET.fromstring(graph)
    labels = ["".join(t.itertext()) for t in root.iter("text")]
    for block in results["resnet18_w16"].blocks:
        assert any(label.startswith(block.name) for label in labels), block.name
    assert len(root.findall(".//g[@class='block']")) == len(results["resnet18_w16"].blocks)
    assert graph.count("projection, |W| folded") == 3
    arch = results["resnet18_w16"].architecture
    assert len(root.findall(".//path[@marker-end]")) == len(arch.edges)


def test_caveats_are_listed(results, pages):
    for name, result in results.items():
        section = _section(pages[name], "card caveats")
        for caveat in result.caveats:
            assert caveat.code in section and escape(caveat.message) in section


def test_untrusted_names_are_escaped_and_svg_stays_valid(results):
    result = copy.deepcopy(results["cnn6"])
    hostile = '<script>alert("x")</script>&amp;\'"'
    result.model_name = hostile
    result.layers[0].name = hostile
    result.architecture.nodes[1].name = hostile
    result.critical_layer = hostile
    document = html.render([result])
    assert "<script>" not in document
    for block in _svgs(document):
        ET.fromstring(block)


class _Branchy(nn.Module):
    """Two parallel convolutions concatenated, then a long skip concatenated at the end (U-Net-like)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.left = nn.Conv2d(4, 4, 3, padding=1)
        self.right = nn.Conv2d(4, 4, 1)
        self.mix = nn.Conv2d(8, 4, 3, padding=1)
        self.deep = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        s = torch.relu(self.stem(x))
        m = self.mix(torch.cat([self.left(s), self.right(s)], 1))
        return self.head(torch.cat([self.deep(m), s], 1).flatten(1))


def test_branches_and_cat_are_laid_out():
    result = analyse_module(_Branchy, (3, 8, 8))
    graph = svg.architecture_graph(result, prefix="t")
    root = ET.fromstring(graph)
    texts = ["".join(t.itertext()) for t in root.iter("text")]
    assert {"stem", "left", "right", "mix", "deep", "head"} <= set(texts)
    assert sum(1 for t in texts if t == "cat") == 2
    assert len(root.findall(".//path[@marker-end]")) == len(result.architecture.edges)


# --- verification ------------------------------------------------------------------------------------------------


def _png(path, shade: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    image.putdata([((shade + 9 * i) % 256, (3 * i) % 256, 255 - shade) for i in range(64)])
    image.save(path)
    return path.read_bytes()


def _synthetic_verification(tmp_path) -> tuple[dict, dict]:
    """A verification dict in the verifier's documented shape, built here by hand (no attack is run)."""
    originals = {i: _png(tmp_path / f"orig{i}.png", 40 * i) for i in range(2)}
    reconstruction = _png(tmp_path / "rec0.png", 200)
    missing = tmp_path / "nowhere" / "rec1.png"
    verification = {
        "rgap": {
            "attack": "rgap",
            "device": "cpu",
            "median_mse": 0.0012345,
            "median_psnr": 29.087,
            "seconds": 1.25,
            "confirms": True,
            "note": "synthetic run for the report test",
            "samples": [
                {
                    "index": 0,
                    "mse": 0.0004321,
                    "psnr": 33.64,
                    "seconds": 0.5,
                    "original_png": str(tmp_path / "orig0.png"),
                    "reconstruction_png": str(tmp_path / "rec0.png"),
                },
                {
                    "index": 1,
                    "mse": 0.0098761,
                    "psnr": float("inf"),
                    "seconds": 0.7,
                    "original_png": str(tmp_path / "orig1.png"),
                    "reconstruction_png": str(missing),
                },
                {
                    "index": 2,
                    "mse": None,
                    "psnr": None,
                    "seconds": 0.1,
                    "original_png": None,
                    "reconstruction_png": None,
                },
            ],
            "layers": [
                {
                    "name": "conv1",
                    "unknowns": 3072,
                    "rank": 3072,
                    "local_deficit": 0,
                    "residual": 1.5e-07,
                    "condition": 412.5,
                },
                {"name": "conv2", "unknowns": 3468, "rank": 3456, "local_deficit": 12, "residual": 0.02},
            ],
        },  # no "condition": shown as n/a
        "gdbr": {
            "shared_layer": "fc",
            "batch_size": 16,
            "ins_acc": 0.9375,
            "cls_acc": 1.0,
            "trials": 5,
            "seconds": 0.3,
            "recovered": {"3": 7, "5": 9, "1": 0},
            "true": {"3": 6, "5": 9, "1": 1},
        },
    }
    expected = {"originals": originals, "reconstruction": reconstruction, "missing": str(missing)}
    return verification, expected


def test_verification_images_are_embedded_and_numbers_printed(results, tmp_path):
    result = copy.deepcopy(results["cnn6"])
    result.verification, expected = _synthetic_verification(tmp_path)
    document = html.render([result])
    section = _section(document, "card verify")
    uris = re.findall(r'<img src="(data:image/png;base64,[A-Za-z0-9+/=]+)"', section)
    assert len(uris) == 3
    assert "data:image/png;base64," + base64.b64encode(expected["originals"][0]).decode() in uris
    assert "data:image/png;base64," + base64.b64encode(expected["reconstruction"]).decode() in uris
    for number in ("0.001234", "29.09", "0.0004321", "33.64", "0.009876", "∞"):
        assert number in section, number
    assert "confirms the static verdict" in section
    assert "412.5" in section and "1.5e-07" in section  # the per-layer ranks table
    assert section.count('class="deficit"') == 1 and "n/a" in section
    assert "93.8%" in section and "100.0%" in section  # GDBR accuracies
    chart = next(block for block in _svgs(section) if 'class="bars"' in block)
    root = ET.fromstring(chart)
    assert ["1", "3", "5"] == [
        t.text for t in root.iter("text") if t.text in ("1", "3", "5") and t.get("text-anchor") == "middle"
    ]
    assert "recovered 7, true 6" in chart
    assert "http" not in document.lower()


def test_missing_image_is_reported_not_fatal(results, tmp_path):
    result = copy.deepcopy(results["cnn6"])
    result.verification, expected = _synthetic_verification(tmp_path)
    (tmp_path / "orig0.png").write_bytes(b"GIF89a not a png")
    section = _section(html.render([result]), "card verify")
    assert section.count('class="missing"') == 4  # bad file, missing file, two never saved
    assert "file not found" in section and escape(expected["missing"]) in section
    assert "not a PNG file" in section
    assert "not saved by the verifier" in section


def test_relative_image_paths_resolve_against_base_dir(results, tmp_path):
    result = copy.deepcopy(results["cnn6"])
    result.verification, _ = _synthetic_verification(tmp_path)
    result.verification["rgap"]["samples"] = [
        {
            "index": 0,
            "mse": 0.1,
            "psnr": 10.0,
            "seconds": 0.1,
            "original_png": "orig0.png",
            "reconstruction_png": "rec0.png",
        }
    ]
    del result.verification["gdbr"]
    document = html.render([result], base_dir=tmp_path)
    # the verifier's two pictures (the summary card adds the certificate's pair of its own)
    assert _section(document, "card verify").count("data:image/png;base64,") == 2
    assert "Label recovery" not in document


def test_no_verification_section_without_verification(pages):
    assert 'class="card verify"' not in pages["cnn6"]


# --- the headline and the bar say what the verdict reads ------------------------------------------------------------


def _text_of(fragment: str) -> str:
    return re.sub(r"<[^>]+>", " ", str(fragment)).replace("&#39;", "'")


def test_the_headline_and_the_bar_agree_with_an_energy_verdict():
    """A strided stem hides 85 % of the directions but under 0.01 % of the detail of 90 % of photographs: exposed. The
    headline gives that reason, and the bar the verdict reads is energy, labelled, above the direction count."""
    document = html.render([audit(str(EXAMPLES / "strided_stem.py"))])
    summary = _text_of(_section(document, "summary card"))
    headline = re.search(r'<p class="headline">(.*?)</p>', document).group(1).replace("&#39;", "'")
    assert headline == (
        "The directions a shared gradient can show hold more than 99.99 % of a sample's detail: less than 0.01 % of it "
        "is certified hidden for 90 % of samples like yours, so a server can reconstruct them."
    )
    assert "Nothing in the architecture" not in document
    assert "less than 0.01 % of the detail of 90 % of samples like yours certified hidden" in summary
    bar = _svgs(_section(document, "card bound-card"))[0]
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", bar)
    assert labels[:3] == [
        "Detail of 90 % of samples like yours (what the verdict reads)",
        "visible: more than 99.99 %",
        "certified hidden: less than 0.01 %",
    ]
    assert labels[3:] == [
        "Input directions (the rank bound)",
        "rank ≤ 452 (14.7 %)",
        "certified deficit 2,620 of 3,072",
    ]
    widths = [
        float(w) for w in re.findall(r'<rect x="0" y="[\d.]+" width="([\d.]+)" height="22" rx="4" fill="#c2410c"', bar)
    ]
    assert widths == [pytest.approx(560 * (1 - 6.4e-5), abs=0.6)]  # the energy bar: nearly all of it visible


def test_a_protected_headline_and_a_partial_one_read_energy(tmp_path):
    # Feature vectors certify nothing without --data: 400 white samples are the reference. Pooling 40 features to 5
    # hides 87.5 % of the directions; 90 % of those samples keep at least 65.7 % of their detail hidden (the 30th
    # smallest of their 400 shares: a 95 % lower confidence bound on the 10 % quantile).
    model = tmp_path / "pooled.py"
    model.write_text(
        "import torch.nn as nn\nINPUT_SHAPE = (1, 40)\nclass Features(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.pool = nn.AvgPool1d(8)\n        self.fc = nn.Linear(5, 3)\n"
        "    def forward(self, x):\n        return self.fc(self.pool(x).flatten(1))\n"
    )
    samples = tmp_path / "white.npy"
    np.save(samples, np.random.default_rng(0).standard_normal((400, 40)))
    protected = audit(str(model), data=str(samples))
    assert protected.verdict == "protected"
    headline = html._headline(protected, "protected")
    assert headline == (
        "90 % of samples like yours (read from your 400 samples, 95 % confidence) keep at least 65.7 % of their detail "
        "hidden from any weights: the directions a shared gradient can show hold at most 34.3 % of it."
    )
    partial = audit(str(EXAMPLES / "strided_stem.py"), exposed_below=0.00005)
    assert html._headline(partial, "partial").endswith("less than the 50 % protected asks; not protection.")


def test_what_a_server_can_see_is_drawn_at_least_128_pixels_wide():
    """The certificate's pictures of a 32 px input are enlarged by whole pixels (no smoothing), to 128 px."""
    import struct

    document = html.render([audit(str(EXAMPLES / "strided_stem.py"))])
    figure = re.search(r'<figure class="visible-pair certificate".*?</figure>', document, re.S).group(0)
    sources = re.findall(r'src="data:image/png;base64,([^"]+)"', figure)
    assert len(sources) == 2
    for source in sources:
        png = base64.b64decode(source)
        width, height = struct.unpack(">II", png[16:24])
        assert (width, height) == (128, 128)
    assert figure.count('height="128"') == 2
    css = (files("rankaudit.templates") / "report.css").read_text(encoding="utf-8")
    assert re.search(r"\.visible-pair img \{[^}]*height: 128px;[^}]*image-rendering: pixelated", css)


def _svg(page: str, css_class: str) -> ET.Element:
    block = next(block for block in SVG_BLOCK.findall(page) if f'class="{css_class}"' in block)
    return ET.fromstring(block)


def _texts(element: ET.Element) -> list[str]:
    return ["".join(node.itertext()) for node in element.iter("{http://www.w3.org/2000/svg}text")] or [
        "".join(node.itertext()) for node in element.iter("text")
    ]


def test_in_round_mode_the_bars_say_each_sample_first_and_label_the_round(run_cli, tmp_path):
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    code, page, _ = run_cli(model, "--local-samples", "64", "-b", "16", "--format", "html")
    assert code == 1
    texts = _texts(_svg(page, "bound"))
    # The card says each sample: deficit 0 of 20; the bar beside it says the same first, and the round's count
    # (a deficit of the 64 samples at once) comes last under its own name.
    assert "deficit 0" in page[page.index('aria-label="verdict"') :][:2000]
    each = texts.index("Directions of each sample (its rank bound)")
    whole = texts.index("The round as a whole: all its samples at once, no guarantee for any one")
    assert each < whole
    assert texts[each + 1 : each + 3] == ["rank ≤ 12 (100 %)", "certified deficit 0 of 12"]
    assert texts[whole + 1 : whole + 3] == ["rank ≤ 259 (33.7 %)", "certified deficit 509 of 768"]
    # FedSGD at batch size 1 keeps the single count of input directions.
    _, page, _ = run_cli(model, "--format", "html")
    texts = _texts(_svg(page, "bound"))
    assert "Input directions (the rank bound)" in texts and not any("as a whole" in text for text in texts)


def test_the_fisher_floor_is_drawn_against_sigma_where_it_was_measured(run_cli, tmp_path):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    page_file, json_file = tmp_path / "r.html", tmp_path / "r.json"
    code, out, _ = run_cli(
        model,
        "--dp-noise",
        "0.5",
        "--verify",
        "fisher",
        "--fail-on",
        "never",
        "--html",
        page_file,
        "--format",
        "json",
        "-o",
        json_file,
    )
    assert code == 0
    import json

    line = json.loads(json_file.read_text())["verification"]["fisher"]
    chart = _svg(page_file.read_text(), "fisher")
    lines = [node for node in chart.iter() if node.tag.endswith("line")]
    titled = {"".join(node.itertext()).strip(): node for node in lines if "".join(node.itertext()).strip()}
    least = next(node for title, node in titled.items() if title.startswith("σ ") and "every measured sample" in title)
    target = titled[f"--psnr-target {line['psnr_target']:g} dB"]
    assert f"σ {line['least_noise']:.3g}:" in "".join(least.itertext())
    # Where the least σ stands, the highest sample line meets the target line: the picture reads as the figure does.
    at = float(least.get("x1"))
    heights = []
    for node in lines:
        if "a sample:" in "".join(node.itertext()):
            x1, y1, x2, y2 = (float(node.get(key)) for key in ("x1", "y1", "x2", "y2"))
            heights.append(y1 + (y2 - y1) * (at - x1) / (x2 - x1))
    assert len(heights) == len(line["samples"])
    assert min(heights) == pytest.approx(float(target.get("y1")), abs=1.5)
    # And it is absent where the Fisher line was not computed.
    _, page, _ = run_cli(model, "--dp-noise", "0.5", "--fail-on", "never", "--format", "html")
    assert 'class="fisher"' not in page
