"""`--mixed_precision auto`, the shapes preset's: bf16 where the CPU (or GPU) runs it natively, float32 elsewhere, a
precision set by `accelerate launch` kept, and the log saying which and why."""

from pathlib import Path

import pytest
import torch

from diffusers_lmlp import cpu
from diffusers_lmlp.training.step import choose_precision


EPYC = cpu.CPU("AMD EPYC 9B14", frozenset({"avx2", "avx512f", "avx512_bf16"}), 2)
SAPPHIRE_RAPIDS = cpu.CPU(
    "Intel(R) Xeon(R) Platinum 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), 2
)
HASWELL = cpu.CPU("Intel(R) Xeon(R) CPU E5-2680 v3", frozenset({"avx2"}), 2)
SKYLAKE = cpu.CPU("Intel(R) Xeon(R) Gold 6148", frozenset({"avx2", "avx512f"}), 2)  # AVX-512, but no bf16
APPLE = cpu.CPU("arm", frozenset(), 8)  # no /proc/cpuinfo: not taken for native bf16


@pytest.fixture
def on_cpu(monkeypatch):
    """No GPU and no precision from `accelerate launch`; returns a function that sets the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    def use(machine: cpu.CPU) -> None:
        monkeypatch.setattr("diffusers_lmlp.training.step.this_cpu", lambda: machine)

    return use


@pytest.mark.parametrize(
    "machine, expected, named",
    [(EPYC, "bf16", "avx512_bf16"), (SAPPHIRE_RAPIDS, "bf16", "AMX"), (HASWELL, "no", None), (SKYLAKE, "no", None),
     (APPLE, "no", None)]
)  # fmt: skip
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(on_cpu, machine, expected, named):
    on_cpu(machine)
    precision, why = choose_precision("auto")
    assert precision == expected
    assert machine.model in why  # the log names the CPU
    if named:
        assert f"native bf16, {named}" in why
    else:
        assert "float32, the CPU has no native bf16 (avx512_bf16 or AMX)" in why


@pytest.mark.parametrize("requested", [None, "no", "fp16", "bf16"])
def test_a_precision_other_than_auto_is_used_as_given(on_cpu, requested):
    on_cpu(HASWELL)  # bf16 as asked for, even where it is slow
    assert choose_precision(requested) == (requested, "")


def test_a_precision_set_by_accelerate_launch_is_kept(on_cpu, monkeypatch):
    on_cpu(HASWELL)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate launch --mixed_precision bf16
    assert choose_precision("auto") == (None, " (auto: the launch's bf16 is kept)")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # examples/accelerate.yaml's: auto decides
    assert choose_precision("auto")[0] == "no"


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_a_gpu_follows_its_bf16_support(on_cpu, monkeypatch, bf16):
    on_cpu(HASWELL)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100")
    assert choose_precision("auto") == (
        "bf16" if bf16 else "no",
        f" (auto: NVIDIA H100 {'runs bf16 natively' if bf16 else 'has no native bf16'})",
    )
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate launch --cpu: the CPU decides
    assert choose_precision("auto")[0] == "no"


def test_this_cpu_reads_the_flags_the_system_lists():
    here = cpu.this_cpu()
    assert here.cores >= 1 and here.model
    listed = Path("/proc/cpuinfo")
    if listed.is_file():
        flags = next(line for line in listed.read_text().splitlines() if line.startswith("flags")).split(":")[1]
        assert here.flags == frozenset(flags.split())
        assert (here.native_bf16 is not None) == bool({"avx512_bf16", "amx_bf16"} & here.flags)
        first = listed.read_text().split("\n\n")[0].splitlines()  # the first processor's block
        numbers = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
        if "cpu family" in numbers:  # x86
            assert here.generation == f"family {numbers['cpu family']}, model {numbers['model']}"
            assert f"({here.generation}), {here.cores} cores" in here.describe()


def test_the_description_tells_apart_cpus_of_one_name():
    zen4 = cpu.CPU("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}), 2, "family 25, model 17")
    zen5 = cpu.CPU("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}), 2, "family 26, model 2")
    assert zen4.describe() == "AMD EPYC (family 25, model 17), 2 cores, avx2 avx512f avx512_bf16"
    assert zen5.describe() != zen4.describe()
    assert APPLE.describe() == "arm, 8 cores, no avx2/avx512/amx flags known"  # nothing said where nothing is known


def test_the_shapes_preset_trains_in_auto_precision_and_an_explicit_choice_wins(script):
    assert script.parse_args(["--output_dir", "x"]).mixed_precision == "auto"
    assert script.parse_args(["--output_dir", "x", "--mixed_precision", "no"]).mixed_precision == "no"
