"""Thin click layer: parse, call, print, exit code."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import click

from rankaudit import __version__
from rankaudit.errors import (
    Interrupted,
    NoModelInFile,
    NoZeroArgumentModel,
    RankauditError,
    UsageError,
    one_line,
)
from rankaudit.model import options as model_options
from rankaudit.model import supervise, worker
from rankaudit.model.faults import ended_process, model_fault, out_of_memory
from rankaudit.report import emit
from rankaudit.report import files as report_files
from rankaudit.settings import flags
from rankaudit.settings.help import GroupedCommand, GroupedHelp
from rankaudit.settings.limits import MAX_COUNT, shown, too_large
from rankaudit.settings.run import ROUND_FLAGS
from rankaudit.verify import options as verify_options

EXIT_PASS, EXIT_POLICY, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3


class _RunsModel(BaseException):
    """Raised instead of running a command while argv is only being read for --help/--version in the unsupervised
    parent: the command then runs in the supervised child (never caught as an Exception)."""


class _ModelCommand(GroupedCommand):
    """A command that runs the model's code: never in the unsupervised parent (supervise.reading_help()); its
    options listed in their groups."""

    def invoke(self, ctx: click.Context):
        if supervise.reading_help():
            raise _RunsModel
        for param in self.params:  # a 400-digit --batch-size: one line, not an overflow deep in the analysis
            if isinstance(ctx.params.get(param.name), int) and too_large(ctx.params[param.name]):
                option = max(param.opts, key=len)
                raise UsageError(
                    f"{option} {shown(ctx.params[param.name])} is too large", f"give {option} at most {MAX_COUNT:,}"
                )
        return super().invoke(ctx)


class _DefaultToCheck(GroupedHelp, click.Group):
    """`rankaudit model.py` means `rankaudit check model.py`."""

    command_class = _ModelCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            meant = flags.mistyped_command(args[0], self.commands)
            if meant is not None:
                raise UsageError(
                    f"no command '{args[0]}' and no file of that name", f"did you mean `rankaudit {meant}`?"
                )
            args = ["check", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # before click turns it into Abort (exit 2, and a blank line)
            raise Interrupted("interrupted (Ctrl-C); no report was written") from exc


@click.group(cls=_DefaultToCheck, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rankaudit")
def cli():
    """Predict from a PyTorch architecture whether a shared gradient lets a server reconstruct the input.

    \b
    rankaudit MODEL.py[:NAME] [options]     same as `rankaudit check ...`
    """


@cli.command(cls=_ModelCommand)
@click.argument("models", nargs=-1, required=True, metavar="MODEL.py[:NAME]|APP_DIR...")
@click.option(
    "--input-shape",
    callback=flags.parse_shape,
    metavar="C,H,W",
    help=flags.INPUT_SHAPE_HELP,
)
@click.option(
    "--input-dtype",
    callback=model_options.parse_dtype,
    metavar="DTYPE",
    help="Input dtype: int64 for token ids (unknowns start at the embedding), or NAME=DTYPE pairs for "
    "several inputs (default: INPUT_DTYPE, else float32).",
)
@flags.check_options
@click.option(
    "--verify", "verify", multiple=True, cls=verify_options.VerifyOption, type=verify_options.VerifierChoice()
)
@flags.attack_options
@flags.check_run_options
@flags.dp_options
@flags.psnr_target_option
@flags.round_options
@model_options.limit_options
@model_options.stand_in_options
@click.pass_context
def check(
    ctx,
    models,
    input_shape,
    batch_size,
    output_format,
    output,
    html_path,
    fail_on,
    min_ra,
    max_recoverable,
    exposed_below,
    certificate_quantile,
    shared_layers,
    withheld_layers,
    quiet,
    verbose,
    verify,
    samples,
    seed,
    device,
    data,
    steps,
    artifacts,
    weights_file,
    trials,
    class_dist,
    aux,
    defenses,
    rank_precision,
    rank_method,
    skip_non_models,
    debug,
    input_dtype,
    dp_candidates,
    run_config,
    model_args,
    **options,
):
    """Count constraints per layer, find the critical layer and give a verdict.

    Settings come from the command line, else from [tool.rankaudit] in the nearest pyproject.toml above the
    model file, else from the defaults. APP_DIR (a Flower app, an NVFlare job): the model, the round and its DP are
    read from the app, each with its source; flags and [tool.rankaudit.*] win over what is read.
    """
    # torch loads with rankaudit.audit: only once the arguments, files and settings of a model have been checked, so
    # that a mistyped path or a bad setting is answered in a second.
    from rankaudit.deploy.commands import deployment_for, deployment_read
    from rankaudit.model import standins
    from rankaudit.settings.model_spec import check_path
    from rankaudit.settings.run import CONFIGURABLE, model_settings
    from rankaudit.verify import registry

    for spec in models:  # a path the system cannot open, or Python cannot name, before any other use of it
        check_path(spec, "model or app")
    commandline = click.core.ParameterSource.COMMANDLINE
    registry.check_request(verify, defenses, flags.verifier_flags(ctx), weights=weights_file, artifacts=artifacts)
    registry.check_budget(verify, steps=steps, samples=samples, trials=trials, batch_size=batch_size)
    report_files.check_outputs(
        output,
        html_path,
        artifacts,
        report_files.command_inputs(models, data=data, aux=aux, weights=weights_file),
    )
    given = {name for name in CONFIGURABLE if ctx.get_parameter_source(name) is commandline}
    values = {name: ctx.params[name] for name in CONFIGURABLE}
    results, exit_code = [], EXIT_PASS
    for spec in models:
        try:
            deployment = deployment_for(
                spec,
                flags.round_flags(ctx),
                options,
                run_config,
                model_args,
                batch_size=batch_size if ctx.get_parameter_source("batch_size") is commandline else None,
                input_shape_given=input_shape is not None,
            )
            spec = deployment.model if deployment is not None else spec
            if deployment is not None:  # the app's model file may live outside its folder
                report_files.refuse_inputs({"-o": output, "--html": html_path}, report_files.command_inputs([spec]))
            chosen = model_settings(
                spec,
                deployment,
                values,
                given,
                round_flags=flags.round_flags(ctx),
                dp_options=options,
                model_args=model_args,
            )
            supervise.set_config_timeout(chosen.timeout)
            supervise.set_config_memory_limit(chosen.memory_limit)
            standins.set_configured(chosen.stand_ins)
            from rankaudit.audit import audit

            result = audit(
                spec,
                input_shape=chosen.input_shape,
                round_=chosen.round,
                batch_size=chosen.round.batch_size,
                fail_on=chosen.fail_on,
                min_ra=chosen.min_ra,
                max_recoverable=chosen.max_recoverable,
                exposed_below=chosen.exposed_below,
                certificate_quantile=chosen.certificate_quantile,
                data=data,
                shared_layers=chosen.shared_layers,
                withheld_layers=chosen.withheld_layers,
                input_dtype=input_dtype,
                model_args=chosen.model_args,
            )
            result.reading_flags = model_options.reading_flags(ctx)  # the next step's command gives them again
            if deployment is not None:
                result.deployment = deployment_read(deployment)
            if verify:
                request = registry.VerifyContext(
                    result,
                    spec,
                    seed=seed,
                    device=device,
                    samples=samples,
                    samples_given=ctx.get_parameter_source("samples") is commandline,
                    data=data,
                    steps=steps,
                    artifacts=artifacts,
                    trials=trials,
                    class_dist=class_dist,
                    aux=aux,
                    dp=chosen.round.dp,
                    dp_candidates=dp_candidates,
                    defense_specs=tuple(defenses),
                    shared_layers=chosen.shared_layers,
                    withheld_layers=chosen.withheld_layers,
                    rank_precision=rank_precision,
                    rank_method=rank_method,
                    rank_budget=options.get("rank_budget"),
                    psnr_target=chosen.psnr_target,
                    weights=weights_file,
                    show_progress=not quiet,
                    several=len(models) > 1,
                    requested=tuple(verify),
                )
                result.verification, result.images = worker.run(_verified, verify, request, limited=False)
        except Exception as raised:
            exc = raised if isinstance(raised, RankauditError) else out_of_memory(raised) or model_fault(raised)
            if exc is None or (debug and not isinstance(raised, RankauditError)):
                raise
            if skip_non_models and isinstance(exc, (NoModelInFile, NoZeroArgumentModel)):
                if verbose:
                    click.echo(f"rankaudit: skipped {spec}: {exc.problem}", err=True)
                continue
            if debug:
                raise
            _error(f"{spec}: {exc}")
            exit_code = max(exit_code, exc.exit_code)
            continue
        results.append(result)
        if not result.policy.passed:
            exit_code = max(exit_code, EXIT_POLICY)
        if any(isinstance(record, dict) and record.get("internal_error") for record in result.verification.values()):
            exit_code = max(exit_code, EXIT_MODEL)  # a measurement above its certified bound: the report, then exit 3
    if results:
        emit.emit(results, output_format, output, quiet=quiet, verbose=verbose)
        if html_path:
            from rankaudit.report import html

            report_files.write_file(html_path, html.render(results))
            if not quiet:
                click.echo(f"rankaudit: wrote the HTML report to {html_path}", err=True)
    if results or exit_code == EXIT_PASS:  # every file skipped (a hook's helper modules) is a report too
        supervise.report_delivered([result.policy.passed for result in results])
    return exit_code


@cli.command("suggest", cls=_ModelCommand)
@click.argument("model", metavar="MODEL.py[:NAME]|APP_DIR")
@click.option("--input-shape", callback=flags.parse_shape, metavar="C,H,W", help=flags.INPUT_SHAPE_HELP)
@flags.suggest_options
@flags.dp_options
@flags.psnr_target_option
@flags.round_options
@model_options.limit_options
@model_options.stand_in_options
@click.pass_context
def suggest_command(
    ctx,
    model,
    input_shape,
    batch_size,
    top,
    max_recoverable,
    exposed_below,
    certificate_quantile,
    data,
    output_format,
    output,
    debug,
    dp_candidates,
    psnr_target,
    **options,
):
    """Single architectural edits, re-bounded and ranked by each sample's recoverable fraction they reach;
    the batch sizes at which the batch as a whole is certified and protected (no batch size protects a
    sample; accuracy is not measured); with DP options and --max-reconstruction, also the least noise multiplier
    that meets it, and when only noise can protect a sample, it says so. With DP options or --psnr-target, also
    the least σ keeping the PSNR of any unbiased reconstruction at or below the target, for the model as it is and
    for each edit that can be made on the real model, the edits ranked by it (measured at the seeded weights).

    With a round (--local-samples, --local-epochs, --clients, ... or [tool.rankaudit.round]): also the N, E and C
    at which each sample is protected (N and C never are; the round as a whole is reported beside). APP_DIR (a
    Flower app, an NVFlare job): the model and the round are read from the app, as `check` reads them.
    """
    from rankaudit.bound.dp import noise_search
    from rankaudit.deploy.commands import search_options, suggest_reading
    from rankaudit.settings.model_spec import check_path, split_model_spec
    from rankaudit.settings.pyproject import load_settings
    from rankaudit.settings.run import build_run_round, dp_sources

    if dp_candidates is not None:
        raise UsageError(
            "--dp-candidates sets the candidates of --verify dp, which suggest does not run", "drop --dp-candidates"
        )
    commandline_batch = ctx.get_parameter_source("batch_size") is click.core.ParameterSource.COMMANDLINE

    check_path(model, "model or app")  # a path the system cannot open, or Python cannot name, before any use of it
    reading = suggest_reading(
        model, flags.round_flags(ctx), options, batch_size if commandline_batch else None, input_shape
    )
    deployment, model = reading.deployment, reading.model
    report_files.check_outputs(output, inputs=report_files.command_inputs([model], data=data))
    settings = load_settings(split_model_spec(model)[0])
    supervise.set_config_timeout(settings.timeout)
    supervise.set_config_memory_limit(settings.memory_limit)
    # As `check` reads them: the flag where given, else [tool.rankaudit] (its [[tool.rankaudit.models]] input shape,
    # its batch-size or [tool.rankaudit.round]'s), else the default.
    commandline = {
        name
        for name in (
            "input_shape",
            "batch_size",
            "max_recoverable",
            "exposed_below",
            "psnr_target",
            "certificate_quantile",
        )
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }

    input_shape = settings.in_force("input_shape", input_shape, "input_shape" in commandline)
    batch_size = settings.in_force("batch_size", batch_size, "batch_size" in commandline)
    max_recoverable = settings.in_force("max_recoverable", max_recoverable, "max_recoverable" in commandline)
    exposed_below = settings.in_force("exposed_below", exposed_below, "exposed_below" in commandline)
    certificate_quantile = settings.in_force(
        "certificate_quantile", certificate_quantile, "certificate_quantile" in commandline
    )
    if deployment is not None:  # the app's round: its batch size unless the command line gives one
        whole_round = deployment.round
        batch_size = batch_size if commandline_batch else whole_round.batch_size
    else:
        whole_round = build_run_round(flags.round_flags(ctx), batch_size, settings.round)
    searched, searched_given = search_options(options, settings.dp, whole_round.dp if deployment is not None else None)
    noise = noise_search(searched, whole_round, searched_given)
    given = any(options.get(name) is not None for name in ROUND_FLAGS) or settings.round or deployment is not None
    round_ = whole_round if given else None
    # The review and the HTML report's audit judge the same model on the same settings.
    judged_on = dict(
        input_shape=input_shape,
        batch_size=batch_size,
        max_recoverable=max_recoverable,
        round_=round_,
        data=data,
        exposed_below=exposed_below,
        certificate_quantile=certificate_quantile,
        **reading.built_and_sent(settings),
    )
    from rankaudit.design.suggest import suggest  # torch loads here, once the arguments and settings are checked
    from rankaudit.report import design

    report = worker.run(suggest, model, **judged_on, limited=False)
    report = dataclasses.replace(report, noise=noise, check_command=reading.check_command)
    fisher_options = searched
    if fisher_options or "psnr_target" in commandline or settings.psnr_target is not None:
        from rankaudit.design.fisher_review import review, review_settings

        target = settings.in_force("psnr_target", psnr_target, "psnr_target" in commandline)
        at = review_settings(fisher_options, whole_round, dp_sources(options, settings.dp))
        # The review runs the model's code on real inputs: in a worker, like the verifiers.
        bn_mode = whole_round.bn_mode
        fisher = worker.run(review, report, at, target, data, top, bn_mode, reading.model_args, limited=False)
        report = dataclasses.replace(report, fisher=fisher)
    if output_format == "html":
        from rankaudit.audit import audit
        from rankaudit.report import html

        result = audit(model, **judged_on)
        shown = dataclasses.replace(report, suggestions=report.suggestions[:top])
        text = html.render([result], suggestions={result.model: shown})
    else:
        text = (
            design.render_json(design.suggest_dict(report, top))
            if output_format == "json"
            else design.suggest_table(report, top)
        )
    emit.write(text, output)
    supervise.report_delivered([])  # suggestions carry no verdict: exit 0 once they are out
    return EXIT_PASS


@cli.command("compare", cls=_ModelCommand)
@click.argument("first", metavar="A.py[:NAME]|APP_DIR")
@click.argument("second", metavar="B.py[:NAME]|APP_DIR")
@click.option("--input-shape", callback=flags.parse_shape, metavar="C,H,W", help=flags.INPUT_SHAPE_HELP)
@flags.compare_options
@flags.dp_options
@flags.psnr_target_option
@model_options.limit_options
@model_options.stand_in_options
@click.pass_context
def compare_command(
    ctx,
    first,
    second,
    input_shape,
    batch_size,
    fail_on,
    min_ra,
    max_recoverable,
    exposed_below,
    certificate_quantile,
    data,
    output_format,
    output,
    debug,
    dp_candidates,
    psnr_target,
    **options,
):
    """Two designs side by side; the exit code is the policy applied to the second (B).

    Each model's settings come from the command line, else from [tool.rankaudit] in the nearest pyproject.toml above
    its file (as `check` reads them), else from the defaults. An app folder (a Flower app, an NVFlare job) gives
    its model and its round, as `check` reads them. With --dp-noise σ: each design's DP section, and its Fisher
    floor at the same σ (the MSE floor and PSNR ceiling of unbiased reconstructions, at the seeded weights).
    """
    from rankaudit.settings.model_spec import split_model_spec
    from rankaudit.settings.pyproject import load_settings

    report_files.check_outputs(output, inputs=report_files.command_inputs([first, second], data=data))
    given = {
        "input_shape": input_shape,
        "batch_size": batch_size,
        "fail_on": fail_on,
        "min_ra": min_ra,
        "max_recoverable": max_recoverable,
        "exposed_below": exposed_below,
        "certificate_quantile": certificate_quantile,
    }
    from rankaudit.settings.run import dp_values

    if dp_candidates is not None:
        raise UsageError(
            "--dp-candidates sets the candidates of --verify dp, which compare does not run", "drop --dp-candidates"
        )
    psnr_given = ctx.get_parameter_source("psnr_target") is click.core.ParameterSource.COMMANDLINE
    if psnr_given and not dp_values(options, None):
        raise UsageError(
            "--psnr-target sets the PSNR the Fisher floor's least σ keeps, and compare reads it only under DP noise",
            "add --dp-noise σ (and --dp-clip C as trained), or drop --psnr-target",
        )
    # Both designs (an app folder read as `check` reads it) and both settings are checked before torch loads (with
    # rankaudit.audit).
    designs = []
    from rankaudit.deploy.commands import (
        deployment_for_design,
        design_round,
        fisher_at_one_sigma,
        refuse_model_arguments,
    )
    from rankaudit.settings.model_spec import check_path
    from rankaudit.settings.run import sent_layers

    for spec in (first, second):
        check_path(spec, "model or app")
        deployment = deployment_for_design(
            spec,
            flags.round_flags(ctx),
            options,
            batch_size=batch_size if _batch_given(ctx) else None,
            input_shape_given=input_shape is not None,
        )
        spec = deployment.model if deployment is not None else spec
        designs.append((spec, deployment, load_settings(split_model_spec(spec)[0])))  # a malformed pyproject: exit 2
    from rankaudit.audit import audit
    from rankaudit.report import design

    results, rounds, targets, sent = [], [], [], []
    for spec, deployment, settings in designs:
        supervise.set_config_timeout(settings.timeout)
        supervise.set_config_memory_limit(settings.memory_limit)
        chosen = {
            name: settings.in_force(
                name, value, ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
            )
            for name, value in given.items()
        }
        if deployment is not None and not _batch_given(ctx):
            chosen["batch_size"] = deployment.round.batch_size
        # An app's round as `check` reads it; a model file's from the round and DP flags over its [tool.rankaudit.*]
        # where any is given; without, compare stays structural, as it was.
        round_ = design_round(deployment, flags.round_flags(ctx), chosen["batch_size"], settings, options)
        rounds.append(round_)
        targets.append(settings.in_force("psnr_target", psnr_target, psnr_given))
        arguments = deployment.model_args if deployment is not None else settings.model_args
        sent.append(sent_layers(settings.shared_layers, settings.withheld_layers, deployment))  # as `check` reads it
        results.append(
            audit(
                spec,
                **chosen,
                round_=round_,
                data=data,
                **sent[-1],
                model_args=dict(arguments) if arguments else None,
            )
        )
    if fisher_at_one_sigma(rounds, bool(dp_values(options, None))):
        from rankaudit.design.fisher_review import compare_lines

        for result, (spec, deployment, _), round_, target, layers in zip(results, designs, rounds, targets, sent):
            refuse_model_arguments(spec, deployment.model_args if deployment else None, "compare's Fisher line")
            compare_lines([result], [spec], round_.dp, target, data, layers)
    text = (
        design.render_json(design.compare_dict(*results)) if output_format == "json" else design.compare_table(*results)
    )
    emit.write(text, output)
    supervise.report_delivered([results[1].policy.passed])
    return EXIT_PASS if results[1].policy.passed else EXIT_POLICY


@cli.command("guard", cls=_ModelCommand)
@click.argument("model", metavar="MODEL.py[:NAME]")
@flags.guard_options
@flags.round_options
@model_options.limit_options
@click.pass_context
def guard_command(ctx, model, weights, data, labels, batch_size, log, output_format, output, debug, **options):
    """A client's update, checked before it is sent: the local step(s) run on the batch at the received weights,
    and the update is sent, blocked or sent with the rows that read a sample dropped or noised.

    Settings: these flags, else [tool.rankaudit.guard] and [tool.rankaudit.round] in the nearest pyproject.toml.
    """
    from rankaudit.guard.batch import load_batch
    from rankaudit.guard.local import run_guard
    from rankaudit.report import guard as guard_report
    from rankaudit.settings.guard_options import one_round_flags, settings_from_flags
    from rankaudit.settings.model_spec import split_model_spec
    from rankaudit.settings.pyproject import load_settings
    from rankaudit.settings.run import build_run_round

    settings = load_settings(split_model_spec(model)[0])
    supervise.set_config_timeout(settings.timeout)
    supervise.set_config_memory_limit(settings.memory_limit)
    guard = settings_from_flags(options, log, settings.guard)  # its log: the flag's, else the pyproject's
    inputs = report_files.command_inputs([model], data=data, weights=weights, labels=labels)
    report_files.check_outputs(output, inputs=inputs, log=guard.log)
    round_flags = one_round_flags(flags.round_flags(ctx))
    batch = batch_size or settings.batch_size
    if batch is None or round_flags.get("local_samples") is None:
        count = len(load_batch(data, labels)[0])
        batch = batch or count
        if round_flags.get("local_samples") is None and not (settings.round or {}).get("local_samples"):
            round_flags["local_samples"] = count
    round_ = build_run_round(round_flags, batch, settings.round)
    run = run_guard(model, weights, data, labels, round_, guard)
    text = guard_report.render_json(run) if output_format == "json" else guard_report.render_table(run)
    emit.write(text, output)
    sent_as_computed = run.decision.action == "send"
    supervise.report_delivered([sent_as_computed])
    return EXIT_PASS if sent_as_computed else EXIT_POLICY


def _batch_given(ctx) -> bool:
    return ctx.get_parameter_source("batch_size") is click.core.ParameterSource.COMMANDLINE


def _verified(verify, request) -> tuple[dict, dict]:
    """The verifiers, in the model's worker (they run its code on real inputs): the records and pictures they made."""
    from rankaudit.verify.run import run_verifiers

    run_verifiers(verify, request, _error)
    return request.result.verification, request.result.images


def _error(message: str):
    click.echo(f"rankaudit: error: {one_line(message)}", err=True)


def main(argv: list[str] | None = None):
    """Console entry point: one-line errors and the documented exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        os.getcwd()
    except OSError:  # torch, the model's imports and relative paths would each fail on it in their own words
        _error("the working directory no longer exists (deleted or moved away); fix: cd into an existing folder")
        sys.exit(EXIT_USAGE)
    try:
        try:
            code = cli.main(args=args, prog_name="rankaudit", standalone_mode=False)
        except SystemExit as exc:  # nothing of ours raises it in a command: the model's sys.exit (exit 3, not its code)
            raise ended_process(exc) from exc
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        _error(f"{exc.format_message()}; fix: see 'rankaudit --help'")
        sys.exit(EXIT_USAGE)
    except click.Abort:
        _error("aborted")
        sys.exit(EXIT_USAGE)
    except RankauditError as exc:
        if debug:
            raise
        _error(str(exc))
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug of ours or an unforeseen model: still one line unless --debug
        if debug:
            raise
        fault = out_of_memory(exc) or model_fault(exc)
        if fault is not None:  # the model's own code raised (suggest, compare): its error, exit 3
            _error(str(fault))
            sys.exit(fault.exit_code)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # never C++ frames
        _error(
            f"internal error while analysing: {type(exc).__name__}: {message}; "
            "fix: rerun with --debug and report the traceback"
        )
        sys.exit(EXIT_MODEL)
    sys.exit(code if isinstance(code, int) else EXIT_PASS)


def run():
    """The `rankaudit` command (and `python -m rankaudit`): main() in a supervised child process (supervise.py), so
    that the model's code can neither end the process unseen, nor hang it, nor print into the report.

    The exit is os._exit: with torch loaded, Python's orderly shutdown takes about 0.3 s and does nothing a finished
    command needs (here the parent never loaded torch, and the child has handed back its report).
    """
    args = sys.argv[1:]
    code = None
    if supervise.can_supervise():
        from rankaudit.model.parent import reopen_closed_streams

        reopen_closed_streams()
    if supervise.can_supervise() and supervise.may_answer_here(args):
        code = supervise.answer_here(main, args, _RunsModel)  # None: --help was an option's value
    if supervise.can_supervise() and code is None:
        from rankaudit.model.parent import run_supervised

        code = run_supervised(main, args)
    elif code is None:
        try:
            main(args)
            code = EXIT_PASS
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed (>&-) or a reader gone (| head -0): the code still stands
            stream.flush()
    os._exit(code)
