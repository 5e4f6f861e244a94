"""rankaudit: predicts from a PyTorch architecture alone whether shared gradients reveal a client's input."""

__version__ = "0.1.0"

# The name this project installs under: "rankaudit" on PyPI is another project. The import package and the command
# stay `rankaudit`. Until a release is on PyPI, installs come from the tagged repository.
DISTRIBUTION = "rankaudit-fl"
REPOSITORY = "https://github.com/rankaudit/rankaudit"


def install_hint(extra: str) -> str:
    """The pip line that adds an optional extra to this installation (from the release tag of this version)."""
    return f'pip install "{DISTRIBUTION}[{extra}] @ git+{REPOSITORY}@v{__version__}"'
