"""Writes the pictures the documentation shows into docs/img/: the RA-i chart and the layer graph with its min cut,
drawn by the same code as the HTML report, and an original beside its reconstruction from a real `--verify rgap` run.

Run from the repository root after changing how the report draws (`python docs/pictures.py`; the reconstruction
needs the verify extra). tests/test_docs.py checks that the committed charts match what the code draws now.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
# The example drawn: a partial verdict whose min cut runs through gradients.
CHARTS = ("fig2_e",)
GRAPHS = ("fig2_e",)
RECONSTRUCTED = "lenet"
_SVG_NS = 'xmlns="http://www.w3.org/2000/svg"'


def standalone(svg_text: str) -> str:
    """An inline SVG of the report as a file a page can show with <img>: the namespace added, a final newline."""
    if _SVG_NS not in svg_text:
        svg_text = svg_text.replace("<svg ", f"<svg {_SVG_NS} ", 1)
    return svg_text.rstrip("\n") + "\n"


def drawings() -> dict[str, str]:
    """File name -> SVG text, for every chart and graph the pages show."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rankaudit.audit import audit
    from rankaudit.report import svg

    out = {}
    for example in sorted(set(CHARTS) | set(GRAPHS)):
        result = audit(str(ROOT / "examples" / f"{example}.py"))
        if example in CHARTS:
            out[f"{example}-ra-chart.svg"] = standalone(svg.ra_chart(result))
        if example in GRAPHS:
            out[f"{example}-graph.svg"] = standalone(svg.architecture_graph(result))
    return out


def reconstruction(scale: int = 6) -> None:
    """`rankaudit examples/lenet.py --verify rgap`, its first original and reconstruction enlarged for the page."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "rankaudit", f"examples/{RECONSTRUCTED}.py", "--verify", "rgap"]
        command += ["--samples", "1", "--seed", "0", "--artifacts", folder, "--fail-on", "never", "--quiet"]
        subprocess.run(command, cwd=ROOT, check=True)
        for kind in ("original", "reconstruction"):
            image = Image.open(Path(folder) / f"{kind}_0.png")
            image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
            image.save(IMG / f"{RECONSTRUCTED}-{kind}.png")


if __name__ == "__main__":
    IMG.mkdir(exist_ok=True)
    for name, text in drawings().items():
        (IMG / name).write_text(text, encoding="utf-8")
    if "--no-attack" not in sys.argv:
        reconstruction()
    print(f"wrote {sorted(p.name for p in IMG.iterdir())}")
