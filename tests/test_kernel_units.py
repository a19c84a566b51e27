"""SpecUI's kernel files compile three to a unit (specui/weights/kernels/units_*.cpp, native.py):
two files in one unit must not define the same file-local name on any CPU, and which names a
file defines depends on the instruction set (its AVX2, AVX-512 and AMX branches). Each unit is
checked for AVX2 alone and for AVX-512 with AMX, whatever CPU runs the test (syntax only: no code
is generated for the other machine)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp

from specui.weights.native import HEADERS, KERNELS, SOURCES

UNITS = [source for source in SOURCES if source.name.startswith("units_")]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_every_kernel_file_is_in_one_unit_and_no_unit_clashes_on_any_instruction_set():
    included = [line.split('"')[1] for unit in UNITS for line in unit.read_text().splitlines()
                if line.startswith("#include")]
    kernel_files = sorted(path.name for path in KERNELS.glob("*.cpp")
                          if path.name != "module.cpp" and not path.name.startswith("units_"))
    assert sorted(included) == kernel_files  # each once, none left out
    assert {KERNELS / name for name in kernel_files} <= set(HEADERS)  # an edit to any of them rebuilds
    flags = ["-std=c++20", "-O0", "-fopenmp", "-fsyntax-only", *(f"-isystem{path}" for path in cpp.include_paths()),
             f"-isystem{sysconfig.get_paths()['include']}"]
    checks = [subprocess.Popen(["c++", f"-march={arch}", *flags, str(unit)], stderr=subprocess.PIPE, text=True)
              for arch in ("x86-64-v3", "sapphirerapids") for unit in UNITS]
    said = [(check.args[1], Path(check.args[-1]).name, check.communicate()[1][-600:]) for check in checks]
    unknown = ("bad value", "unknown target CPU")  # an older compiler that does not know the -march name
    assert [what for what, check in zip(said, checks)
            if check.returncode != 0 and not any(word in what[2] for word in unknown)] == []
