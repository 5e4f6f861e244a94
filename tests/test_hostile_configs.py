"""Hostile app folders: configuration files that are devices, FIFOs, alias bombs, deep nesting, huge, or include
files outside the app. rankaudit reads them in its own process, so each must end in one line naming the file
(exit 2) within seconds, never a hang, a traceback or gigabytes of memory."""

import json
import os
import shutil
import time

import pytest
from conftest import REPO
from test_hostile import HOSTILE, error_line, rankaudit

from rankaudit.errors import UsageError
from rankaudit.settings import files

APPS = REPO / "tests" / "apps"


def _nvflare_job(tmp_path, name="config_fed_client.conf"):
    job = tmp_path / "job"
    shutil.copytree(APPS / "nvflare_job", job)
    (job / "app" / "config" / "config_fed_client.json").unlink()
    return job, job / "app" / "config" / name


def _hydra_app(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(APPS / "hydra_app", app)
    return app, app / "conf" / "config.yaml"


def _refused(done_or_result, *fragments, seconds=None):
    code, out, err = done_or_result
    assert code == 2 and out == "", err
    return error_line(err, *fragments)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_config_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    job, config = _nvflare_job(tmp_path)
    if kind == "dev-zero":
        config.symlink_to("/dev/zero")
    else:
        os.mkfifo(config)
    started = time.monotonic()
    done = rankaudit("check", job, module=True, timeout=60)
    assert time.monotonic() - started < 30
    _refused(
        (done.returncode, done.stdout, done.stderr),
        str(config),
        "a character device" if kind == "dev-zero" else "a FIFO",
        "not a regular file",
    )


def test_a_yaml_alias_bomb_stops_at_once(tmp_path, run_cli):
    app, config = _hydra_app(tmp_path)
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for letter, previous in zip("bcdefghij", "abcdefghi"):
        lines.append(f"{letter}: &{letter} [" + ",".join([f"*{previous}"] * 9) + "]")
    config.write_text("\n".join(lines) + "\n")
    assert len(config.read_bytes()) < 400
    started = time.monotonic()
    _refused(run_cli("check", app), str(config), "expands to over")
    assert time.monotonic() - started < 10


def test_a_yaml_alias_inside_its_own_anchor_is_refused(tmp_path, run_cli):
    app, config = _hydra_app(tmp_path)
    config.write_text("a: &a [1, *a]\nnum_rounds: 2\n")
    _refused(run_cli("check", app), str(config), "expands to over")


def test_a_50_mb_yaml_is_refused_by_its_size(tmp_path, run_cli):
    app, config = _hydra_app(tmp_path)
    with config.open("w") as handle:
        handle.write("num_rounds: 4\npad: [")
        handle.write("1," * 25_000_000)
        handle.write("1]\n")
    started = time.monotonic()
    _refused(run_cli("check", app), str(config), "bytes, over the")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("case", ["toml-dotted-header", "yaml-list", "hocon-self-include", "json"])
def test_deep_nesting_is_one_line(tmp_path, run_cli, case):
    if case == "toml-dotted-header":
        app, _ = _hydra_app(tmp_path)
        config = app / "pyproject.toml"
        config.write_text("[tool.rankaudit]\n[" + ".".join(["a"] * 100_000) + "]\nx = 1\n")
    elif case == "yaml-list":
        app, config = _hydra_app(tmp_path)
        config.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    elif case == "hocon-self-include":
        app, config = _nvflare_job(tmp_path)
        config.write_text('include "config_fed_client.conf"\nformat_version = 2\n')
    else:
        app, config = _nvflare_job(tmp_path, "config_fed_client.json")
        config.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    started = time.monotonic()
    line = _refused(run_cli("check", app), str(config))
    assert "nests more than" in line or "includes over" in line, line
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("include", ['include "/etc/passwd"', 'include file("../../../../../etc/passwd")'])
def test_a_hocon_include_outside_the_job_is_not_read(tmp_path, run_cli, include):
    job, config = _nvflare_job(tmp_path)
    config.write_text(f"{include}\nformat_version = 2\n")
    line = _refused(run_cli("check", job), str(config), "outside the job's folder", "does not read it")
    assert "root:" not in line


def test_a_hocon_include_of_a_url_is_not_fetched(tmp_path, run_cli):
    job, config = _nvflare_job(tmp_path)
    config.write_text('include url("http://127.0.0.1:9/x.conf")\nformat_version = 2\n')
    _refused(run_cli("check", job), str(config), "reads no URL")


def test_a_hocon_include_inside_the_job_is_read(tmp_path):
    from rankaudit.deploy.nvflare import load_config

    job, config = _nvflare_job(tmp_path)
    (config.parent / "shared.conf").write_text("rounds = 3\n")
    config.write_text('include "shared.conf"\nformat_version = 2\n')
    assert load_config(config) == {"rounds": 3, "format_version": 2}


def test_a_hydra_defaults_entry_outside_the_app_is_not_read(tmp_path):
    from rankaudit.deploy.yamlconf import app_yaml

    app, config = _hydra_app(tmp_path)
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "passwd.yaml").write_text("num_rounds: 999\nroot: x\n")
    config.write_text("defaults:\n  - ../../etc/passwd\n  - _self_\nnum_rounds: 4\n")
    read = app_yaml(app)
    assert read.entries["num_rounds"][0] == 4 and "root" not in read.entries
    assert any("outside the app's folder" in note and "passwd" in note for note in read.notes), read.notes


def test_a_hocon_substitution_bomb_stops_at_the_memory_limit(tmp_path, run_cli):
    job, config = _nvflare_job(tmp_path)
    lines = ['a0 = "' + "x" * 32 + '"'] + [f"a{i} = ${{a{i - 1}}}${{a{i - 1}}}" for i in range(1, 40)]
    config.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    _refused(run_cli("check", job, "--memory-limit", "0.25"), str(config), "over the memory limit (0.25 GiB)")
    assert time.monotonic() - started < 30


def test_a_parse_that_never_returns_stops_at_the_time_limit(tmp_path):
    files.use_limits(1.0, 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(UsageError, match=r"took over 0.5 s \(the time limit\)"):
            files.bounded(time.sleep, tmp_path / "slow.yaml", 30)
        assert time.monotonic() - started < 5
    finally:
        files.use_limits(None, None)


def test_a_parse_that_hoards_memory_stops_at_the_memory_limit(tmp_path):
    files.use_limits(0.25, 30)
    try:
        with pytest.raises(UsageError, match=r"over the memory limit \(0.25 GiB\)"):
            files.bounded(lambda: bytearray(2 << 30), tmp_path / "big.conf")
        assert files.bounded(lambda: {"kept": [1, 2.5, "x"]}, tmp_path / "fine.conf") == {"kept": [1, 2.5, "x"]}
    finally:
        files.use_limits(None, None)


def test_a_newline_in_a_config_name_does_not_split_the_line(tmp_path):
    odd = tmp_path / "con\nfig.yaml"
    odd.symlink_to("/dev/zero")
    with pytest.raises(UsageError) as raised:
        files.read_text(odd)
    assert "\n" not in str(raised.value) and "con\\nfig.yaml" in str(raised.value)


# ---- outputs: strict JSON, numbers that would overflow ----------------------------------------------------------


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_json_report_spells_no_nan_or_infinity():
    from rankaudit.report.json import dumps

    text = dumps({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": 2}, "e": "x\ny"})
    assert _strict(text) == {"a": None, "b": [None, None, 1.5], "c": {"d": 2}, "e": "x\ny"}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--psnr-target", "nan", "--verify", "fisher", "--dp-noise", "1"], "--psnr-target"),
        (["--psnr-target", "inf", "--verify", "fisher", "--dp-noise", "1"], "--psnr-target"),
        (["--psnr-target", "-1e308"], "--psnr-target"),
        (["--dp-noise", "1e-300"], "--dp-noise"),
        (["--dp-noise", "1e300"], "--dp-noise"),
        (["--dp-noise", "1e308"], "--dp-noise"),
        (["--rank-budget", "nan", "--verify", "rank"], "--rank-budget"),
        (["--rank-budget", "5"], "--rank-budget"),
        (["--defense", "bogus", "--verify", "rgap"], "--defense"),
        (["--defense", "prune:nan", "--verify", "rgap"], "--defense"),
    ],
)
def test_a_value_no_arithmetic_holds_is_one_line_exit_2(run_cli, args, named):
    code, out, err = run_cli(HOSTILE / "v_plain.py", "--format", "json", *args)
    assert code == 2 and out == "", err
    line = error_line(err, named)
    assert "too small" not in line


def test_a_psnr_target_in_the_configuration_is_checked_too(run_cli, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\npsnr-target = -1e308\n")
    model = tmp_path / "plain.py"
    model.write_text((HOSTILE / "v_plain.py").read_text())
    code, out, err = run_cli(model, "--format", "json")
    assert code == 2 and out == ""
    error_line(err, "psnr-target", "from -100 to 200")


def test_weights_that_are_not_finite_are_refused(run_cli, tmp_path):
    torch = pytest.importorskip("torch")
    weights = tmp_path / "nan.pt"
    torch.save({"fc.weight": torch.full((3, 12), float("nan")), "fc.bias": torch.zeros(3)}, weights)
    code, out, err = run_cli(HOSTILE / "v_plain.py", "--verify", "rank", "--weights", weights, "--format", "json")
    assert code in (2, 3) and out == ""
    error_line(err, str(weights), "NaN or infinite", "fc.weight")


# ---- the model's process: killed from outside, recursion, hidden models, names, arguments ----------------------


def test_a_model_process_killed_by_sigkill_is_said_to_be_killed_from_outside():
    done = rankaudit(HOSTILE / "killed_in_constructor.py", "--format", "json", module=True, timeout=120)
    assert done.returncode == 3 and done.stdout == ""
    line = error_line(done.stderr, "killed from outside (SIGKILL)", "out-of-memory", "--memory-limit")
    assert "exit call" not in line


def test_a_recursion_without_end_stops_at_the_memory_limit():
    started = time.monotonic()
    done = rankaudit(
        HOSTILE / "recurse_on_the_heap.py", "--memory-limit", "0.5", "--timeout", "60", module=True, timeout=120
    )
    assert done.returncode == 3 and done.stdout == ""
    line = error_line(done.stderr, "ran out of memory during the build of Net()", "a recursion", "0.5 GiB")
    assert "SIGSEGV" not in line and "did not finish" not in line
    assert time.monotonic() - started < 50


def test_a_recursion_without_end_is_one_error_with_the_memory_limit_alone_and_under_debug():
    model = HOSTILE / "recurse_on_the_heap.py"
    plain = rankaudit(model, "--memory-limit", "0.25", module=True, timeout=120)
    assert plain.returncode == 3 and plain.stdout == ""
    error_line(plain.stderr, "ran out of memory during the build of Net()", "a recursion", "0.25 GiB")
    # --debug: the traceback, ending in that error, and the same exit code; no second error line saying that the
    # model ended the process.
    debug = rankaudit(model, "--memory-limit", "0.25", "--debug", module=True, timeout=120)
    assert debug.returncode == 3 and "Traceback" in debug.stderr and "rankaudit: error:" not in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith("rankaudit.errors.OutOfMemory: ")


@pytest.mark.parametrize("how", ["private", "claims-another-module"])
def test_a_hidden_model_is_not_skipped_as_a_helper(run_cli, tmp_path, how):
    model = tmp_path / "hidden.py"
    name = "_Net" if how == "private" else "Net"
    tail = 'Net.__module__ = "torch.nn.modules.linear"\n' if how == "claims-another-module" else ""
    model.write_text(
        "from torch import nn\n\n\n"
        f"class {name}(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 2)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n\n\n"
        f"INPUT_SHAPE = (4,)\n{tail}"
    )
    code, out, err = run_cli(model, "--skip-non-models", "--format", "json")
    assert code == 3 and out == ""
    error_line(err, f"{model}:{name}")
    code, out, _ = run_cli(f"{model}:{name}", "--format", "json")
    assert code in (0, 1) and json.loads(out)["model_name"]


def test_a_helper_module_is_still_skipped(run_cli, tmp_path):
    helper = tmp_path / "helper.py"
    helper.write_text("from torch import nn\n\n\ndef make():\n    return nn.Linear(2, 2)\n")
    code, out, err = run_cli(helper, "--skip-non-models")
    assert code == 0 and err == ""


def test_a_newline_in_a_file_name_is_escaped_in_the_error_line(run_cli, tmp_path):
    code, out, err = run_cli(tmp_path / "no\nsuch.py")
    assert code == 2 and out == ""
    error_line(err, "no\\nsuch.py")


def test_a_utf8_name_under_the_c_locale_is_read(tmp_path):
    model = tmp_path / "café.py"
    model.write_text((HOSTILE / "v_plain.py").read_text())
    environment = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    done = rankaudit(model.name, "--format", "json", module=True, cwd=tmp_path, env=environment, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert "UTF-8" not in done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] and report["model"] == "café.py"


@pytest.mark.parametrize("named", [False, True])
def test_a_model_argument_that_does_not_bind_names_the_parameters(run_cli, named):
    spec = f"{HOSTILE / 'needs_arguments.py'}" + (":Net" if named else "")
    code, out, err = run_cli(spec, "--model-arg", "bogus=3")
    assert code == 2 and out == ""
    error_line(err, "--model-arg bogus does not fit", "(width)")
