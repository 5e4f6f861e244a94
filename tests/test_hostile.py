"""Hostile and broken inputs (issue 23): a model file that ends the process, hangs, or prints into the report, and
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
        cwd=REPO,
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


def test_dager_keeps_the_json_on_stdout():
    pytest.importorskip("transformers")
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
    code, _, err = run_cli(HOSTILE / "marked.py", "--artifacts", tmp_path / "file" / "art")
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
