"""`--help` is grouped from one table (rankaudit/settings/help.py): every option has a group and a help text."""

import click
from click.testing import CliRunner

from rankaudit.cli import cli
from rankaudit.settings import help as cli_help


def _commands():
    yield "rankaudit", cli
    for name, command in cli.commands.items():
        yield f"rankaudit {name}", command


def test_every_option_has_a_group_and_a_help_text():
    ungrouped, silent = [], []
    for path, command in _commands():
        ctx = click.Context(command, info_name=path)
        for param in command.get_params(ctx):
            if not isinstance(param, click.Option) or param.hidden:
                continue
            name = cli_help.long_name(param)
            if name not in cli_help.OPTION_GROUP:
                ungrouped.append(f"{path} {name}")
            if not (param.get_help_record(ctx) or ("", ""))[1].strip():
                silent.append(f"{path} {name}")
    assert ungrouped == [], "add each option to OPTION_GROUP in rankaudit/settings/help.py"
    assert silent == [], "give each option a help= text"
    assert set(cli_help.OPTION_GROUP.values()) <= set(cli_help.GROUPS)


def test_check_help_lists_the_groups_in_order_with_examples():
    text = CliRunner().invoke(cli, ["check", "--help"], terminal_width=120).output
    headings = [line[:-1] for line in text.splitlines() if line[:-1] in cli_help.GROUPS and line.endswith(":")]
    assert headings == list(cli_help.GROUPS)
    assert cli_help.UNGROUPED + ":" not in text.splitlines()
    # Each option sits under its own group's heading: --dp-steps under DP, --seed under the verifiers.
    assert text.index("Differential privacy:") < text.index("--dp-steps") < text.index("Verifying with real attacks:")
    assert text.index("Verifying with real attacks:") < text.index("--seed") < text.index("Output:")
    examples = text[text.index("Examples:") :]
    assert "rankaudit examples/lenet.py --verify rank" in examples


def test_dp_rate_and_steps_help_states_the_default_from_the_round():
    text = " ".join(CliRunner().invoke(cli, ["check", "--help"], terminal_width=400).output.split())
    rate = text[text.index("--dp-sample-rate") : text.index("--dp-steps")]
    steps = text[text.index("--dp-steps") : text.index("--dp-delta")]
    assert "B/N" in rate and "C/M" in rate and "default 1:" not in rate
    assert "server rounds" in steps and "(default 1)" not in steps


def test_an_option_missing_from_the_table_is_still_listed():
    @click.command(cls=cli_help.GroupedCommand)
    @click.option("--brand-new", help="An option added elsewhere.")
    def command(brand_new):
        pass

    text = CliRunner().invoke(command, ["--help"]).output
    assert f"{cli_help.UNGROUPED}:" in text and "--brand-new" in text


def test_every_command_help_says_what_its_exit_codes_mean():
    """`rankaudit --help` lists the exit codes; each command's --help says them too, in its own terms."""
    texts = {
        path: " ".join(CliRunner().invoke(command, ["--help"], terminal_width=400).output.split())
        for path, command in _commands()
    }
    for path, text in texts.items():
        assert "Exit codes: " in text, path
        assert "2 usage or configuration" in text and "130 interrupted" in text, path
    assert "Exit codes: 0 pass, 1 policy failed" in texts["rankaudit check"]
    assert "Exit codes: 0 the suggestions are written, whatever the verdict" in texts["rankaudit suggest"]
    assert "Exit codes: 0 the second model (B) passes the policy, 1 it fails it" in texts["rankaudit compare"]


def test_suggest_says_its_exit_code_on_an_exposed_model(run_cli):
    from conftest import EXAMPLES

    code, out, _ = run_cli("suggest", EXAMPLES / "fig2_a.py", "--top", "1")
    assert code == 0
    assert out.rstrip().splitlines()[-1] == (
        f"Exit code 0 whatever the verdict (exposed here): suggest proposes, it gates nothing; "
        f"`rankaudit check {EXAMPLES / 'fig2_a.py'}` gives the policy's exit code."
    )
