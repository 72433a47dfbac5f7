"""Session 41's packed-linear kernels (csrc/ at bf8d416) with the knobs session 42 measured, built as side extensions.

The sources are read from git at bf8d416 and patched here, so what a variant differs in is the list below:
  bf16 (torch.ops.s42): set_rows(R), the most rows sharing a pass over a group (8 then); set_dist(D, H), a software
       prefetch D 64-byte lines ahead with hint H = 0/1/2 (T0/T1/T2), D = 0 none (as then).
  int8 (torch.ops.s42i): set_dist(D), the same prefetch with hint T0.
Not part of the engine; for linear_prefetch.py and int8_prefetch.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "specactor_engine" / "kernels" / "csrc"
BASE = "bf8d416"  # session 41's kernels

_PREFETCH = "_mm_prefetch(reinterpret_cast<const char*>(w + 2 * {i} + dist), {hint}); " \
            "_mm_prefetch(reinterpret_cast<const char*>(w + 2 * {i} + 1 + dist), {hint});"

BF16 = [
    ("constexpr int ROWS_PER_TILE = 8;", "constexpr int ROWS_PER_TILE = 14;\nint64_t MAX_ROWS = 8, DIST = 0, HINT = 0;"),
    ("tile<5>, tile<6>, tile<7>, tile<8>};",
     "tile<5>, tile<6>, tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>, tile<13>, tile<14>};"),
    ("  for (int64_t p = 0; p < P; ++p) {\n    const __m512bh w0",
     "  const int64_t dist = DIST, hint = HINT;\n  for (int64_t p = 0; p < P; ++p) {\n"
     "    if (dist > 0 && hint == 0) { " + _PREFETCH.format(i="p", hint="_MM_HINT_T0") + " }\n"
     "    if (dist > 0 && hint == 1) { " + _PREFETCH.format(i="p", hint="_MM_HINT_T1") + " }\n"
     "    if (dist > 0 && hint == 2) { " + _PREFETCH.format(i="p", hint="_MM_HINT_T2") + " }\n"
     "    const __m512bh w0"),
    ("const int64_t tiles = (M + ROWS_PER_TILE - 1) / ROWS_PER_TILE;", "const int64_t tiles = (M + MAX_ROWS - 1) / MAX_ROWS;"),
    ("bool bf16_linear_supported() {", "int64_t set_rows(int64_t r) { MAX_ROWS = r; return r; }\n"
     "int64_t set_dist(int64_t d, int64_t h) { DIST = d; HINT = h; return d; }\nbool bf16_linear_supported() {"),
    ('m.def("bf16_linear_supported() -> bool", &bf16_linear_supported);',
     'm.def("bf16_linear_supported() -> bool", &bf16_linear_supported);\n  m.def("set_rows(int r) -> int", &set_rows);\n'
     '  m.def("set_dist(int d, int h) -> int", &set_dist);'),
    ("TORCH_LIBRARY_FRAGMENT(specactor, m)", "TORCH_LIBRARY_FRAGMENT(s42, m)"),
    ("TORCH_LIBRARY_IMPL(specactor, CPU, m)", "TORCH_LIBRARY_IMPL(s42, CPU, m)"),
]

INT8 = [
    ("constexpr int ROWS_PER_TILE = 8;", "constexpr int ROWS_PER_TILE = 8;\nint64_t DIST = 0;"),
    ("  for (int64_t q = 0; q < Q; ++q) {\n    const __m512i w0",
     "  const int64_t dist = DIST;\n  for (int64_t q = 0; q < Q; ++q) {\n"
     "    if (dist > 0) { " + _PREFETCH.format(i="q", hint="_MM_HINT_T0") + " }\n    const __m512i w0"),
    ("TORCH_LIBRARY_FRAGMENT(specactor, m) {", "int64_t set_dist(int64_t d) { DIST = d; return d; }\n"
     'TORCH_LIBRARY_FRAGMENT(s42i, m) {\n  m.def("set_dist(int d) -> int", &set_dist);'),
    ("TORCH_LIBRARY_IMPL(specactor, CPU, m)", "TORCH_LIBRARY_IMPL(s42i, CPU, m)"),
]


def build(kernel: str) -> None:
    """Build and load the variant of `kernel` ("bf16" or "int8") into torch.ops.s42 / torch.ops.s42i."""
    name, patches = {"bf16": ("s42", BF16), "int8": ("s42i", INT8)}[kernel]
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASE}:specactor_engine/kernels/csrc/{kernel}_linear.cpp"],
                            check=True, capture_output=True, text=True).stdout
    for old, new in patches:
        assert source.count(old) == 1, f"{kernel}: the patch site {old!r} is not in {BASE}'s source once"
        source = source.replace(old, new)
    directory = Path(f"/tmp/specactor-bench-{name}")
    directory.mkdir(exist_ok=True)
    path = directory / f"{kernel}_linear_variant.cpp"
    path.write_text(source)
    load(name=name, sources=[str(path)], build_directory=str(directory), is_python_module=False, verbose=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", f"-I{CSRC}"],
         extra_ldflags=["-fopenmp"])
