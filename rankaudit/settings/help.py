"""The `--help` layout: which group each option is listed under, in what order, and each command's examples."""

from __future__ import annotations

import click

# The groups, in the order `--help` lists them.
ANALYSIS, ROUND, DP, VERIFY, OUTPUT, POLICY, RUNNING = (
    "Analysis",
    "Federated round",
    "Differential privacy",
    "Verifying with real attacks",
    "Output",
    "Policy (the exit code)",
    "Running",
)
GROUPS = (ANALYSIS, ROUND, DP, VERIFY, OUTPUT, POLICY, RUNNING)
# An option missing from the table below is still listed (under this heading); tests/test_cli_help.py fails on it.
UNGROUPED = "Other"

# Option (its long name) -> group. A new option needs one line here.
OPTION_GROUP = {
    "--input-shape": ANALYSIS,
    "--input-dtype": ANALYSIS,
    "--batch-size": ANALYSIS,
    "--shared-layers": ANALYSIS,
    "--withheld-layers": ANALYSIS,
    "--model-arg": ANALYSIS,
    "--run-config": ANALYSIS,
    "--stand-in": ANALYSIS,
    "--no-stand-ins": ANALYSIS,
    "--top": ANALYSIS,
    "--local-samples": ROUND,
    "--local-epochs": ROUND,
    "--lr": ROUND,
    "--optimizer": ROUND,
    "--momentum": ROUND,
    "--clients": ROUND,
    "--server-rounds": ROUND,
    "--available-clients": ROUND,
    "--bn-mode": ROUND,
    "--dp-noise": DP,
    "--dp-clip": DP,
    "--dp-sample-rate": DP,
    "--dp-steps": DP,
    "--dp-delta": DP,
    "--dp-level": DP,
    "--prior": DP,
    "--noise-by": DP,
    "--target-epsilon": DP,
    "--dp-candidates": DP,
    "--psnr-target": DP,
    "--verify": VERIFY,
    "--samples": VERIFY,
    "--seed": VERIFY,
    "--device": VERIFY,
    "--data": VERIFY,
    "--steps": VERIFY,
    "--artifacts": VERIFY,
    "--trials": VERIFY,
    "--class-dist": VERIFY,
    "--aux": VERIFY,
    "--defense": VERIFY,
    "--rank-precision": VERIFY,
    "--rank-method": VERIFY,
    "--rank-budget": VERIFY,
    "--weights": VERIFY,
    "--labels": VERIFY,
    "--energy-budget": VERIFY,
    "--format": OUTPUT,
    "--output": OUTPUT,
    "--html": OUTPUT,
    "--quiet": OUTPUT,
    "--log": OUTPUT,
    "--verbose": OUTPUT,
    "--fail-on": POLICY,
    "--min-ra": POLICY,
    "--max-recoverable": POLICY,
    "--exposed-below": POLICY,
    "--certificate-quantile": POLICY,
    "--max-reconstruction": POLICY,
    "--action": POLICY,
    "--min-psnr": POLICY,
    "--feature-action": POLICY,
    "--noise-scale": POLICY,
    "--min-hidden": POLICY,
    "--timeout": RUNNING,
    "--memory-limit": RUNNING,
    "--skip-non-models": RUNNING,
    "--debug": RUNNING,
    "--version": RUNNING,
    "--help": RUNNING,
}

# Command name (the group's is "cli") -> (command line, what it does), under "Examples" at the end of its --help.
EXAMPLES = {
    "cli": (
        ("rankaudit examples/cnn6.py", "the verdict for the model in the file (same as `rankaudit check`)"),
        ("rankaudit path/to/flower-app", "a Flower app or NVFlare job, with the round and DP read from it"),
        ("rankaudit suggest examples/cnn6.py", "design changes that would protect the input"),
        ("rankaudit compare a.py b.py", "two models side by side"),
        ("rankaudit guard net.py --weights w.pt --data batch.npz", "a client's update: send or block"),
    ),
    "check": (
        ("rankaudit examples/cnn6.py", "table and verdict; exit 1 unless protected"),
        ("rankaudit net.py:Net --input-shape 3,32,32 -b 8", "one class of the file, its input shape, batch of 8"),
        ("rankaudit net.py --withheld-layers fc", "the gradient of fc is not sent"),
        ("rankaudit net.py --local-epochs 2 --local-samples 64", "one round of local training, not FedSGD"),
        ("rankaudit net.py --dp-noise 1.0 --max-reconstruction 0.05", "DP-SGD: the bound on any reconstruction"),
        ("rankaudit examples/lenet.py --verify rank", "measure the exact rank, beside the bound"),
        ("rankaudit net.py --dp-noise 1.0 --verify fisher", "each sample's MSE floor under that noise (unbiased)"),
        ("rankaudit net.py --format sarif -o ra.sarif --fail-on never", "SARIF for code scanning, never fail"),
        ("rankaudit net.py --html report.html", "also the self-contained HTML report"),
    ),
    "suggest": (
        ("rankaudit suggest examples/cnn6.py", "the edits that change the verdict, best first"),
        ("rankaudit suggest net.py --max-reconstruction 0.05", "also the least DP noise that meets 5 %"),
        (
            "rankaudit suggest net.py --dp-noise 1.0 --max-reconstruction 0.05 --psnr-target 20",
            "per edit, also the least σ keeping unbiased reconstructions at or below 20 dB",
        ),
        ("rankaudit suggest net.py --format html -o review.html", "the full report with the suggestions"),
    ),
    "guard": (
        ("rankaudit guard net.py --weights w.pt --data batch.npz -b 8", "send or block this client's update"),
        ("rankaudit guard net.py --weights w.pt --data x.npy --labels y.npy", "samples and labels apart"),
        ("rankaudit guard net.py --weights w.pt --data b.npz --action drop", "drop the rows that read a sample"),
    ),
    "compare": (
        ("rankaudit compare old.py new.py", "both verdicts and what changed"),
        ("rankaudit compare old.py new.py --format json", "the same as JSON"),
        ("rankaudit compare old.py new.py --dp-noise 1.0", "also each design's Fisher floor at the same σ"),
    ),
}


# Command name -> what its exit codes mean, after the options in its --help (and on the CLI reference page).
_MODEL_FAILED = "3 model not loaded, traced or verified (or it ended the process, or overran --timeout)"
EXIT_CODES = {
    "cli": f"0 pass, 1 policy failed, 2 usage or configuration, {_MODEL_FAILED}, 130 interrupted.",
    "check": f"0 pass, 1 policy failed, 2 usage or configuration, {_MODEL_FAILED}, 130 interrupted.",
    "suggest": (
        "0 the suggestions are written, whatever the verdict (suggest gates nothing: `rankaudit check` gives "
        f"the policy's exit code), 2 usage or configuration, {_MODEL_FAILED}, 130 interrupted."
    ),
    "compare": (
        "0 the second model (B) passes the policy, 1 it fails it, 2 usage or configuration, "
        f"{_MODEL_FAILED}, 130 interrupted."
    ),
    "guard": (
        "0 the update goes as computed, 1 it reads a sample of the batch exactly or the received weights are not "
        "the audited model's (block, drop or noise), 2 usage or configuration, "
        f"{_MODEL_FAILED}, 130 interrupted."
    ),
}


def long_name(option: click.Option) -> str:
    """The option's `--name` (its first long spelling), the key of OPTION_GROUP."""
    return next((name for name in option.opts + option.secondary_opts if name.startswith("--")), option.opts[0])


def group_of(option: click.Option) -> str:
    return OPTION_GROUP.get(long_name(option), UNGROUPED)


def examples_text(command_name: str) -> str:
    """The Examples block as plain lines (the CLI reference page shows the same)."""
    rows = EXAMPLES.get(command_name, ())
    width = max((len(line) for line, _ in rows), default=0)
    return "\n".join(f"  {line.ljust(width)}   {what}" for line, what in rows)


class GroupedHelp:
    """Mixin for click commands: options listed under their group's heading, then the command's examples."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        by_group: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):
                by_group.setdefault(group_of(param), []).append(record)
        for group in (*GROUPS, UNGROUPED):
            if by_group.get(group):
                with formatter.section(group):
                    formatter.write_dl(by_group[group])
        if isinstance(self, click.Group):
            self.format_commands(ctx, formatter)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.name in EXIT_CODES:
            formatter.write_paragraph()
            formatter.write_text("Exit codes: " + EXIT_CODES[self.name])
        if self.name in EXAMPLES:
            formatter.write_paragraph()
            formatter.write_text("Examples:")
            formatter.write(examples_text(self.name) + "\n")


class GroupedCommand(GroupedHelp, click.Command):
    pass
