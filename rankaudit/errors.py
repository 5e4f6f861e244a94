"""The errors rankaudit reports to a user: one line, a cause, a fix, and the exit code they map to."""


def one_line(text: str) -> str:
    """`text` as one line of a terminal: a newline or other control character (in a file name, say) is escaped so
    that it cannot split the line or forge another. A name's bytes that arrived escaped (the C locale) show as the
    UTF-8 text they are, or as \\xNN where they are not UTF-8."""
    if text.isprintable():
        return text
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no decoder made
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(character if character.isprintable() else repr(character)[1:-1] for character in text)


class RankauditError(Exception):
    """A problem the user can fix; printed as one line, never as a traceback (unless --debug)."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem}; fix: {self.fix}" if self.fix else self.problem


class UsageError(RankauditError):
    """Bad arguments or configuration: a missing path, a malformed shape, an ambiguous file (exit 2)."""

    exit_code = 2


class ModelLoadError(RankauditError):
    """The model file raised, held no model, or could not be built (exit 3)."""

    exit_code = 3


class NoModelInFile(ModelLoadError):
    """The file defines no nn.Module at all (a helper module, say): pre-commit hooks may skip it."""


class NoZeroArgumentModel(ModelLoadError):
    """The file defines models, but each needs constructor arguments and none were given (building blocks, say):
    pre-commit hooks skip it too, since [[tool.rankaudit.models]] model-args names what is to be audited."""


class TraceError(ModelLoadError):
    """Neither torch.fx nor torch.export could turn the model into a graph (exit 3)."""


class Interrupted(RankauditError):
    """Ctrl-C: exit 130 (128 + SIGINT, the shell's convention), without a report."""

    exit_code = 130


class ModelEndedProcess(ModelLoadError):
    """The model's code called sys.exit/os._exit (or raised SystemExit): it tried to end rankaudit (exit 3)."""


class OutOfMemory(ModelLoadError):
    """The model's process went over its memory limit (exit 3), in a named phase (the import, the trace, ...)."""

    def __init__(self, phase: str, limit: str, cause: BaseException | None = None):
        if isinstance(cause, RecursionError):  # the depth the limit holds (rankaudit.model.supervise)
            super().__init__(
                f"the model's process ran out of memory during {phase}: a recursion went as deep as its memory "
                f"limit ({limit}) holds; no report was written",
                "give the recursion in the model's code an end (the traceback with --debug shows where), or raise "
                "--memory-limit GIB if it is that deep on purpose",
            )
            return
        super().__init__(
            f"the model's process ran out of memory during {phase} (its memory limit is {limit}); no report was "
            "written",
            "raise the limit with --memory-limit GIB (or memory-limit in [tool.rankaudit]), or shrink the model or "
            "its input shape",
        )
