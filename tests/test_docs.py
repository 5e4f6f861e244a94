"""The README and the documentation site stay true to the code: links, the config keys, the CLI, the module map."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CI_COMMAND = 'pip install -e ".[test]" && pytest'

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _hooks():
    """docs/hooks.py, the mkdocs hook that writes the CLI reference and includes the changelog."""
    spec = importlib.util.spec_from_file_location("rankaudit_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _expanded(path: Path) -> str:
    """A page as mkdocs renders it: the generated CLI reference and the included changelog filled in."""
    text = path.read_text(encoding="utf-8")
    if path.parent == DOCS:
        text = _hooks().on_page_markdown(text, page=None, config=None, files=None)
    return text


def _heading_text(markdown: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)  # a link keeps its text
    return text.replace("`", "").replace("**", "").replace("*", "")


def _slug_mkdocs(text: str) -> str:
    """Python-Markdown's toc slug (what mkdocs gives each heading)."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _slug_github(text: str) -> str:
    """GitHub's heading anchor (what a link from the README is followed to)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> tuple[set[str], set[str]]:
    """(GitHub anchors, mkdocs anchors) of a Markdown file's headings, code blocks left out."""
    headings = [_heading_text(m.group(2)) for m in _HEADING.finditer(_FENCE.sub("", _expanded(path)))]
    return {_slug_github(h) for h in headings}, {_slug_mkdocs(h) for h in headings}


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _broken_links(source: Path) -> list[str]:
    """Every relative link of `source` whose file does not exist or whose #anchor is no heading there.

    An anchor must work on GitHub and on the site alike (both slugs), since both show these pages."""
    broken = []
    for target in _LINK.findall(_without_code(source.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here (offline)
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (source.parent / path_part).resolve() if path_part else source
        where = f"{_shown(source)}: ({target})"
        if not resolved.exists():
            broken.append(f"{where}: {path_part} does not exist")
            continue
        if anchor and resolved.suffix == ".md":
            github, mkdocs = _anchors(resolved)
            if anchor not in github or anchor not in mkdocs:
                broken.append(f"{where}: no heading with the anchor #{anchor} in {_shown(resolved)}")
    return broken


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, (
        f"README.md has {len(lines)} lines; the front page holds at most 200 (move the rest to docs/)"
    )
    # .ci/run runs this line; the README shows it byte for byte.
    assert CI_COMMAND in lines
    assert CI_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_readme_reaches_the_ci_page_in_one_click():
    assert "docs/ci.md" in _LINK.findall(README.read_text(encoding="utf-8"))


def test_readme_and_changelog_links_and_anchors_resolve():
    assert _broken_links(README) + _broken_links(ROOT / "CHANGELOG.md") == []


def test_docs_links_and_anchors_resolve():
    broken = [line for page in _pages() for line in _broken_links(page)]
    assert broken == []


def test_link_checker_finds_a_broken_anchor_and_a_missing_file(tmp_path):
    page = tmp_path / "a.md"
    page.write_text(
        "# Title: the `code` part\n\n[ok](#title-the-code-part) [no](#nope) [gone](b.md)\n```\n[x](c.md)\n```\n"
    )
    broken = _broken_links(page)
    assert len(broken) == 2, broken
    assert "#nope" in broken[0] and "b.md does not exist" in broken[1]


def test_every_page_is_in_the_navigation():
    yaml = pytest.importorskip("yaml", reason="needs PyYAML, not installed (pip install -e '.[test]')")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            else:
                for value in item.values():
                    yield from entries(value) if isinstance(value, list) else [value]

    listed = set(entries(config["nav"]))
    pages = {page.relative_to(DOCS).as_posix() for page in _pages()}
    assert sorted(pages - listed) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(listed - pages) == [], "nav entries without a page"


def test_every_verifier_has_its_page():
    from rankaudit.cli import cli

    verify = next(p for p in cli.commands["check"].params if p.name == "verify")
    choices = getattr(verify.type, "choices", None)
    assert choices, "--verify is no longer a click.Choice: read the verifier names from where the CLI gets them"
    missing = [name for name in choices if not (DOCS / "verify" / f"{name}.md").is_file()]
    assert missing == [], f"--verify choices without a page docs/verify/NAME.md: {missing}"


# ---- the configuration reference: every [tool.rankaudit*] key the code reads -----------------------------------


def _keys_from_code() -> dict[str, set[str]]:
    """Table -> keys, from the sets the code validates against and from config.py's own `"key" in table["sub"]`."""
    from rankaudit.settings import dp_options, guard_options, round
    from rankaudit.settings import pyproject as config

    keys = {
        "[tool.rankaudit]": set(config.TOP_KEYS),
        "[[tool.rankaudit.models]]": set(config.MODEL_KEYS),
        "[tool.rankaudit.round]": set(round.ROUND_KEYS),
        "[tool.rankaudit.dp]": set(dp_options.OPTION_RULES),
        "[tool.rankaudit.flower]": set(config.CONVENTIONAL_KEYS),
        "[tool.rankaudit.guard]": set(guard_options.GUARD_KEYS),
    }
    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # keys read outside the sets, e.g. "dataset-size" in table["round"]
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
            and isinstance(node.ops[0], ast.In)
            and isinstance(node.comparators[0], ast.Subscript)
            and isinstance(node.comparators[0].slice, ast.Constant)
        ):
            table = node.comparators[0].slice.value
            name = "[[tool.rankaudit.models]]" if table == "models" else f"[tool.rankaudit.{table}]"
            keys.setdefault(name, set()).add(node.left.value)
    return keys


def _keys_documented() -> dict[str, set[str]]:
    """Table -> keys in the first column of each table under 'Configuration reference' on the CI page."""
    text = (DOCS / "ci.md").read_text(encoding="utf-8")
    reference = text.split("## Configuration reference", 1)[1]
    documented: dict[str, set[str]] = {}
    for section in re.split(r"^### ", reference, flags=re.M)[1:]:
        title = section.splitlines()[0].strip().strip("`")
        documented[title] = set(re.findall(r"^\| `([a-z-]+)` \|", section, re.M))
    return documented


def test_config_reference_documents_every_key_the_code_reads():
    code, documented = _keys_from_code(), _keys_documented()
    assert "dataset-size" in code["[tool.rankaudit.round]"]  # found in config.py itself, not in ROUND_KEYS
    missing = {table: sorted(keys - documented.get(table, set())) for table, keys in code.items()}
    stale = {table: sorted(keys - code.get(table, set())) for table, keys in documented.items()}
    assert {t: k for t, k in missing.items() if k} == {}, "keys the code reads, missing from docs/ci.md"
    assert {t: k for t, k in stale.items() if k} == {}, "keys on docs/ci.md the code does not read"


# ---- the CLI reference, generated from the click commands ------------------------------------------------------


def _commands(command: click.Command, path: tuple[str, ...] = ("rankaudit",)):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


def test_cli_reference_covers_every_command_and_option():
    from rankaudit.cli import cli

    reference = _hooks().cli_reference()
    absent = []
    for path, command in _commands(cli):
        if f"`{' '.join(path)}`" not in reference:
            absent.append(" ".join(path))
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                absent += [
                    f"{' '.join(path)} {opt}" for opt in param.opts + param.secondary_opts if opt not in reference
                ]
    assert absent == []
    assert len(list(_commands(cli))) >= 4  # the group, check, suggest, compare


def test_cli_reference_needs_no_torch():
    """The site builds where torch is not installed: the generator imports click and rankaudit.cli only."""
    probe = (
        "import runpy, sys; runpy.run_path('docs/hooks.py', run_name='__main__'); "
        "sys.stdout.flush(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "### `rankaudit check`" in run.stdout


# ---- the module map --------------------------------------------------------------------------------------------


def _module_row(path: str) -> str:
    """A row for docs/modules.md from the module's one-line docstring."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text(encoding="utf-8"))) or ""
    purpose = doc.strip().splitlines()[0] if doc.strip() else "(no module docstring: write one)"
    return f"| `{path}` | {purpose.replace('|', chr(92) + '|')} |"


def test_module_map_matches_the_package():
    page = (DOCS / "modules.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(rankaudit/[\w/]+\.py)` \| *(.*?) *\|$", page, re.M)
    listed = [path for path, _ in rows]
    package = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "rankaudit").rglob("*.py") if "__pycache__" not in p.parts
    )
    missing = [path for path in package if path not in listed]
    stale = sorted(set(listed) - set(package))
    twice = sorted({path for path in listed if listed.count(path) > 1})
    empty = [path for path, purpose in rows if not purpose]
    problems = []
    if missing:
        problems.append(
            "modules missing from docs/modules.md; add each row to the table of its step (text from the docstring):\n"
            + "\n".join(_module_row(path) for path in missing)
        )
    if stale:
        problems.append(
            "rows on docs/modules.md for modules that do not exist (moved or removed: fix or delete the row):\n"
            + "\n".join(f"  {path}" for path in stale)
        )
    if twice:
        problems.append("rows listed twice: " + ", ".join(twice))
    if empty:
        problems.append("rows without a purpose: " + ", ".join(empty))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_module_map_has_one_section_per_folder():
    """The map reads like the tree: each folder of the package is one section, headed by its path, and every row
    sits in the section of its own folder."""
    page = (DOCS / "modules.md").read_text(encoding="utf-8")
    misplaced, folders_seen = [], []
    folder = None
    for line in page.splitlines():
        heading = re.match(r"^### `(rankaudit/(?:[\w/]+/)?)`", line)
        if heading:
            folder = heading.group(1)
            folders_seen.append(folder)
            continue
        row = re.match(r"^\| `(rankaudit/[\w/]+\.py)` \|", line)
        if row and (folder is None or row.group(1).rsplit("/", 1)[0] + "/" != folder):
            misplaced.append(f"{row.group(1)} under {folder}")
    assert not misplaced, "rows outside their folder's section:\n" + "\n".join(misplaced)
    folders = sorted({p.parent.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "rankaudit").rglob("*.py")})
    assert sorted(folders_seen) == folders, f"sections {sorted(folders_seen)}, folders {folders}"


# ---- the site builds, strict and offline -----------------------------------------------------------------------

_EXTERNAL_ASSET = re.compile(
    r"<(?:link|script|img|iframe|source|video|audio)\b[^>]*\b(?:href|src)=[\"'](?:https?:)?//"
    r"|url\(\s*[\"']?(?:https?:)?//"
    r"|@import\s+[\"'](?:https?:)?//",
    re.I,
)


def test_mkdocs_build_strict_offline(tmp_path):
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f'{module} is not installed: pip install -e ".[docs]" to build the documentation site')
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    external = [
        f"{path.relative_to(site)}: {match.group(0)}"
        for path in site.rglob("*")
        if path.suffix in (".html", ".css", ".js") and path.is_file()
        for match in _EXTERNAL_ASSET.finditer(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert external == [], "the built site loads assets from the network"
    cli_page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    from rankaudit.cli import cli

    for path, command in _commands(cli):
        assert f"{' '.join(path)}</code>" in cli_page
        shown = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]  # hidden: a retired flag
        assert all(opt in cli_page for p in shown for opt in p.opts)
    assert not (site / "hooks.py").exists()


def test_sarif_rule_table_matches_the_rules():
    """docs/schema.md lists every SARIF rule with the name, level and security-severity the report writes."""
    from rankaudit.report.sarif import RULES

    page = (DOCS / "schema.md").read_text(encoding="utf-8")
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(RA\d+)` \| `([\w-]+)` \| (\w+) \| ([\d.]+) \|", page, re.M)}
    expected = {rule: (name, level, severity) for rule, (name, _, level, severity) in RULES.items()}
    assert rows == expected


_REPO_PATH = re.compile(r"(?<![\w./-])((?:rankaudit|examples|benchmarks|tests|templates)/[\w/.-]*\w)")
# Named in the docs on purpose, yet no path of the checkout: the wheel's name for the top-level templates/ folder.
_NOT_IN_THE_CHECKOUT = {"rankaudit/templates"}
_DOTTED = re.compile(r"(?<![\w.])rankaudit\.(?!sarif\b)([a-z_][\w.]*\w)")


def _missing_code_reference(dotted: str) -> bool:
    """rankaudit.a.b.name: a module a/b (or package) exists and, if a name is left over, the module defines it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT / "rankaudit" / Path(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            if not rest:
                return False
            source = module.read_text(encoding="utf-8")
            return len(rest) > 1 or not re.search(rf"^(?:def|class) {rest[0]}\b|^{rest[0]} *[:=]", source, re.M)
    return True


def test_files_and_modules_named_in_the_docs_exist():
    """A page naming a module, example, benchmark or test that was moved or removed fails here (with the page)."""
    stale = []
    for page in [README, *_pages()]:  # not CHANGELOG.md: its history names the paths of its day
        text = page.read_text(encoding="utf-8")
        for path in sorted(set(_REPO_PATH.findall(text))):
            placeholder = "*" in path or any(part.split(".")[0].isupper() for part in path.split("/"))  # examples/X.py
            if not (ROOT / path).exists() and not placeholder and path not in _NOT_IN_THE_CHECKOUT:
                stale.append(f"{_shown(page)}: {path}")
        for dotted in sorted(set(_DOTTED.findall(text))):
            if _missing_code_reference(dotted):
                stale.append(f"{_shown(page)}: rankaudit.{dotted}")
    assert stale == []


# ---- the pictures on the pages ---------------------------------------------------------------------------------

_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_every_picture_on_a_page_exists():
    missing = [
        f"{_shown(page)}: {target}"
        for page in [README, *_pages()]
        for target in _IMAGE.findall(_without_code(page.read_text(encoding="utf-8")))
        if not re.match(r"[a-z]+:", target) and not (page.parent / target).is_file()
    ]
    assert missing == []
    assert len([page for page in _pages() if _IMAGE.search(page.read_text(encoding="utf-8"))]) >= 3


def test_the_charts_on_the_pages_are_what_the_report_draws_now():
    """docs/img holds the HTML report's own RA-i chart and min-cut graph; after a change to how the report draws,
    `python docs/pictures.py` writes them again."""
    spec = importlib.util.spec_from_file_location("rankaudit_docs_pictures", DOCS / "pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    drawn = pictures.drawings()
    assert {"fig2_e-graph.svg", "fig2_e-ra-chart.svg"} <= set(drawn)
    stale = [name for name, text in drawn.items() if (DOCS / "img" / name).read_text(encoding="utf-8") != text]
    assert stale == [], "run `python docs/pictures.py --no-attack` and commit docs/img"
    assert 'class="cut"' in drawn["fig2_e-graph.svg"] and "∇conv2" in drawn["fig2_e-graph.svg"]


# ---- every pasted line works from a clone of this repository -----------------------------------------------------

_NAMED_REF = re.compile(
    r"rankaudit/rankaudit(?:\.git)?(?:@|/blob/|/tree/|/releases/tag/)([^\s\"'`)#/]+)|^\s*rev:\s*['\"]?(v?\d[^\s'\"]*)",
    re.M,
)


def test_no_page_or_message_names_a_tag_the_repository_does_not_have():
    """Install lines, CI and pre-commit snippets, SARIF links and the error hints name only refs that exist: the
    default branch, or a tag `git tag` lists."""
    tags = set(subprocess.run(["git", "tag"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    sources = [README, ROOT / ".pre-commit-hooks.yaml", *_pages(), *sorted((ROOT / "rankaudit").rglob("*.py"))]
    named = [
        f"{_shown(source)}: {ref}"
        for source in sources
        for match in _NAMED_REF.finditer(source.read_text(encoding="utf-8"))
        for ref in filter(None, match.groups())
        if ref not in tags | {"main"}
    ]
    assert named == []
    code = [_shown(path) for path in (ROOT / "rankaudit").rglob("*.py") if "@v{" in path.read_text(encoding="utf-8")]
    assert code == []


@pytest.mark.parametrize("extra", ["dp", "verify", "bench"])
def test_the_missing_extra_hint_names_the_extras_packages(extra):
    """The hint works in whatever environment rankaudit runs in (a clone, a pre-commit hook): pip with the
    extra's packages as pyproject.toml lists them, no ref of the repository."""
    import tomllib

    from rankaudit import install_hint

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    hint = install_hint(extra)
    assert "@" not in hint
    assert hint == "pip install " + " ".join(f'"{package}"' for package in listed) or hint.startswith("pip install -e")


def test_every_picture_of_an_input_on_a_page_is_at_least_128_pixels_wide():
    """A 32 px input shown at 32 px is unreadable: the pages' PNGs are enlarged by whole pixels (no smoothing)."""
    import struct

    narrow = []
    for page in [README, *_pages()]:
        for target in _IMAGE.findall(_without_code(page.read_text(encoding="utf-8"))):
            if target.endswith(".png"):
                data = (page.parent / target).read_bytes()
                width = struct.unpack(">I", data[16:20])[0]
                if width < 128:
                    narrow.append(f"{_shown(page)}: {target} is {width} px wide")
    assert narrow == []
