"""The relaxgrad command line: grad prints TVMScript, check runs a numeric gradient check."""

import subprocess
import sys
import textwrap

import pytest

from relaxgrad.cli import main

MODEL = textwrap.dedent(
    """
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Model:
        @R.function
        def main(x: R.Tensor((3, 4), "float32"), w: R.Tensor((4, 2), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                gv = R.sum(R.tanh(lv))
                R.output(gv)
            return gv
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return str(path)


def test_grad_prints_adjoint(model_file, capsys):
    assert main(["grad", model_file, "--func", "main", "--require-grads", "w"]) == 0
    out = capsys.readouterr().out
    assert "def main_adjoint(" in out and "w_adjoint_out" in out and "x_adjoint_out" not in out


def test_check_passes(model_file, capsys):
    assert main(["check", model_file, "--func", "main"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "finite difference" in out


def test_check_fails_on_wrong_rule(model_file, capsys, monkeypatch):
    from relaxgrad.ops import registry

    rules = dict(registry._RULES)
    rules["relax.tanh"] = lambda var, call, grad, ctx: [grad]  # wrong: misses 1 - tanh^2
    monkeypatch.setattr(registry, "_RULES", rules)
    assert main(["check", model_file]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_errors_are_reported(model_file, capsys):
    assert main(["grad", model_file, "--func", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["grad", model_file, "--require-grads", "zz"]) == 2
    assert "zz" in capsys.readouterr().err


def test_console_script(model_file):
    out = subprocess.run(
        [sys.executable, "-m", "relaxgrad.cli", "grad", model_file],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "main_adjoint" in out


def test_demo_trains_digits(capsys):
    assert main(["demo", "--epochs", "10"]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out
    accuracy = float(out.split("test accuracy")[1].split("%")[0])
    assert accuracy >= 95.0


def test_model_file_imports_a_module_beside_it(tmp_path, capsys):
    """The file's folder is on sys.path, as when running ``python model.py``."""
    (tmp_path / "layers.py").write_text(MODEL)
    (tmp_path / "model.py").write_text("from layers import Model\n")
    assert main(["grad", str(tmp_path / "model.py")]) == 0
    assert "def main_adjoint(" in capsys.readouterr().out


def test_missing_file_is_a_clean_error(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.py")]) == 2
    assert "nope.py: no such file" in capsys.readouterr().err


def test_no_module_suggests_module_option(tmp_path, capsys):
    body = "\n".join("    " + line for line in MODEL.splitlines())
    path = tmp_path / "model.py"
    path.write_text(f"def build():\n{body}\n    return Model\n")
    assert main(["grad", str(path)]) == 2
    err = capsys.readouterr().err
    assert "defines no IRModule at top level" in err and "(build)" in err and "--module" in err
    assert main(["grad", str(path), "--module", "build"]) == 0  # a function returning one
    assert "def main_adjoint(" in capsys.readouterr().out


def test_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "relaxgrad" in out
