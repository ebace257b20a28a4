"""``liveshard operator``: flags, errors, and the admission check."""

from __future__ import annotations

import subprocess
import sys

import kopf
import pytest

from liveshard.operator.handlers import admission
from liveshard.runtime.cli import main


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["operator", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--namespace", "--kubeconfig", "--metrics-port", "--liveness", "--watch-timeout", "--webhook-port"):
        assert flag in out


@pytest.mark.parametrize("argv,message", [
    (["operator", "--watch-timeout", "0"], "liveshard operator: error: --watch-timeout: 0 is not a positive"),
    (["operator", "--metrics-port", "70000"], "liveshard operator: error: --metrics-port: 70000 is not a port"),
])
def test_bad_flags_are_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_parsing_the_command_line_imports_neither_kopf_nor_kubernetes():
    code = ("import sys; from liveshard.runtime.cli import _lazy_parser; "
            "_lazy_parser(['operator']).parse_args(['operator']); "
            "print(sorted(m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_admission_refuses_what_only_the_model_can_tell():
    spec = {"model": {"preset": "llama3-8b"}, "image": "img", "workers": {"max": 2},
            "parallelism": {"ep": [2]}, "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 8}}
    with pytest.raises(kopf.AdmissionError) as e:
        admission.check_spec(spec=spec)
    assert str(e.value).startswith("spec.parallelism.ep:")
    admission.check_spec(spec={**spec, "parallelism": {"tp": [1, 2, 4, 8]}})  # accepted
