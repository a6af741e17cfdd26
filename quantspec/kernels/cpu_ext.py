"""Build and load the optional C++ extension of the CPU backend (quantspec/csrc/*.cpp).

Built with ``torch.utils.cpp_extension.load`` on first use, never at import, and cached under
``$QUANTSPEC_CACHE/ext`` (default ``~/.cache/quantspec/ext``). The build name carries a hash of
the source, the torch version and this CPU's flags, so a shared home directory never hands a
``-march=native`` build to another kind of CPU. When there is no compiler (or the build fails)
``load_cpu_ext()`` warns once and returns None, and the backend uses torch's own packed ops.
``QUANTSPEC_CPU_EXT=0`` turns the extension off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from ..models.paths import cache_root

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = (_CSRC / "cpu_qgemm.cpp", _CSRC / "cpu_dense.cpp", _CSRC / "cpu_fgemv.cpp", _CSRC / "cpu_moe.cpp",
           _CSRC / "cpu_kvsearch.cpp", _CSRC / "cpu_decode.cpp", _CSRC / "cpu_screen.cpp")
HEADERS = (_CSRC / "cpu_qgemm.h", _CSRC / "cpu_moe_glu.h", _CSRC / "cpu_dense.h", _CSRC / "cpu_gemv.h")  # hashed with the sources: a change rebuilds


def cpu_flags() -> str:
    """The CPU's feature flags line of /proc/cpuinfo (else the platform's processor name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the /proc/cpuinfo flags of native bf16 products: x86 AVX-512 BF16 or AMX, Arm BF16
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def has_native_bf16(flags: str) -> bool:
    """Whether a CPU flags line names native bf16 products (``NATIVE_BF16_FLAGS``)."""
    have = flags.split()
    return any(f in have for f in NATIVE_BF16_FLAGS)


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (x86 AVX-512 BF16 or AMX, Arm BF16), where torch's
    bf16 matmul is ~2-3x its fp32 one; elsewhere it is emulated and slower."""
    return has_native_bf16(cpu_flags())


def build_name() -> str:
    """The build folder's name: the sources' bytes, torch, the CPU's flags and where the sources
    are (ninja records their absolute paths, so two checkouts sharing one folder rebuilt it in turn)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
        digest.update(str(source.resolve()).encode())
    digest.update(torch.__version__.encode())
    digest.update(cpu_flags().encode())
    return f"quantspec_cpu_qgemm_{digest.hexdigest()[:12]}"


def compile_flags() -> list[str]:
    """The C++ flags of the extension (and of any kernel built beside it): this CPU's ISA."""
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


def compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def extension_enabled() -> bool:
    return os.environ.get("QUANTSPEC_CPU_EXT", "1") not in ("0", "false", "off")


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir`` for one build, safe against a build killed half-way.

    torch's ``cpp_extension`` guards a build with a plain ``lock`` file that a killed process
    leaves behind, and every later load then waits on it forever. Here an OS lock
    (``flock``, released by the kernel when its holder dies) serializes the builds of
    quantspec's processes, so a ``lock`` file found while holding it is a dead build's and is
    removed. Without ``fcntl`` (Windows) only torch's own file guards the build."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(build_dir / ".quantspec-build.flock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_cpu_ext() -> ModuleType | None:
    """The compiled module (``qgemm``, ``qgemm_panel``, ``dequant_rows``, ``dequant_panel_rows``,
    ``has_avx2``, ``has_vnni``; the two products also as the ops ``torch.ops.quantspec_cpu.qgemm``
    and ``qgemm_panel``; cpu_dense.cpp adds the ops ``rms_norm``, ``rope``, ``silu_mul``,
    ``bf16_gemv``, ``has_bf16_gemv``, ``f32_gemv``, ``attend``, ``argmax_rows`` and
    ``has_avx512f``; cpu_fgemv.cpp the op ``fgemm`` of FP8 / FP4 weights; cpu_moe.cpp the op ``moe_token``
    of a few tokens through a MoE block's chosen experts; cpu_kvsearch.cpp the op
    ``kv_scale_errors`` of the KV-scale search; cpu_decode.cpp the classes ``DecodePlan`` and
``DecodeLinear``, a decode step's blocks as one C++ loop, ``runtime.decode_plan``; cpu_screen.cpp
the ops ``screened_argmax`` and ``has_screened_argmax``, an fp32 head's argmax from its int8
copy, ``kernels.output_head``), or None with one warning."""
    if not extension_enabled():
        return None
    if not compiler_available():
        warnings.warn(
            "quantspec: no C++ compiler found; the cpu backend uses torch's int4/int8 ops "
            "(slower). Install g++ to build the fast kernel.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = cache_root() / "ext" / name
    try:
        with build_lock(build_dir):
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # any build failure: fall back, once, loudly
        warnings.warn(
            f"quantspec: building the cpu kernel failed ({type(exc).__name__}: {exc}); "
            "the cpu backend uses torch's int4/int8 ops (slower).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    _register_fake()
    return module


@functools.cache
def ext_supports(flag: str) -> bool:
    """Whether the extension is built here and its ``flag`` op (``has_bf16_gemv``,
    ``has_avx512f``) says this CPU runs the ops behind it (looked up once)."""
    return load_cpu_ext() is not None and bool(getattr(torch.ops.quantspec_cpu, flag)())


@functools.cache
def _register_fake() -> None:
    """Shapes for torch.compile of the extension's dispatcher op ``quantspec_cpu::qgemm``."""

    @torch.library.register_fake("quantspec_cpu::qgemm")
    def _qgemm_fake(x, w, scales, zeros, src, bias, bits, block, allow_simd):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("quantspec_cpu::qgemm_panel")
    def _qgemm_panel_fake(x, w, scales, zeros, src, bias, bits, block, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quantspec_cpu::rms_norm")
    def _rms_norm_fake(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("quantspec_cpu::rope")
    def _rope_fake(x, cos, sin):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("quantspec_cpu::silu_mul")
    def _silu_mul_fake(gate, up):
        return torch.empty_like(gate)

    @torch.library.register_fake("quantspec_cpu::bf16_gemv")
    def _bf16_gemv_fake(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("quantspec_cpu::f32_gemv")
    def _f32_gemv_fake(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("quantspec_cpu::fgemm")
    def _fgemm_fake(x, codes, scales, gscale, kind, group):
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("quantspec_cpu::moe_token")
    def _moe_token_fake(x, ids, weights, gu_w, gu_scales, gu_zeros, down_w, down_scales, down_zeros,
                        bits, gu_block, down_block, inter, panels, gu_bias=None, down_bias=None, glu=0,
                        alpha=1.0, limit=0.0):
        return torch.empty_like(x)

    @torch.library.register_fake("quantspec_cpu::kv_scale_errors")
    def _kv_scale_errors_fake(x, scales, kind):
        return x.new_empty((scales.shape[0], x.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("quantspec_cpu::argmax_rows")
    def _argmax_rows_fake(x):
        return x.new_empty((x.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("quantspec_cpu::attend")
    def _attend_fake(q, k, v, cos, sin, kc, vc, lo, scale, sinks=None, window=0):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))
