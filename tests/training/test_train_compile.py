"""The trainer's `auto` choices: `--torch_compile` where it works and pays (same results), `--mixed_precision` bf16
only where it runs natively (a launch's is kept), and glibc keeping freed memory on the CPU unless you set malloc's."""

import ctypes.util
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock, call

import pytest
import torch
from safetensors.torch import load_file
from test_train_text_to_image import ENV, train, train_here, weights

from diffusers_lmlp import LMLPPipeline, allocator, cpu
from diffusers_lmlp.training.step import AUTO_MIN_STEPS, choose_compilation, choose_precision


@pytest.mark.slow
def test_choices_and_what_auto_weighs(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    given = ((None, 5200), ("yes", 10), ("no", 5200))
    assert [choose_compilation(*g) for g in given] == [(None, ""), ("inductor", ""), ("no", "")]
    backend, why = choose_compilation("auto", AUTO_MIN_STEPS - 1)
    assert backend == "no" and f"{AUTO_MIN_STEPS - 1} steps do not repay a compilation; --torch_compile yes" in why
    backend, why = choose_compilation("auto", AUTO_MIN_STEPS)
    assert backend == "inductor" and "inductor works here, a trial compilation took" in why
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what accelerate launch sets when not asked
    assert choose_compilation("auto", AUTO_MIN_STEPS)[0] == "inductor"
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")  # accelerate launch --dynamo_backend aot_eager
    assert choose_compilation("auto", AUTO_MIN_STEPS) == (None, " (auto: the launch's aot_eager is kept)")


@pytest.mark.slow
def test_auto_trains_uncompiled_where_compilation_fails(tmp_path):
    """No working C++ compiler (and a fresh inductor cache): auto says why and does not compile."""
    env = {**ENV, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("ACCELERATE_DYNAMO_BACKEND", None)
    code = "from diffusers_lmlp.training.step import choose_compilation as c; print(*c('auto', 5200), sep='|')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    backend, why = result.stdout.strip().splitlines()[-1].split("|")
    assert backend == "no" and "torch.compile does not work here" in why
    assert "no-such-g++" in why and "training uncompiled" in why


@pytest.mark.slow
def test_a_compiled_run_checkpoints_resumes_validates_and_matches_an_uncompiled_one(workspace):
    steps = "--max_train_steps 4 --checkpointing_steps 2 --validation_steps 2 --validation_prompts".split()
    steps.append("a red circle")
    assert "torch.compile no" in train_here(workspace, "plain", *steps, "--torch_compile", "no").stderr
    assert "torch.compile inductor" in train(workspace, "compiled", *steps, "--torch_compile", "yes").stderr
    # Resumed under regional compilation, it ends where the uncompiled run did, with its keys (no `_orig_mod.`).
    out, plain = workspace / "compiled", workspace / "plain"
    os.rename(out / "checkpoint-4", workspace / "compiled-checkpoint-4")
    launch = "-m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend"
    launch = [*launch.split(), "inductor", "--dynamo_use_regional_compilation"]
    resumed = train(
        workspace, out.name, *steps, "--resume_from_checkpoint", str(out / "checkpoint-2"), launcher=launch
    )
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert "torch.compile inductor" in resumed.stderr
    assert not [p for p in (out / "checkpoint-4").rglob("*.safetensors") for key in load_file(p) if "_orig_mod" in key]
    for run, reference in [(workspace / "compiled-checkpoint-4", plain / "checkpoint-4"), (out, plain)]:
        run, reference = weights(run), weights(reference)
        assert set(run) == set(reference)
        for key, value in reference.items():
            torch.testing.assert_close(run[key], value, rtol=1e-3, atol=1e-4, msg=key)
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == ["step-0000002.png", "step-0000004.png"]
    LMLPPipeline.from_pretrained(out)
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 4


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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_reuse_freed_memory_is_accepted_by_glibc(monkeypatch):
    libc = Mock(wraps=ctypes.CDLL(ctypes.util.find_library("c")))  # glibc's own, recording the calls
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert allocator.reuse_freed_memory(keep_bytes=512 * 1024**2) is True
    assert libc.mallopt.call_args_list == [call(-1, 512 * 1024**2), call(-3, 32 * 1024**2)]  # M_TRIM, M_MMAP_THRESHOLD


@pytest.mark.parametrize(
    "libc", [Mock(side_effect=OSError("no libc")), lambda name: object()], ids=["none", "no-mallopt"]
)
def test_reuse_freed_memory_without_glibc_returns_false(monkeypatch, libc):
    monkeypatch.setattr(allocator.ctypes, "CDLL", libc)
    assert allocator.reuse_freed_memory() is False


@pytest.mark.parametrize(
    "name, value, reused, logged",
    [
        (None, None, True, "glibc keeps up to 1 GiB of freed buffers for reuse"),
        ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F", True, "glibc keeps up to 1 GiB"),  # not malloc's
        *[(name, value, False, f"glibc's malloc as your {name} sets it") for name, value in [
            ("MALLOC_TRIM_THRESHOLD_", "0"), ("MALLOC_MMAP_THRESHOLD_", "131072"),
            ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")]],
        ("no glibc", None, True, "no glibc here"),  # reuse_freed_memory tried, and returned False
    ],
)  # fmt: skip
def test_on_the_cpu_freed_memory_is_kept_unless_you_set_glibc_malloc(monkeypatch, caplog, name, value, reused, logged):
    for variable in (*allocator.MALLOC_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(variable, raising=False)
    if value:
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(allocator, "reuse_freed_memory", reuse := Mock(return_value=name != "no glibc"))
    with caplog.at_level(logging.INFO, logger="diffusers_lmlp.allocator"):
        allocator.keep_freed_memory(torch.device("cpu"))
        allocator.keep_freed_memory(torch.device("meta"))  # a GPU run, as far as this is concerned: nothing changes
    assert reuse.call_count == reused and logged in caplog.text  # once, or never
