"""The pytest plugin costs nothing in a pytest run that collects no case.

Installing hyperdsd registers ``conformance.pytest_plugin`` in every pytest
run of the environment; torch and the case registry must wait until a
conformance case is collected or run.
"""

import json
import os
import subprocess
import sys

from helpers import ROOT, scaled

HEAVY = ("torch", "numpy", "hyperdsd", "conformance.running.registry", "conformance.running.runner")


def _heavy(modules) -> list[str]:
    return sorted(m for m in modules if m in HEAVY or m.split(".")[0] in HEAVY)


def test_importing_the_plugin_imports_nothing_heavy():
    code = "import json, sys; import conformance.pytest_plugin; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout)
    assert "conformance.pytest_plugin" in modules
    assert _heavy(modules) == []


def test_a_pytest_run_with_the_plugin_and_no_case_imports_nothing_heavy(tmp_path):
    # Every hook the plugin has runs here (options, markers, collection);
    # the test itself sees what the run imported by then.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_unrelated.py").write_text(
        "import sys\n"
        "\n"
        "def test_unrelated(request):\n"
        "    assert request.config.getoption('--dsd-impl')  # the plugin is active\n"
        f"    heavy = sorted(m for m in sys.modules if m in {HEAVY!r} or m.split('.')[0] in {HEAVY!r})\n"
        "    assert heavy == [], heavy\n"
    )
    # -p no:conformance then -p by module name: the plugin is loaded once,
    # whether or not this environment has hyperdsd installed.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:conformance",
            "-p",
            "conformance.pytest_plugin",
            "--dsd-xfails",
            os.devnull,
            "test_unrelated.py",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
