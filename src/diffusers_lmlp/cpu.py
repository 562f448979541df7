"""What the CPU can do, read once from the operating system: its model name and whether bf16 is fast (native with
`avx512_bf16` or AMX; elsewhere torch emulates it, far slower than float32). Only Linux lists the flags."""

import functools
import os
import platform
from dataclasses import dataclass


# Flag -> what the log calls the CPU's native bf16 matmuls.
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "avx512_bf16"}
# The flags worth naming beside a benchmark table.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CPU:
    """This machine's CPU: model name, `/proc/cpuinfo` flags, the cores this process may use, and `generation`
    ("family 26, model 2"), which tells apart CPUs a cloud machine names alike; flags and generation may be empty."""

    model: str
    flags: frozenset[str]
    cores: int
    generation: str = ""

    @property
    def native_bf16(self) -> str | None:
        """The instruction set that runs bf16 matmuls natively ("AMX", "avx512_bf16"), or None."""
        return next((name for flag, name in NATIVE_BF16_FLAGS.items() if flag in self.flags), None)

    def describe(self) -> str:
        """The CPU in one line, for logs and benchmark tables: model, generation, cores and the vector flags it has."""
        vectors = " ".join(flag for flag in VECTOR_FLAGS if flag in self.flags) or "no avx2/avx512/amx flags known"
        generation = f" ({self.generation})" if self.generation else ""
        return f"{self.model}{generation}, {self.cores} cores, {vectors}"


@functools.cache
def this_cpu() -> CPU:
    """This machine's CPU, read once."""
    model, flags, numbers = platform.processor() or platform.machine(), frozenset(), {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), "x86_64"):
                    model = value.strip()
                elif key.strip() in ("cpu family", "model"):  # listed before "flags", once per processor
                    numbers[key.strip()] = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:  # not Linux
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    generation = f"family {numbers['cpu family']}, model {numbers['model']}" if len(numbers) == 2 else ""
    return CPU(model=model, flags=flags, cores=cores, generation=generation)
