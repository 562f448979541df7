"""What the CPU can do, read once from the operating system: its model name and the instruction sets that decide
whether bf16 is fast.

bf16 matmuls are native on x86 CPUs with `avx512_bf16` (AMD Zen 4 and later, Intel Cooper Lake) or AMX (`amx_bf16`,
Intel Sapphire Rapids and later), where bf16 autocast trains the shapes model about 1.4× faster than float32. Elsewhere
(AVX2 only, AVX-512 without bf16) torch emulates them, 8 to 80 times slower: there float32 is right. Only Linux says
which flags the CPU has (`/proc/cpuinfo`); on other systems no CPU is taken for native bf16.
"""

import functools
import os
import platform
from dataclasses import dataclass


# The flags that name a CPU's native bf16 matmuls, and what the log calls them.
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "avx512_bf16"}
# The flags worth naming beside a benchmark table.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CPU:
    """This machine's CPU.

    Args:
        model (`str`): Its model name ("AMD EPYC 9B14"), or the architecture when the system does not say.
        flags (`frozenset[str]`): Its feature flags, as `/proc/cpuinfo` lists them (empty elsewhere).
        cores (`int`): The cores this process may run on.
        generation (`str`, *optional*): Its family and model numbers ("family 26, model 2"), which tell apart CPUs
            that a cloud machine names alike ("AMD EPYC" for Zen 4 and Zen 5 alike); empty where the system does not
            say.
    """

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
