"""The hardware facts are asked in one place and overridden by one variable; tests run float32
unless they are about autocast, on every machine and in every process they start."""

import os
import subprocess
import sys

import pytest

from hiso import hardware


def test_the_override_reports_each_fact_as_said(monkeypatch):
    monkeypatch.setattr(hardware, "_detected", lambda name: name != "amx")
    monkeypatch.setenv(hardware.ENV, "")
    assert not hardware.has("amx") and hardware.has("cuda")
    monkeypatch.setenv(hardware.ENV, "amx=1, cuda=0")
    assert hardware.has("amx") and not hardware.has("cuda") and hardware.has("triton")
    assert hardware.bf16_matmul_units("cpu") and not hardware.bf16_matmul_units("cuda:0")
    assert "amx=yes" in hardware.summary() and "cuda=no" in hardware.summary()


@pytest.mark.parametrize("value, match", [("amx", "NAME=0 or NAME=1"), ("amx=2", "NAME=0 or NAME=1"),
                                          ("gpu=1", "one of amx, cuda, triton"),
                                          ("avx512=0", "ATEN_CPU_CAPABILITY")])
def test_a_malformed_override_is_refused_in_one_line(monkeypatch, value, match):
    monkeypatch.setenv(hardware.ENV, value)
    with pytest.raises(ValueError, match=match):
        hardware.has("amx")


def test_a_device_that_is_absent_cannot_be_reported_present(monkeypatch):
    monkeypatch.setattr(hardware, "_detected", lambda name: False)
    monkeypatch.setenv(hardware.ENV, "cuda=1")
    with pytest.raises(ValueError, match="claims what this machine lacks"):
        hardware.has("cuda")
    monkeypatch.setenv(hardware.ENV, "amx=1")  # a CPU's bf16 units can: their code runs on any CPU
    assert hardware.has("amx")


def test_cuda_reported_absent_is_absent_to_device_resolution(monkeypatch):
    from hiso.tasks.device import resolve

    monkeypatch.setattr(hardware, "_detected", lambda name: True)  # as if this machine had a GPU
    monkeypatch.setenv(hardware.ENV, "cuda=0")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve("cuda")


def test_a_test_not_about_autocast_sees_no_bf16_units_in_every_process_it_starts():
    assert not hardware.has("amx")
    out = subprocess.run([sys.executable, "-m", "hiso.hardware"], capture_output=True, text=True, check=True,
                         env={**os.environ})
    assert "amx=no" in out.stdout


@pytest.mark.autocast
def test_a_test_about_autocast_sees_what_the_override_says(monkeypatch):
    monkeypatch.setenv(hardware.ENV, "amx=1")
    assert hardware.has("amx")
    out = subprocess.run([sys.executable, "-m", "hiso.hardware"], capture_output=True, text=True, check=True)
    assert "amx=yes" in out.stdout
