"""The machine line of every result names the CPU's matrix instructions, so that results of two
CPUs with the same marketing name but not the same bf16 hardware never pass as comparable."""

from __future__ import annotations

import pytest

from quantspec.eval.machine import cpu_matrix_isa, machine_line
from quantspec.kernels import cpu_ext

FLAGS = {
    "flags : fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16": "AMX",
    "flags : fpu sse2 avx2 avx512f avx512_vnni avx512_bf16": "AVX-512 BF16",
    "flags : fpu sse2 avx2 avx512f avx512_vnni": "AVX-512, no native bf16",
    "flags : fpu sse2 avx2": "AVX2, no native bf16",
    "Features : fp asimd bf16 i8mm": "Arm BF16",
    "Features : fp asimd": "NEON, no native bf16",
}


@pytest.mark.parametrize("flags", FLAGS)
def test_the_widest_isa_is_named_and_agrees_with_the_bf16_rule(flags, monkeypatch):
    assert cpu_matrix_isa(flags) == FLAGS[flags]
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: flags)
    assert cpu_ext.cpu_has_native_bf16() == ("no native bf16" not in FLAGS[flags])


def test_the_line_tells_two_cpus_of_one_name_apart():
    base = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_affinity": 2, "gpus": []}
    amx = machine_line({**base, "cpu_isa": "AMX"})
    assert amx == "Intel(R) Xeon(R) Processor (2 cores, AMX), no GPU"
    assert amx != machine_line({**base, "cpu_isa": "AVX-512, no native bf16"})
    # a description written before the field (older result files) reads as it did
    assert machine_line(base) == "Intel(R) Xeon(R) Processor (2 cores), no GPU"
    assert cpu_matrix_isa("flags : fpu sse2") is None
