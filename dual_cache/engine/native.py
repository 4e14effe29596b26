"""Build, load and call the native selection engine (`selection_engine.cpp`, and the resident set's plan,
`resident_plan.cpp`, in the same library), a plain C ABI through `ctypes`.

Why C++ through `ctypes` (not a torch extension, not numba): the engine only reads raw host buffers, so it needs no
torch headers and no ABI match with the installed torch (the CUDA test machine runs another torch version), it
builds with the system `g++` in seconds and no extra package, and `ctypes` releases the GIL for the whole call. numba
would add a large dependency pinned to numpy versions and has no portable access to VNNI dot products.

The library is built on first use (or by `make install`, `python -m dual_cache.engine`) in three variants of
the same source — `scalar` (baseline ISA), `avx2` (AVX2 + FMA + F16C: `vpmaddubsw` scan) and `avx512` (AVX-512
F/BW/VL/DQ + VNNI: `vpdpbusd` scan, 16-lane exact stage) — into
`$DUAL_CACHE_ENGINE_DIR` or `~/.cache/dual-cache/engine/<source hash>/`. The scalar build is loaded first and asks
the CPU (`__builtin_cpu_supports`) which variants it can run; the best of those that builds is used (a better one
that a compiler cannot build is skipped with one warning naming it), so an older CPU never executes an instruction
it lacks. Every variant returns the same selections (the scan is exact integer arithmetic,
the float loops are written lane by lane without contraction).

`DUAL_CACHE_ENGINE` picks: `auto` (default: the best variant the CPU runs), `scalar`, `avx2`, `avx512` (refused with
`RuntimeError` when the CPU lacks it), or `reference` (the pure-torch reference, `reference.py`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("selection_engine.cpp")
# every source built into the library: the engine, and the resident set's plan (`transfer/resident_set.py`)
SOURCES = (SOURCE, Path(__file__).with_name("resident_plan.cpp"))
VARIANTS = {  # name: (compiler flags, feature bit the CPU must report)
    "scalar": ([], 0),
    "avx2": (["-mavx2", "-mfma", "-mf16c", "-mbmi2"], 1),
    "avx512": (["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                "-mavx512vnni"], 2),
}
COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
CHOICES = ("auto", "reference", *VARIANTS)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_resolved: dict[str, ctypes.CDLL] = {}  # DUAL_CACHE_ENGINE value -> the library it resolved to
_failure: str | None = None  # why the engine cannot be built or loaded (then the reference runs)
_warned = False
_forked_child = False  # this process was fork()ed after this module was imported


def _after_fork_in_child() -> None:
    """In a fork()ed child: torch's OpenMP threads are the parent's (a call on that team would wait for them
    forever), so every engine library, loaded now or later, runs its workers on its own threads; and no lock held
    by another thread of the parent is kept."""
    global _forked_child, _lock
    _forked_child = True
    _lock = threading.Lock()
    for library in _loaded.values():
        library.dc_note_fork()


def _multiprocessing_child() -> bool:
    """Whether this process was started by `multiprocessing` (forked, perhaps before this module was imported, from
    a parent that used OpenMP; spawned children are treated alike)."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def build_dir() -> Path:
    """Where the variants of the current source are built (one folder per source hash and compiler)."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + " ".join(COMMON_FLAGS).encode()
                            + str(_compiler()).encode())
    root = os.environ.get("DUAL_CACHE_ENGINE_DIR") or Path.home() / ".cache" / "dual-cache" / "engine"
    return Path(root) / digest.hexdigest()[:16]


def _build(variant: str) -> Path:
    """Compile `variant` (once per source hash; concurrent builders each write a temporary file, then rename)."""
    target = build_dir() / f"libdualselect-{variant}.so"
    if target.exists():
        return target
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    flags = VARIANTS[variant][0] if _is_x86() else []
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        temporary = Path(tmp.name)
    try:
        result = subprocess.run([compiler, *COMMON_FLAGS, *flags, *map(str, SOURCES), "-o", str(temporary)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed building the {variant} engine:\n{result.stderr[-2000:]}")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def _load(variant: str) -> ctypes.CDLL:
    if variant not in _loaded:
        library = ctypes.CDLL(str(_build(variant)))
        library.dc_select.restype = ctypes.c_int
        library.dc_select.argtypes = [
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double,
        ]
        library.dc_quantize.restype = None
        library.dc_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        library.dc_plan.restype = ctypes.c_int64
        library.dc_plan.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int] + \
            [ctypes.c_void_p] * 4
        library.dc_release_scratch.restype = None
        library.dc_last_threads.restype = ctypes.c_int
        library.dc_note_fork.restype = None
        if _forked_child or _multiprocessing_child():  # the OpenMP threads here may be a parent's (engine "Threads")
            library.dc_note_fork()
        _loaded[variant] = library
    return _loaded[variant]


def supported_variants() -> list[str]:
    """Variants this CPU can run, best last (builds the scalar variant to ask the CPU). Raises `RuntimeError` when
    the engine cannot be built."""
    with _lock:
        features = _load("scalar").dc_cpu_features() if _is_x86() else 0
    return [name for name, (_, bit) in VARIANTS.items() if bit == 0 or features & bit == bit]


def choice() -> str:
    """`DUAL_CACHE_ENGINE`, validated (`ValueError` naming the valid values)."""
    value = os.environ.get("DUAL_CACHE_ENGINE", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"DUAL_CACHE_ENGINE must be one of {CHOICES}, got {value!r}.")
    return value


def library(variant: str | None = None) -> ctypes.CDLL | None:
    """The engine library to call, or None when the pure-torch reference must run instead.

    `variant` None follows `DUAL_CACHE_ENGINE`. With `auto`, the best variant that builds and loads
    (`_best_loadable`); when none does, one warning naming the cause and None. A variant named explicitly that
    cannot run raises `RuntimeError`.
    """
    global _warned
    wanted = variant or choice()
    if wanted == "reference":
        return None
    if wanted in _resolved:  # called per layer per step: resolve each choice once
        return _resolved[wanted]
    if wanted == "auto":
        if _failure is None:
            lib = _best_loadable()
            if lib is not None:
                _resolved["auto"] = lib
                return lib
        if not _warned:
            _warned = True
            warnings.warn(f"dual-cache: the native selection engine is unavailable ({_failure}); host selection "
                          "runs the pure-torch reference (same selections, slower). Install g++ to build it.",
                          RuntimeWarning, stacklevel=3)
        return None
    if wanted not in supported_variants():
        raise RuntimeError(f"DUAL_CACHE_ENGINE={wanted!r}: this CPU cannot run it (it runs {supported_variants()}).")
    with _lock:
        _resolved[wanted] = _load(wanted)
    return _resolved[wanted]


def _best_loadable() -> ctypes.CDLL | None:
    """The best variant this CPU runs that builds and loads; a better one that fails is skipped with one warning
    naming it (so a compiler without, say, AVX-512 support still gives the AVX2 engine). None, with `_failure` set,
    when no variant loads."""
    global _failure
    failed = []
    try:
        candidates = supported_variants()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _failure = str(error)
        return None
    for name in reversed(candidates):
        try:
            with _lock:
                lib = _load(name)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            failed.append(f"{name}: {error}")
            continue
        if failed:
            warnings.warn(f"dual-cache: the native engine's better variants could not be built ({'; '.join(failed)}); "
                          f"host selection runs the {name} variant (same selections, slower).", RuntimeWarning,
                          stacklevel=4)
        return lib
    _failure = "; ".join(failed)
    return None


def active_variant() -> str:
    """The name of what host selection runs now: a variant, or `reference`."""
    lib = library()
    return "reference" if lib is None else next(name for name, loaded in _loaded.items() if loaded is lib)


def main(argv: list[str] | None = None) -> int:
    """Build every variant this CPU runs and print which one is used (`python -m dual_cache.engine`)."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m dual_cache.engine",
        description="Build every variant of the native selection engine this CPU can run (scalar, avx2, avx512), "
                    "report each build, and say which variant DUAL_CACHE_ENGINE (default auto: the best that "
                    "builds) selects. Builds are cached under ~/.cache/dual-cache/engine (DUAL_CACHE_ENGINE_DIR).",
    ).parse_args(argv)
    try:
        variants = supported_variants()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        print(f"native selection engine not built ({error}); the pure-torch reference will run", file=sys.stderr)
        return 0
    built = []
    for name in variants:
        try:
            _build(name)
            built.append(name)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            print(f"the {name} variant of the native selection engine was not built ({error})", file=sys.stderr)
    print(f"native selection engine built in {build_dir()}: variants {built}, using {built[-1]}")
    return 0
