"""``python -m tapegrad.bench``'s command line: case selection, --list, --plot and the exit
status (no benchmark runs here: the runners are stubbed)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tapegrad.bench import __main__ as cli


def listed(capsys, *argv):
    assert cli.main(["--list", *argv]) == 0
    return capsys.readouterr().out.split()


def test_list_shows_every_case_and_honours_only(capsys):
    assert listed(capsys) == cli.all_case_names()
    assert listed(capsys, "--only", "cuda") == cli.CUDA_CASES


def test_only_takes_several_patterns_after_one_flag(capsys):
    # the command fast-loops.md shows
    got = listed(capsys, "--only", "replay*", "adam*")
    assert got and all(n.startswith(("replay", "adam")) for n in got)
    assert "adam_1000_steps_rosenbrock_scalar_n100" in got
    assert got == listed(capsys, "--only", "replay*,adam*")
    assert got == listed(capsys, "--only", "replay*", "--only", "adam*")


def test_an_exact_name_selects_that_case_only(capsys):
    # replay_rosenbrock_scalar_n100 is also the prefix of ..._n1000 and ..._n100_vs_casadi
    assert listed(capsys, "--only", "replay_rosenbrock_scalar_n100") == \
        ["replay_rosenbrock_scalar_n100"]
    assert listed(capsys, "--only", "rosenbrock_scalar_n100") == ["rosenbrock_scalar_n100"]
    # a prefix that is no case's name still selects by prefix, in the table's order
    assert listed(capsys, "--only", "rosenbrock_vec") == \
        ["rosenbrock_vec_n10", "rosenbrock_vec_n1000", "rosenbrock_vec_n100000"]


def test_a_pattern_that_matches_nothing_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--list", "--only", "replay*", "rosenbrok"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--only rosenbrok matched no case" in err and "rosenbrock_scalar_n100" in err


def test_plot_without_matplotlib_says_how_to_install_it_before_running(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(cli, "run_speed_case", lambda *a: pytest.fail("ran a case"))
    with pytest.raises(SystemExit):
        cli.main(["--only", "rosenbrock_scalar_n100", "--plot", "out.png"])
    assert "pip install 'tapegrad[plot]'" in capsys.readouterr().err


def fake_row(passed, error=None):
    return cli.Row("rosenbrock_scalar_n100", "speed", "s", ">= 2x", tapegrad=1e-3,
                   torch=1.5e-3, ratio=1.5, passed=passed, error=error)


@pytest.mark.parametrize("strict", [False, True])
def test_a_missed_target_is_counted_and_fails_only_with_strict(monkeypatch, capsys, strict):
    monkeypatch.setattr(cli, "run_speed_case", lambda *a: fake_row(False))
    argv = ["--only", "rosenbrock_scalar_n100"] + (["--strict"] if strict else [])
    assert cli.main(argv) == (1 if strict else 0)
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert "1 of 1 rows missed their target" in out
    assert ("(--strict)" if strict else "pass --strict to make that a failure") in out


def test_summary_line_counts_errors_and_passes():
    assert cli.summary_line([fake_row(True)], False) == "all 1 rows with a target met it"
    line = cli.summary_line([fake_row(True), fake_row(False), fake_row(False, "boom")], False)
    assert line.startswith("1 of 3 rows raised an error")
    assert "1 of 3 rows missed their target" in line


def test_the_module_runs_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "tapegrad.bench", "--list", "--only", "import"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["import_to_first_grad_warm", "import_to_first_grad_cold"]


def test_a_missing_optional_peer_skips_its_rows_with_one_line(monkeypatch, capsys):
    # casadi is only in the bench extra: a user with torch alone gets a table and status 0
    monkeypatch.setitem(sys.modules, "casadi", None)  # import casadi raises ImportError
    ran = []
    monkeypatch.setattr(cli, "run_speed_case", lambda name, *a: ran.append(name) or
                        fake_row(True))
    casadi_rows = [n for n in cli.all_case_names() if n.endswith("_vs_casadi")]
    assert cli.main(["--only", "rosenbrock_scalar_n100", *casadi_rows]) == 0
    out = capsys.readouterr().out
    assert ran == ["rosenbrock_scalar_n100"]
    lines = [line for line in out.splitlines() if "casadi" in line]
    assert lines == [f"casadi not installed: pip install 'tapegrad[bench]' "
                     f"(skipping its {len(casadi_rows)} rows)"]
    assert "ERROR" not in out


def test_the_tests_run_in_one_process_without_xdist():
    # pyproject's addopts pass -n 2; without pytest-xdist the run goes on, after one warning
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
                        "-p", "no:cacheprovider", "tests/test_bench_cli.py", "-k", "list_shows"],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-n 2 ignored: pytest-xdist is not installed" in r.stdout
