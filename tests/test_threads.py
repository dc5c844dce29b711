"""relaxgrad/_threads.py: TVM's thread count defaults to the physical cores, not TVM's half of
the logical CPUs."""

from __future__ import annotations

import os
import subprocess
import sys

from relaxgrad import _threads


def test_physical_cores_is_at_most_the_usable_cpus():
    assert 1 <= _threads.physical_cores() <= len(os.sched_getaffinity(0))


def test_configure_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    _threads.configure()
    assert os.environ["TVM_NUM_THREADS"] == "3"
    monkeypatch.delenv("TVM_NUM_THREADS")
    _threads.configure()
    assert os.environ["TVM_NUM_THREADS"] == str(_threads.physical_cores())


def test_tvm_runs_on_every_physical_core_after_import():
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    code = (
        "import relaxgrad, tvm; from relaxgrad import _threads; "
        "print(tvm.get_global_func('runtime.NumThreads')(), _threads.physical_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    threads, cores = out.stdout.split()
    assert threads == cores
