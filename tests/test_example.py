"""The embedded example (python -m relaxgrad.example) runs end to end and checks itself."""

from relaxgrad.example import main


def test_example_runs(capsys):
    main()
    out = capsys.readouterr().out
    assert "def main_adjoint(" in out
    assert "finite-difference check (float64 twin): passed" in out
