"""`--mixed_precision auto`: bf16 where the CPU or GPU runs it natively, else float32; a launch's precision is kept."""

from pathlib import Path

import pytest
import torch

from diffusers_lmlp import cpu
from diffusers_lmlp.training.step import choose_precision


BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
EPYC = cpu.CPU("AMD EPYC 9B14", BF16, 2)
SAPPHIRE_RAPIDS = cpu.CPU("Intel(R) Xeon(R) Platinum 8481C", BF16 | {"amx_bf16"}, 2)
HASWELL = cpu.CPU("Intel(R) Xeon(R) CPU E5-2680 v3", frozenset({"avx2"}), 2)
SKYLAKE = cpu.CPU("Intel(R) Xeon(R) Gold 6148", frozenset({"avx2", "avx512f"}), 2)  # AVX-512, but no bf16
APPLE = cpu.CPU("arm", frozenset(), 8)  # no /proc/cpuinfo: not taken for native bf16


@pytest.fixture
def on_cpu(monkeypatch):
    """No GPU and no precision from `accelerate launch`; returns a function that sets the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return lambda machine: monkeypatch.setattr("diffusers_lmlp.training.step.this_cpu", lambda: machine)


@pytest.mark.parametrize(
    "machine, expected, named",
    [(EPYC, "bf16", "native bf16, avx512_bf16"), (SAPPHIRE_RAPIDS, "bf16", "native bf16, AMX"),
     *[(m, "no", "float32, the CPU has no native bf16 (avx512_bf16 or AMX)") for m in (HASWELL, SKYLAKE, APPLE)]]
)  # fmt: skip
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(on_cpu, machine, expected, named):
    on_cpu(machine)
    precision, why = choose_precision("auto")
    assert precision == expected and machine.model in why and named in why  # the log names the CPU


@pytest.mark.parametrize(
    "requested, launch, expected, why",
    [*[(given, None, given, "") for given in (None, "no", "fp16", "bf16")],  # bf16 as asked for, even where it is slow
     ("auto", "bf16", None, " (auto: the launch's bf16 is kept)"),  # accelerate launch --mixed_precision bf16
     ("auto", "no", "no", "float32, the CPU has no native bf16")],  # examples/accelerate.yaml's: auto decides
)  # fmt: skip
def test_a_precision_given_or_set_by_accelerate_launch_is_kept(on_cpu, monkeypatch, requested, launch, expected, why):
    on_cpu(HASWELL)
    if launch:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launch)
    precision, reason = choose_precision(requested)
    assert precision == expected and (why in reason if launch == "no" else reason == why)


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_a_gpu_follows_its_bf16_support(on_cpu, monkeypatch, bf16):
    on_cpu(HASWELL)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100")
    why = " (auto: NVIDIA H100 runs bf16 natively)" if bf16 else " (auto: NVIDIA H100 has no native bf16)"
    assert choose_precision("auto") == ("bf16" if bf16 else "no", why)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate launch --cpu: the CPU decides
    assert choose_precision("auto")[0] == "no"


def test_this_cpu_reads_the_flags_the_system_lists_and_describes_itself():
    here, listed = cpu.this_cpu(), Path("/proc/cpuinfo")
    assert here.cores >= 1 and here.model
    if listed.is_file():
        flags = next(line for line in listed.read_text().splitlines() if line.startswith("flags")).split(":")[1]
        assert here.flags == frozenset(flags.split())
        assert (here.native_bf16 is not None) == bool({"avx512_bf16", "amx_bf16"} & here.flags)
        first = listed.read_text().split("\n\n")[0].splitlines()  # the first processor's block
        numbers = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
        if "cpu family" in numbers:  # x86
            assert here.generation == f"family {numbers['cpu family']}, model {numbers['model']}"
            assert f"({here.generation}), {here.cores} cores" in here.describe()
    # The description tells apart CPUs of one name, and says nothing where nothing is known.
    zen4, zen5 = (cpu.CPU("AMD EPYC", BF16, 2, f"family {f}, model {m}") for f, m in ((25, 17), (26, 2)))
    assert zen4.describe() == "AMD EPYC (family 25, model 17), 2 cores, avx2 avx512f avx512_bf16"
    assert zen5.describe() != zen4.describe()
    assert APPLE.describe() == "arm, 8 cores, no avx2/avx512/amx flags known"
