#!/usr/bin/env python3
"""Build LMCache 0.5.6's CUDA ops (``lmcache.cuda_ops``) from its source archive, against this node's torch.

LMCache's wheel carries a ``cuda_ops`` compiled against another torch. On the GPU image's torch 2.11 it
does not load (``undefined symbol: _ZN3c1019NotImplementedError...``), and LMCache then moves KV between
its L1 and the GPU with plain torch ops ("CudaDeviceOps stays on the torch baseline for all ops"). This
compiles the same sources (the list of LMCache 0.5.6's ``setup_extensions/build_profiles/cuda.py``) with
``torch.utils.cpp_extension`` (nvcc, ninja) and puts the module into the installed ``lmcache`` package.

  python3 build_lmcache_cuda_ops.py --sdist lmcache-0.5.6.tar.gz [--site /tmp/site4] [--arch 9.0] [--jobs N]

The module goes into the ``lmcache`` package that imports with SITE first on the path. Exit status 0 once
``import lmcache.cuda_ops`` works; 2 with the reason when it cannot be built (not the expected archive, no
lmcache, no nvcc, no CUDA torch).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

SOURCES = ["pybind.cpp", "mem_kernels.cu", "mp_mem_kernels.cu", "phase_timing_recorder.cu", "blend_kernels.cu",
           "cal_cdf.cu", "ac_enc.cu", "ac_dec.cu", "pos_kernels.cu", "mem_alloc.cpp", "utils.cpp",
           "event_recorder.cpp", "completion_recorder.cpp"]


def fail(msg: str) -> int:
    print(f"build_lmcache_cuda_ops: {msg}", file=sys.stderr)
    return 2


def archive_sources(sdist: Path) -> tuple[list[tarfile.TarInfo], str]:
    """The archive's csrc/ files, or why it is not the LMCache source archive this build expects."""
    with tarfile.open(sdist) as t:
        members = [m for m in t.getmembers() if "/csrc/" in m.name and m.isfile()]
    names = {m.name.split("/csrc/", 1)[1] for m in members}
    if not members:
        return [], f"--sdist {sdist}: no csrc/ folder in it (not LMCache's source archive?)"
    missing = [s for s in SOURCES if f"cuda/{s}" not in names]
    if missing:
        return [], f"--sdist {sdist}: csrc/cuda lacks {', '.join(missing)} (another LMCache version?)"
    return members, ""


def lmcache_dir(site: Path | None) -> Path | None:
    """The folder of the lmcache package that imports with SITE first on the path."""
    if site is not None:
        sys.path.insert(0, str(site))
    spec = importlib.util.find_spec("lmcache")
    return Path(spec.origin).parent if spec and spec.origin else None


def loads(site: Path | None) -> tuple[bool, str]:
    """Whether ``import lmcache.cuda_ops`` works with SITE first on the path (in a fresh interpreter)."""
    env = {**os.environ, "PYTHONPATH": f"{site or ''}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", "import torch, lmcache.cuda_ops as c; print(c.__file__)"],
                       env=env, capture_output=True, text=True, timeout=300)
    out = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode == 0, out[-1] if out else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdist", required=True, type=Path, help="LMCache's source archive (lmcache-X.Y.Z.tar.gz)")
    p.add_argument("--site", type=Path, help="put this folder first on the path (where the node's lmcache is)")
    p.add_argument("--arch", default="", help="TORCH_CUDA_ARCH_LIST (default: this node's GPU, e.g. 9.0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="parallel compiles (ninja)")
    a = p.parse_args(argv)
    if not a.sdist.is_file():
        return fail(f"--sdist {a.sdist}: no such file")
    members, why = archive_sources(a.sdist)
    if why:
        return fail(why)
    package = lmcache_dir(a.site)
    if package is None:
        return fail(f"lmcache is not importable{f' from --site {a.site}' if a.site else ''}")
    if shutil.which("nvcc") is None:
        return fail("nvcc not found on PATH: LMCache's CUDA ops need the CUDA compiler")
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        return fail(f"torch is not importable: {e}")
    if not torch.cuda.is_available():
        return fail(f"torch {torch.__version__} sees no CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = a.arch or f"{major}.{minor}"
    os.environ["MAX_JOBS"] = str(a.jobs)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="lmcache-cuda-ops-") as tmp:
        with tarfile.open(a.sdist) as t:
            t.extractall(tmp, members=members, filter="data")
        csrc = next(Path(tmp).glob("*/csrc"))
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        build = Path(tmp) / "build"
        build.mkdir()
        print(f"building lmcache.cuda_ops for sm_{os.environ['TORCH_CUDA_ARCH_LIST']} against torch "
              f"{torch.__version__} ({len(SOURCES)} sources, {a.jobs} jobs)", flush=True)
        module = cpp_extension.load("cuda_ops", [str(csrc / "cuda" / s) for s in SOURCES],
                                    extra_include_paths=[str(csrc)], extra_cflags=["-O3", abi],
                                    extra_cuda_cflags=["-O3", abi], build_directory=str(build),
                                    verbose=False)
        dest = package / f"cuda_ops{sysconfig.get_config_var('EXT_SUFFIX')}"
        shutil.copy2(module.__file__, dest)
    ok, where = loads(a.site)
    if not ok:
        return fail(f"built {dest}, but it does not load: {where}")
    print(f"lmcache.cuda_ops built in {time.time() - t0:.0f}s and loads: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
