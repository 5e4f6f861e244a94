"""rankaudit: predicts from a PyTorch architecture alone whether shared gradients reveal a client's input."""

__version__ = "0.1.0"

# The name this project installs under: "rankaudit" on PyPI is another project. The import package and the command
# stay `rankaudit`. No release is published yet: installs come from a clone or from the repository's default branch.
DISTRIBUTION = "rankaudit-fl"
REPOSITORY = "https://github.com/rankaudit/rankaudit"


def extra_requirements(extra: str) -> list[str]:
    """The requirements pyproject.toml lists for an optional extra, as this installation's metadata records them
    (empty when rankaudit runs from a checkout that was never installed)."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = f'extra == "{extra}"'
    return [line.split(";")[0].strip() for line in requires if marker in line.replace("'", '"')]


def install_hint(extra: str) -> str:
    """The pip line that adds an optional extra to the environment rankaudit runs in: its packages by name, which
    works wherever rankaudit was installed from (a clone, the repository, a pre-commit hook's own environment)."""
    packages = extra_requirements(extra)
    if not packages:
        return f'pip install -e ".[{extra}]" in your clone of {REPOSITORY}'
    return "pip install " + " ".join(f'"{package}"' for package in packages)
