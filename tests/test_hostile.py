"""Hostile and broken inputs: a model file that ends the process, hangs, or prints into the report, and
report paths that cannot be written. Each case: its exit code, one stderr line where it fails, JSON that parses
where it passes. The model files are in tests/hostile/; `rankaudit` runs as the user runs it (a fresh process)."""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from conftest import EXAMPLES, REPO

HOSTILE = REPO / "tests" / "hostile"


def rankaudit(*args, module=False, timeout=240, **kwargs):
    command = [sys.executable, "-m", "rankaudit"] if module else ["rankaudit"]
    return subprocess.run(
        command + [str(a) for a in args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=kwargs.pop("cwd", REPO),
        **kwargs,
    )


def error_line(stderr: str, *fragments: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("rankaudit: error: ") and "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- the model ends the process, or never returns -----------------------------------------------------------------


@pytest.mark.parametrize("module", [False, True], ids=["console-script", "python-m"])
def test_os_exit_at_import_is_exit_3_naming_the_line(module):
    done = rankaudit(HOSTILE / "exit_at_import.py", "--format", "json", module=module)
    assert done.returncode == 3 and done.stdout == ""
    error_line(
        done.stderr,
        "the model file ended the process",
        "os._exit(0) at tests/hostile/exit_at_import.py:18",
        "during the import of",
    )


def test_sys_exit_in_forward_is_exit_3_naming_the_line():
    done = rankaudit(HOSTILE / "exit_in_forward.py", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""
    error_line(
        done.stderr,
        "the model file ended the process",
        "SystemExit(0)",
        "tests/hostile/exit_in_forward.py:15 (`sys.exit(0)`)",
        "during the trace of",
    )


def test_system_exit_in_the_constructor_is_the_models_not_plain_pytorchs(run_cli):
    code, out, err = run_cli(HOSTILE / "exit_in_constructor.py")  # in-process: main() alone catches it too
    assert code == 3 and out == ""
    line = error_line(
        err, "SystemExit(3)", "exit_in_constructor.py:11 (`raise SystemExit(3)`)", "during the build of Net()"
    )
    assert "plain PyTorch" not in line


def test_a_crash_while_building_is_exit_3_naming_the_signal_and_the_phase():
    done = rankaudit(HOSTILE / "crash_in_constructor.py", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""
    error_line(done.stderr, "killed by SIGSEGV during the build of Net() from")


def test_an_import_that_never_returns_is_stopped_at_the_timeout():
    started = time.monotonic()
    done = rankaudit(HOSTILE / "loop_at_import.py", "--timeout", "5", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""
    error_line(done.stderr, "the import of", "loop_at_import.py did not finish within 5 s", "--timeout")
    assert time.monotonic() - started < 120


def test_a_forward_that_never_returns_is_stopped_in_the_trace():
    done = rankaudit(HOSTILE / "loop_in_forward.py", "--timeout", "4")
    assert done.returncode == 3 and done.stdout == ""
    error_line(done.stderr, "the trace of", "loop_in_forward.py's forward() did not finish within 4 s")


def test_the_timeout_from_the_configuration(tmp_path, run_cli):
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\ntimeout = 3\n")
    model = tmp_path / "loop.py"
    model.write_text((HOSTILE / "loop_at_import.py").read_text())
    done = rankaudit(model)
    assert done.returncode == 3
    error_line(done.stderr, "loop.py did not finish within 3 s")
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\ntimeout = -1\n")
    code, _, err = run_cli(model)  # refused before the import: in-process is safe
    assert code == 2
    error_line(err, "timeout must be a positive number of seconds")


def test_ctrl_c_is_exit_130_without_a_report_or_traceback():
    process = subprocess.Popen(
        ["rankaudit", HOSTILE / "sleep_at_import.py", "--format", "json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    seen = ""
    while "importing" not in seen and time.monotonic() < deadline:  # the model runs: torch is loaded
        seen += process.stderr.readline()
    maps = f"/proc/{process.pid}/maps"
    if os.path.exists(maps):  # the supervising parent stays light: torch is loaded in the child only
        with open(maps) as mapped:
            assert "libtorch" not in mapped.read()
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and out == ""
    error_line(err, "interrupted")


# ---- the model's stdout never reaches the report ------------------------------------------------------------------


@pytest.mark.parametrize("report", ["json", "sarif"])
def test_a_model_that_prints_leaves_the_json_report_intact(report):
    done = rankaudit(HOSTILE / "noisy.py", "--format", report)
    assert done.returncode in (0, 1), done.stderr[-500:]
    payload = json.loads(done.stdout)
    assert payload["version"] == "2.1.0" if report == "sarif" else payload["input_shape"] == [4]
    assert "noise at import 1999" in done.stderr and "written straight to fd 1" in done.stderr
    assert "forward wrote to fd 1" in done.stderr


def test_output_to_dev_stdout_is_the_report_not_the_models_prints():
    done = rankaudit(HOSTILE / "noisy.py", "--format", "json", "-o", "/dev/stdout")
    assert done.returncode in (0, 1), done.stderr[-500:]
    assert json.loads(done.stdout)["input_shape"] == [4]


def test_compare_and_suggest_keep_their_json_on_stdout():
    done = rankaudit("compare", HOSTILE / "noisy.py", EXAMPLES / "fig2_a.py", "--format", "json")
    assert done.returncode in (0, 1), done.stderr[-500:]
    assert len(json.loads(done.stdout)) > 0
    done = rankaudit("suggest", HOSTILE / "noisy.py", "--format", "json")
    assert done.returncode == 0, done.stderr[-500:]
    assert "suggestions" in json.loads(done.stdout)


def test_every_image_verifier_keeps_the_json_on_stdout():
    done = rankaudit(
        HOSTILE / "noisy_image.py",
        "--verify",
        "rank",
        "--verify",
        "gdbr",
        "--verify",
        "rgap",
        "--verify",
        "dp",
        "--dp-noise",
        "1",
        "--samples",
        "2",
        "--trials",
        "1",
        "--steps",
        "5",
        "--format",
        "json",
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr[-800:]
    payload = json.loads(done.stdout)
    assert payload["input_shape"] == [3, 8, 8]
    assert "noise in forward" in done.stderr


@pytest.mark.slow  # DAGER end to end on GPT-2 (11 s)
def test_dager_keeps_the_json_on_stdout():
    pytest.importorskip("transformers", reason="needs transformers, not installed (pip install -e '.[test]')")
    done = rankaudit(HOSTILE / "noisy_gpt2.py", "-b", "2", "--verify", "dager", "--format", "json", timeout=600)
    assert done.returncode in (0, 1), done.stderr[-800:]
    assert json.loads(done.stdout)["verification"]["dager"]["token_recall"] is not None
    assert "noise in forward" in done.stderr and "written straight to fd 1" in done.stderr


# ---- report paths: checked before the model runs, written atomically ---------------------------------------------


@pytest.mark.parametrize("case", ["missing-folder", "under-a-file", "too-long", "a-folder"])
def test_an_unwritable_report_path_is_refused_before_the_analysis(run_cli, tmp_path, case):
    (tmp_path / "file").write_text("x")
    path = {
        "missing-folder": tmp_path / "nope" / "r.json",
        "under-a-file": tmp_path / "file" / "r.json",
        "too-long": tmp_path / ("r" * 300 + ".json"),
        "a-folder": tmp_path,
    }[case]
    for option in ("-o", "--html"):
        code, out, err = run_cli(HOSTILE / "marked.py", "--format", "json", option, path)
        assert code == 2 and out == ""
        line = error_line(err, str(path))  # a folder is click's own check: "Invalid value for '-o' ..."
        assert {
            "missing-folder": "does not exist",
            "under-a-file": "is not a folder",
            "too-long": "File name too long",
            "a-folder": "is a directory",
        }[case] in line
        assert "marked.py imported" not in err  # refused before the model's import
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_suggest_and_compare_check_their_output_too(run_cli, tmp_path):
    missing = tmp_path / "nope" / "r.json"
    code, _, err = run_cli("suggest", HOSTILE / "marked.py", "-o", missing)
    assert code == 2
    error_line(err, f"-o {missing}", "does not exist")
    code, _, err = run_cli("compare", HOSTILE / "marked.py", HOSTILE / "marked.py", "-o", missing)
    assert code == 2
    error_line(err, f"-o {missing}", "does not exist")


def test_artifacts_under_a_file_is_refused(run_cli, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(HOSTILE / "marked.py", "--verify", "rank", "--artifacts", tmp_path / "file" / "art")
    assert code == 2
    error_line(err, "--artifacts", "is not a folder")


def test_output_and_html_naming_the_same_file_is_refused(run_cli, tmp_path):
    code, out, err = run_cli(
        HOSTILE / "marked.py", "--format", "json", "-o", tmp_path / "r", "--html", tmp_path / "." / "r"
    )
    assert code == 2 and out == ""
    error_line(err, "-o and --html both name")
    assert not (tmp_path / "r").exists()


def test_dev_full_is_exit_2_naming_the_path_and_the_os_error(run_cli):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    code, out, err = run_cli(HOSTILE / "marked.py", "--format", "json", "-o", "/dev/full")
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip() and line != "marked.py imported"]
    assert len(lines) == 1 and "/dev/full" in lines[0] and "No space left on device" in lines[0]


def _limit_file_size():
    # A full disk, as far as this process can tell: writes past 1 kB fail (EFBIG) instead of killing it (SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))


def test_a_failed_write_leaves_nothing_behind_and_keeps_the_old_report(tmp_path):
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    report.write_text("the old report")
    done = rankaudit(HOSTILE / "marked.py", "--format", "json", "-o", report, preexec_fn=_limit_file_size)
    assert done.returncode == 2
    error_line(done.stderr.replace("marked.py imported\n", ""), f"{report}", "File too large")
    assert report.read_text() == "the old report"
    done = rankaudit(HOSTILE / "marked.py", "--quiet", "--html", page, preexec_fn=_limit_file_size)
    assert done.returncode == 2 and not page.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left


def test_reports_are_written_whole(run_cli, tmp_path):
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    report.write_text("the old report")
    code, out, _ = run_cli(HOSTILE / "marked.py", "--format", "json", "-o", report, "--html", page)
    assert code in (0, 1) and out == ""
    assert json.loads(report.read_text())["input_shape"] == [4]
    assert page.read_text().lstrip().lower().startswith("<!doctype html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.json"]


def test_a_broken_stdout_is_one_line():
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            ["rankaudit", HOSTILE / "marked.py", "--format", "json"],
            check=False,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=240,
        )
    assert done.returncode == 2
    error_line(done.stderr.replace("marked.py imported\n", ""), "stdout", "No space left on device")


# ---- accidents the gate contains: inputs never overwritten, memory, orphans, supervision, the exit code ----------


def _links_to(tmp_path, target, how):
    """A path naming `target`: itself, a symlink, a `..` detour, or a hard link."""
    if how == "same":
        return target
    if how == "symlink":
        link = tmp_path / "link.py"
        link.symlink_to(target)
        return link
    if how == "dotdot":
        (tmp_path / "sub").mkdir()
        return tmp_path / "sub" / ".." / target.name
    link = tmp_path / "hard.json"
    os.link(target, link)
    return link


@pytest.mark.parametrize("how", ["same", "symlink", "dotdot", "hardlink"])
@pytest.mark.parametrize("option", ["-o", "--html"])
def test_an_output_naming_the_model_file_is_refused(run_cli, tmp_path, how, option):
    model = tmp_path / "model.py"
    model.write_text((HOSTILE / "marked.py").read_text())
    before = model.read_text()
    code, out, err = run_cli(model, "--format", "json", option, _links_to(tmp_path, model, how))
    assert code == 2 and out == ""
    error_line(err, f"{option} ", "names the model file", "would overwrite it")
    assert "marked.py imported" not in err and model.read_text() == before


def test_outputs_naming_the_configuration_or_the_data_are_refused(run_cli, tmp_path):
    model = tmp_path / "model.py"
    model.write_text((HOSTILE / "marked.py").read_text())
    config = tmp_path / "pyproject.toml"
    config.write_text("[tool.rankaudit]\nbatch-size = 1\n")
    code, _, err = run_cli(model, "-o", config)
    assert code == 2
    error_line(err, "names the configuration", "pyproject.toml")
    data = tmp_path / "images.npy"
    data.write_bytes(b"not really")
    code, _, err = run_cli(model, "--verify", "rgap", "--data", data, "--html", data)
    assert code == 2
    error_line(err, "--html", "names the data input")
    assert config.read_text() == "[tool.rankaudit]\nbatch-size = 1\n" and data.read_bytes() == b"not really"


def test_suggest_and_compare_refuse_an_output_naming_a_model(run_cli, tmp_path):
    model = tmp_path / "model.py"
    model.write_text((HOSTILE / "marked.py").read_text())
    code, _, err = run_cli("suggest", model, "-o", model)
    assert code == 2
    error_line(err, "names the model file")
    code, _, err = run_cli("compare", HOSTILE / "marked.py", model, "-o", _links_to(tmp_path, model, "symlink"))
    assert code == 2
    error_line(err, "names the model file")
    assert model.read_text() == (HOSTILE / "marked.py").read_text()


@pytest.mark.parametrize(
    ("model", "phase"),
    [
        ("hoard_memory.py", "the import of"),
        ("hoard_in_forward.py", "the trace"),
        ("raises_its_memory_limit.py", "the import of"),  # before: 2.8 GB taken, then stopped as a timeout
        ("shared_memory.py", "the import of"),  # shared mappings escaped the data limit
    ],
)
def test_the_memory_limit_is_exit_3_naming_the_phase(model, phase):
    started = time.monotonic()
    done = rankaudit(HOSTILE / model, "--memory-limit", "1", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""
    error_line(done.stderr, "ran out of memory during", phase, "memory limit is 1 GiB", "--memory-limit")
    assert time.monotonic() - started < 120


def test_the_memory_limit_from_the_configuration(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\nmemory-limit = 1\n")
    model = tmp_path / "hoard.py"
    model.write_text((HOSTILE / "hoard_in_forward.py").read_text())
    done = rankaudit(model)
    assert done.returncode == 3
    error_line(done.stderr, "ran out of memory during the trace", "1 GiB")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _running_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read() and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM])
def test_no_process_of_the_model_outlives_rankaudit(tmp_path, signum):
    marker = f"sleeper_{os.getpid()}_{signum}"
    model = tmp_path / f"{marker}.py"
    model.write_text((HOSTILE / "forks_a_sleeper.py").read_text())
    process = subprocess.Popen(
        ["rankaudit", model, "--timeout", "200"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "RANKAUDIT_TEST_PIDS": str(tmp_path)},
    )
    seen, deadline = "", time.monotonic() + 120
    while "forked a sleeper" not in seen and time.monotonic() < deadline:
        seen += process.stderr.readline()
    model_pid, sleeper_pid = map(int, (tmp_path / "pids").read_text().split())
    assert _alive(model_pid) and _alive(sleeper_pid)
    os.kill(process.pid, signum)  # rankaudit itself, not its process group
    process.communicate(timeout=20)  # returns only once nothing holds rankaudit's stdout or stderr open
    deadline = time.monotonic() + 10
    while (_alive(model_pid) or _alive(sleeper_pid) or _running_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(model_pid) and not _alive(sleeper_pid) and _running_with(marker) == []
    assert process.returncode != 0


@pytest.mark.parametrize("value_of", ["-o", "--html", "--shared-layers"])
@pytest.mark.parametrize("word", ["--help", "-h", "--version"])
def test_help_as_an_options_value_still_runs_the_model_supervised(tmp_path, value_of, word):
    done = rankaudit(HOSTILE / "exit_at_import.py", value_of, word, cwd=tmp_path)
    # The model's os._exit(0) is heard (exit 3 naming it) as only the supervised child can hear it; unsupervised,
    # the process would simply have ended with exit 0.
    assert done.returncode == 3 and "usage" not in done.stdout.lower(), done.stdout + done.stderr
    error_line(done.stderr, "the model file ended the process", "os._exit(0)")
    assert list(tmp_path.iterdir()) == []


def test_help_and_version_are_still_answered():
    done = rankaudit("check", "--help")
    assert done.returncode == 0 and "--memory-limit" in done.stdout and "--timeout" in done.stdout
    done = rankaudit("--version")
    assert done.returncode == 0 and "rankaudit" in done.stdout


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "-inf"])
def test_a_timeout_that_would_remove_the_limit_is_refused(run_cli, value):
    code, out, err = run_cli(HOSTILE / "marked.py", f"--timeout={value}")
    assert code == 2 and out == ""
    error_line(err, "--timeout", "finite")
    assert "marked.py imported" not in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_memory_limit_that_is_not_a_number_of_gib_is_refused(run_cli, value):
    code, _, err = run_cli(HOSTILE / "marked.py", f"--memory-limit={value}")
    assert code == 2
    error_line(err, "--memory-limit")


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ("forges_exit_frame.py", "something other than rankaudit wrote onto its status channel"),
        ("forges_with_the_token.py", "the model file ended the process (exit status 0, without a result)"),
        ("forges_exit_256.py", "something other than rankaudit wrote onto its status channel"),
    ],
)
def test_a_forged_exit_frame_without_a_report_is_exit_3(model, said):
    done = rankaudit(HOSTILE / model, "--format", "json")
    assert done.returncode == 3 and done.stdout == ""  # before: exit 0, the forged frame's code (or the report's)
    error_line(done.stderr, said, "the import of")


def test_a_report_forged_with_rankaudits_own_functions_is_exit_3():
    """write_stdout and report_delivered, token and all, onto every pipe the model can reach: none is the report's."""
    done = rankaudit(HOSTILE / "forges_the_report.py", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""  # before: exit 0 with the forged "protected" report
    said = done.stderr.replace('{"verdict": "protected", "forged": true}\n', "", 1)  # the model's own print
    error_line(said, "something other than rankaudit wrote onto its status channel", "the import of")


def test_a_model_that_rewrites_the_policy_keeps_its_own_verdict():
    """The report and the verdict are computed in a process the model's code never ran in."""
    done = rankaudit(HOSTILE / "rewrites_the_verdict.py", "--format", "json")
    assert done.returncode == 1, done.stderr  # before: exit 0, and no report
    assert json.loads(done.stdout)["verdict"] == "exposed" and done.stderr == ""


@pytest.mark.slow  # waits out a 12 s limit
def test_a_model_cannot_lift_its_own_time_limit():
    started = time.monotonic()
    done = rankaudit(HOSTILE / "forges_an_unlimited_phase.py", "--timeout", "1", timeout=60)
    assert done.returncode == 3 and done.stdout == ""  # before: it ran until killed from outside
    error_line(done.stderr, "did not finish within 12 s", "--timeout")  # twice the limit and 10 s between phases
    assert time.monotonic() - started < 30


@pytest.mark.slow  # waits out a 5 s limit after a full trace (13 s)
def test_a_forward_that_loops_only_on_real_tensors_is_stopped_under_verify_rank():
    started = time.monotonic()
    done = rankaudit(HOSTILE / "v_loops_off_meta.py", "--verify", "rank", "--timeout", "5", "--format", "json")
    assert done.returncode == 3 and done.stdout == ""
    error_line(done.stderr, "the first forward of", "on real inputs did not finish within 5 s")
    assert time.monotonic() - started < 120


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--verify", "rgap", "--steps", "1000000000"], "--steps"),
        (["--verify", "rgap", "--samples", "100000"], "--samples"),
        (["--verify", "gdbr", "--trials", "1000000000"], "--trials"),
        (["--verify", "bias", "-b", "1000000"], "a batch of 1,000,000"),
        (["--verify", "rgap", "--samples", "1000", "--steps", "100000"], "sample-gradient passes"),
    ],
)
def test_a_verifier_budget_of_days_is_refused_before_any_work(run_cli, flags, named):
    started = time.monotonic()
    code, out, err = run_cli(HOSTILE / "marked.py", *flags)
    assert code == 2 and out == ""
    error_line(err, named, "above the")
    assert time.monotonic() - started < 30


def test_the_budget_counts_the_configured_batch_size_too(run_cli, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\nbatch-size = 1000000\n")
    model = tmp_path / "plain.py"
    model.write_text((HOSTILE / "v_plain.py").read_text())
    code, _, err = run_cli(model, "--verify", "bias")
    assert code == 2
    error_line(err, "a batch of 1,000,000 samples", "4,096")


# ---- error reporting: one line and the documented exit code -------------------------------------------------------


@pytest.mark.parametrize("shape", ["100000x100000x100000", "3x100000000000000000000x1", "4294967296"])
def test_a_huge_input_shape_is_a_usage_error(run_cli, shape):
    code, out, err = run_cli(HOSTILE / "marked.py", "--input-shape", shape)
    assert code == 2 and out == ""
    error_line(err, "values per sample, above the")
    assert "frame #" not in err


@pytest.mark.parametrize("content", ["nested", "binary", "tool-not-a-table"])
def test_an_unreadable_pyproject_is_exit_2_naming_the_file(run_cli, tmp_path, content):
    config = tmp_path / "pyproject.toml"
    if content == "nested":
        config.write_text("a = " + "[" * 100000 + "]" * 100000 + "\n[tool.rankaudit]\n")
    elif content == "binary":
        config.write_bytes(bytes(range(256)) * 20)
    else:
        config.write_text('tool = "text"\n')
    model = tmp_path / "plain.py"
    model.write_text((HOSTILE / "v_plain.py").read_text())
    code, out, err = run_cli(model, "--format", "json")
    if content == "tool-not-a-table":  # no [tool.rankaudit]: the defaults
        assert code in (0, 1) and json.loads(out)
        return
    assert code == 2 and out == ""
    error_line(err, str(config), "nests more than" if content == "nested" else "not valid TOML")


@pytest.mark.parametrize("how", ["closed", "read-then-closed"])
def test_a_closed_stdout_ends_quietly_with_the_verdicts_code(how):
    plain = HOSTILE / "v_plain.py"
    if how == "closed":
        done = subprocess.run(
            f"rankaudit {plain} >&-", shell=True, capture_output=True, text=True, cwd=REPO, timeout=240
        )
    else:
        done = subprocess.run(
            f"rankaudit {plain} | head -c 0; exit ${{PIPESTATUS[0]}}",
            shell=True,
            executable="/bin/bash",
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=240,
        )
    assert done.returncode == 1, done.stderr  # the plain model is exposed: the policy fails, exit 1
    if how == "closed":  # the report went nowhere: said once (before: nothing at all)
        error_line(done.stderr, "stdout is closed (>&-), so the report went nowhere", "-o PATH")
    else:  # the reader had what it wanted
        assert "Traceback" not in done.stderr and "error" not in done.stderr


@pytest.mark.parametrize(("model", "code"), [("v_plain.py", 1), ("no_such_model.py", 2)])
def test_a_closed_stderr_keeps_the_exit_code(model, code):
    """Before: with 2>&- a model that never ran was exit 1, "policy failed"."""
    done = subprocess.run(
        f"rankaudit {HOSTILE / model} --format json 2>&-",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert done.returncode == code and done.stderr == ""
    if code == 1:
        assert json.loads(done.stdout)["verdict"] == "exposed"


def test_a_mistyped_command_fails_at_once(run_cli):
    code, out, err = run_cli("sugest", HOSTILE / "marked.py")
    assert code == 2 and out == ""
    error_line(err, "no command 'sugest'", "did you mean `rankaudit suggest`?")
    assert "marked.py imported" not in err


def test_model_args_in_the_configuration_build_a_model_file(run_cli, tmp_path):
    model = tmp_path / "needs.py"
    model.write_text((HOSTILE / "needs_arguments.py").read_text())
    code, _, err = run_cli(model, "--format", "json")
    assert code == 3
    error_line(err, "model-args in [tool.rankaudit]")
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\nmodel-args = {width = 3}\n")
    code, out, err = run_cli(model, "--format", "json")
    assert code in (0, 1), err
    assert json.loads(out)["layers"][0]["outputs"] == 3


def test_progress_lines_off_a_terminal_say_what_is_left():
    import io

    from rankaudit.verify.progress import ProgressBar

    stream = io.StringIO()
    with ProgressBar(4, "attack", stream=stream, log_interval=0.05) as bar:
        bar.update()
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("rankaudit: attack: 1/4 after ") for line in lines)
    assert "left" in lines[-1] and "\r" not in stream.getvalue()
    quiet = io.StringIO()
    with ProgressBar(4, "attack", stream=quiet, log_interval=60) as bar:  # a run shorter than the interval
        bar.update(4)
    assert quiet.getvalue() == ""


def test_the_check_whether_the_file_runs_on_its_own_keeps_to_the_timeout():
    started = time.monotonic()
    done = rankaudit(HOSTILE / "loops_when_run_alone.py", "--timeout", "4")
    assert done.returncode == 3
    error_line(done.stderr, "only imported by rankaudit", "could not be checked", "over 4 s")
    assert time.monotonic() - started < 60  # the check's own limit was 120 s whatever --timeout said


def test_an_output_naming_a_file_of_an_app_is_refused(run_cli, tmp_path):
    import shutil

    app = tmp_path / "app"
    shutil.copytree(REPO / "tests" / "apps" / "quickstart", app)
    before = {path: path.read_bytes() for path in app.rglob("*") if path.is_file()}
    for target in (app / "pyproject.toml", app / "quickstart_app" / "task.py"):
        code, out, err = run_cli(app, "--format", "json", "-o", target)
        assert code == 2 and out == ""
        error_line(err, f"-o {target} is a file read from the app folder", "would overwrite it")
    assert {path: path.read_bytes() for path in app.rglob("*") if path.is_file()} == before


# ---- numbers and paths the system cannot hold: one line, exit 2 ---------------------------------------------------

HUGE = "9" * 400


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--input-shape", HUGE], "values per sample, above the"),
        (["--input-shape", f"3,{HUGE},2"], "values per sample, above the"),
        (["--input-shape", "9" * 5000], "--input-shape has a dimension of 5000 digits"),
        (["--memory-limit", "1e308"], "--memory-limit"),
        (["--timeout", "1e308"], "--timeout"),
        (["--batch-size", HUGE], "--batch-size a 400-digit number is too large"),
        (["--local-epochs", HUGE], "--local-epochs a 400-digit number is too large"),
    ],
)
def test_a_number_too_large_is_one_line(run_cli, args, named):
    code, out, err = run_cli(HOSTILE / "v_plain.py", *args)  # before: an internal error (OverflowError), exit 3
    assert code == 2 and out == ""
    error_line(err, named)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (f"batch-size = {HUGE}", "batch-size must be at most"),
        (f"timeout = {HUGE}", "timeout must be a positive number of seconds"),
        ("memory-limit = 1e308", "memory-limit must be a number of GiB"),
        (f"[tool.rankaudit.round]\nlocal-epochs = {HUGE}", "round.local-epochs must be at most"),
        (f"[tool.rankaudit.round]\nlr = {HUGE}", "round.lr must be a number of at most"),
    ],
)
def test_a_configured_number_too_large_is_one_line(run_cli, tmp_path, line, named):
    (tmp_path / "net.py").write_text((HOSTILE / "v_plain.py").read_text())
    (tmp_path / "pyproject.toml").write_text(f"[tool.rankaudit]\n{line}\n")
    code, out, err = run_cli(tmp_path / "net.py")
    assert code == 2 and out == ""
    error_line(err, named, "a 400-digit number" if HUGE in line else "1e+308")


@pytest.mark.parametrize("command", ["check", "suggest"])
@pytest.mark.parametrize("case", ["over-path-max", "name-over-name-max", "not-utf-8"])
def test_a_path_the_system_cannot_open_is_one_line(run_cli, tmp_path, case, command):
    if case == "over-path-max":
        path, named = str(tmp_path / ("a/" * 3000)) + "net.py", "longer than the system opens"
    elif case == "name-over-name-max":
        path, named = str(tmp_path / ("a" * 300)) + ".py", "longer than the system opens"
    else:
        raw = os.fsencode(tmp_path) + b"/net\xff.py"
        with open(raw, "wb") as handle:
            handle.write((HOSTILE / "v_plain.py").read_bytes())
        path, named = os.fsdecode(raw), "net\\xff.py is not valid UTF-8"  # before: blamed on the meta device
    code, out, err = run_cli(command, path)
    assert code == 2 and out == ""
    error_line(err, named, "fix:")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("how", ["finishes", signal.SIGKILL, signal.SIGTERM])
def test_no_process_of_the_model_outlives_rankaudit_even_in_a_session_of_its_own(tmp_path, how):
    marker = f"daemon_{os.getpid()}_{how}"
    model = tmp_path / f"{marker}.py"
    model.write_text((HOSTILE / "starts_a_daemon.py").read_text())
    environment = {**os.environ, "RANKAUDIT_TEST_PIDS": str(tmp_path)}
    if how != "finishes":
        environment["RANKAUDIT_TEST_WAIT"] = "1"
    process = subprocess.Popen(
        ["rankaudit", model, "--timeout", "200"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=environment,
    )
    seen, deadline = "", time.monotonic() + 120
    while "started two sleepers" not in seen and time.monotonic() < deadline:
        seen += process.stderr.readline()
    pids = list(map(int, (tmp_path / "pids").read_text().split()))
    if how != "finishes":
        assert all(_alive(pid) for pid in pids)
        time.sleep(2)  # the watchdog lists the processes below rankaudit twice a second
        os.kill(process.pid, how)  # rankaudit itself, not its process group
    _, said = process.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while (any(map(_alive, pids)) or _running_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)) and _running_with(marker) == []  # before: alive a minute later
    assert process.returncode == (1 if how == "finishes" else 128 + how if how == signal.SIGTERM else -how), said


def test_artifacts_without_a_verifier_is_refused(run_cli, tmp_path):
    code, out, err = run_cli(HOSTILE / "marked.py", "--artifacts", tmp_path / "art")  # before: silently ignored
    assert code == 2 and out == "" and not (tmp_path / "art").exists()
    error_line(err, "--artifacts", "add --verify rank")
    assert "marked.py imported" not in err


def test_a_deleted_working_directory_is_named(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f"cd {gone} && rmdir {gone} && rankaudit {HOSTILE / 'v_plain.py'}"
    done = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2 and done.stdout == ""  # before: torch's failure, blamed on the model (exit 3)
    error_line(done.stderr, "the working directory no longer exists")


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_a_model_path_that_is_no_regular_file_is_refused(run_cli, tmp_path, target):
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
        target = tmp_path / "fifo"
    (tmp_path / "net.py").symlink_to(target)
    code, out, err = run_cli(tmp_path / "net.py")  # before: /dev/zero was read without end
    assert code == 2 and out == ""
    error_line(err, "is not a regular file")


def test_a_report_onto_a_named_pipe_nobody_reads_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    done = rankaudit(HOSTILE / "marked.py", "-o", tmp_path / "fifo", timeout=60)  # before: it hung
    assert done.returncode == 2 and done.stdout == ""
    error_line(done.stderr, "is a named pipe (FIFO) that no process reads")


def test_a_report_onto_a_named_pipe_reaches_its_reader(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    reader = subprocess.Popen(["cat", tmp_path / "fifo"], stdout=subprocess.PIPE, text=True)
    try:
        done = rankaudit(HOSTILE / "v_plain.py", "-o", tmp_path / "fifo", "--format", "json", timeout=120)
        received, _ = reader.communicate(timeout=60)
    finally:
        reader.kill()
        reader.wait()
    assert done.returncode == 1, done.stderr
    assert json.loads(received)["verdict"] == "exposed"


# ---- a broken app configuration: one line, exit 2, never analysed as if it were right ----------------------------

APPS = REPO / "tests" / "apps"


def _quickstart(tmp_path, edit):
    import shutil

    app = tmp_path / "app"
    shutil.copytree(APPS / "quickstart", app)
    pyproject = app / "pyproject.toml"
    pyproject.write_text(edit(pyproject.read_text()))
    return app


@pytest.mark.parametrize(
    ("case", "edit", "named"),
    [
        (
            "colons",
            lambda text: text.replace('clientapp = "quickstart_app.client_app:app"', 'clientapp = "::::"'),
            "clientapp = '::::' is not a MODULE:ATTRIBUTE reference",
        ),
        (
            "missing-module",
            lambda text: text.replace("quickstart_app.client_app:app", "quickstart_app.no_such:app"),
            "names the module quickstart_app.no_such, which is not in the app",
        ),
        (
            "unknown-mapped-key",
            lambda text: text + '\n[tool.rankaudit.flower]\nlr = "no-such-key"\n',
            "[tool.rankaudit.flower] lr names the run-config key 'no-such-key'",
        ),
        (
            "table-for-a-number",
            lambda text: text.replace("local-epochs = 1", "local-epochs = {a = 1}"),
            "run-config key local-epochs is a table",
        ),
        (
            "no-components",
            lambda text: text.replace(
                '[tool.flwr.app.components]\nserverapp = "quickstart_app.server_app:app"\n'
                'clientapp = "quickstart_app.client_app:app"\n',
                "",
            ),
            "has no [tool.flwr.app.components] table",
        ),
    ],
)
def test_a_broken_app_configuration_is_one_line(run_cli, tmp_path, case, edit, named):
    app = _quickstart(tmp_path, edit)
    code, out, err = run_cli(app, "--format", "json")  # before: each was analysed, exit 1 with a report
    assert code == 2 and out == ""
    error_line(err, named, "fix:")


def test_pyproject_is_parsed_once_per_run(run_cli, tmp_path, monkeypatch):
    from rankaudit.settings import pyproject

    app = _quickstart(tmp_path, lambda text: text)
    parsed = []
    parse = pyproject._parse_toml
    monkeypatch.setattr(pyproject, "_parse_toml", lambda path: parsed.append(path) or parse(path))
    code, out, _ = run_cli(app, "--format", "json")
    assert code in (0, 1) and json.loads(out)
    assert [path.name for path in parsed].count("pyproject.toml") == 1  # before: three times
