"""The trajectory tests (pytest marker ``trajectory``: a learning threshold, a stop, a step at which
something happens) under a matrix of CPU kernel variants and seeds on one machine, with the margin
each threshold held by in each cell.

A cell is one pytest run of the selected tests only (``-m "trajectory and not slow" -n 0 -q``) in an
environment of its own; each test records its figures with tests/conftest.py's check_margin, which
land in the cell's junit XML. The table has a row per recorded figure, a column per cell (each entry
``value (bound)``, or FAIL), and a last column with the entry nearest its bound over the cells.

Cells are ``+``-joined variants (``avx2+threads2``):
  default   the machine's own kernels, one torch thread, each test's seed (42)
  avx2      ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  avx512    ATEN_CPU_CAPABILITY=avx512 (where the CPU has it)
  cbwr      MKL_CBWR=COMPATIBLE (MKL's conditional bitwise-reproducible code path)
  threadsN  N torch threads: RLHF_TEST_THREADS=N (hardware.torch_threads; the runs set their own
            thread count, so OMP_NUM_THREADS alone changes nothing) and OMP_NUM_THREADS=N
  seedN     RLHF_TEST_SEED=N (the run's seed=N)
``--seeds`` multiplies every cell by those seeds (``default`` keeps the tests' own). Cells run one
after another (the tests are single-threaded; two cells at once would share the cores).

    .venv/bin/python bench/test_matrix.py                                    # default,avx2,avx512,cbwr,threads2
    .venv/bin/python bench/test_matrix.py --cells default,avx2 --seeds default,1,2 --out matrix.md
    .venv/bin/python bench/test_matrix.py --cells avx2 -k "reward" --slow     # a subset; slow ones too
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FIXED = {"default": {}, "avx2": AVX2, "avx512": {"ATEN_CPU_CAPABILITY": "avx512"}, "cbwr": {"MKL_CBWR": "COMPATIBLE"}}
# Variables a cell sets: taken out of the inherited environment, so "default" is the machine's own.
CONTROLLED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OMP_NUM_THREADS",
              "RLHF_TEST_THREADS", "RLHF_TEST_SEED")
PROBE = ("import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), "
         "torch.backends.mkldnn.is_available())")


def cell_env(cell: str) -> dict[str, str]:
    """The variables of a ``+``-joined cell name; ValueError names an unknown variant."""
    env: dict[str, str] = {}
    for variant in cell.split("+"):
        if variant in FIXED:
            env.update(FIXED[variant])
        elif m := re.fullmatch(r"threads(\d+)", variant):
            env.update(RLHF_TEST_THREADS=m[1], OMP_NUM_THREADS=m[1])
        elif m := re.fullmatch(r"seed(\d+)", variant):
            env["RLHF_TEST_SEED"] = m[1]
        else:
            raise ValueError(f"unknown variant {variant!r} in cell {cell!r}: one of {', '.join(FIXED)}, threadsN, seedN")
    return env


def cells_of(cells: list[str], seeds: list[str]) -> list[str]:
    return [c if s == "default" else (f"seed{s}" if c == "default" else f"{c}+seed{s}") for c in cells for s in seeds]


def run_cell(cell: str, pytest_args: list[str], folder: Path) -> dict:
    """One pytest run of the selected tests in the cell's environment; its parsed junit XML."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    env.update(cell_env(cell))
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    xml = folder / f"{cell}.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", f"--junitxml={xml}",
           *pytest_args]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.time() - start
    (folder / f"{cell}.log").write_text(proc.stdout + proc.stderr)
    return {"cell": cell, "probe": probe.stdout.strip() or probe.stderr.strip()[-200:], "rc": proc.returncode,
            "seconds": seconds, "tests": parse_junit(xml) if xml.exists() else {}}


def parse_junit(xml: Path) -> dict[str, dict]:
    """{test id: {"ok": bool, "margins": {name: {value, bound, higher, strict}}}} of one junit file."""
    tests = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        test = case.get("classname", "").replace("tests.", "", 1) + "::" + case.get("name", "")
        margins = {p.get("name")[len("margin:"):]: json.loads(p.get("value"))
                   for p in case.iter("property") if p.get("name", "").startswith("margin:")}
        ok = case.find("failure") is None and case.find("error") is None
        tests[test] = {"ok": ok, "margins": margins}
    return tests


def _entry(m: dict | None, ok: bool) -> str:
    """``value (bound)``; FAIL where the figure missed its bound, a trailing * where it held but its test
    failed on another assertion."""
    if m is None:
        return "pass" if ok else "FAIL"
    op = (">" if m["strict"] else ">=") if m["higher"] else ("<" if m["strict"] else "<=")
    text = f"{m['value']:.4g} ({op}{m['bound']:.4g})"
    held = {">": m["value"] > m["bound"], ">=": m["value"] >= m["bound"], "<": m["value"] < m["bound"],
            "<=": m["value"] <= m["bound"]}[op]
    return f"FAIL {text}" if not held else text + ("" if ok else " *")


def _slack(m: dict) -> float:
    """How far a figure is from its bound, relative to the bound's scale (negative: past it)."""
    scale = max(abs(m["bound"]), 1e-9) if m["bound"] else 1.0
    return (m["value"] - m["bound"]) / scale * (1 if m["higher"] else -1)


def table(results: list[dict]) -> list[list[str]]:
    """Rows: test and figure; a column per cell; the last column the entry nearest its bound."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    names: dict[str, list[str]] = {}
    for r in results:
        for test, t in r["tests"].items():
            for name in t["margins"]:
                if name not in names.setdefault(test, []):
                    names[test].append(name)
    for r in results:
        for test in r["tests"]:
            names[test] = names.get(test) or [""]  # a test that recorded no figure in any cell: one row
    for r in results:
        for test, figures in names.items():
            t = r["tests"].get(test)
            for name in figures:
                key = (test, name)
                if t is None:
                    rows.setdefault(key, {})[r["cell"]] = "-" if r["rc"] in (0, 1) else "FAIL"
                    continue
                m = t["margins"].get(name)
                rows.setdefault(key, {})[r["cell"]] = _entry(m, t["ok"]) if (m or not name) else "FAIL"
                if m is not None and (key not in worst or _slack(m) < worst[key][0]):
                    worst[key] = (_slack(m), f"{_entry(m, t['ok'])} {r['cell']}")
    cells = [r["cell"] for r in results]
    out = [["test", "figure", *cells, "nearest its bound"]]
    for (test, name), by_cell in rows.items():
        out.append([test, name or "(none recorded)", *(by_cell.get(c, "-") for c in cells),
                    worst.get((test, name), (0, ""))[1]])
    return out


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="default,avx2,avx512,cbwr,threads2",
                        help="comma-separated cells, each a +-joined list of variants")
    parser.add_argument("--seeds", default="default", help="comma-separated seeds each cell runs with ('default': 42)")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression to narrow the tests")
    parser.add_argument("--slow", action="store_true", help="include the slow trajectory tests (make test-all's)")
    parser.add_argument("--out", type=Path, help="write the table as Markdown to this file")
    parser.add_argument("--keep", type=Path, help="keep each cell's junit XML and log in this folder")
    args = parser.parse_args()

    cells = cells_of(args.cells.split(","), args.seeds.split(","))
    for cell in cells:
        cell_env(cell)  # an unknown variant fails before any cell runs
    pytest_args = ["-m", "trajectory" if args.slow else "trajectory and not slow", *(["-k", args.keyword] if
                                                                                     args.keyword else [])]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="rlhf-test-matrix-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for cell in cells:
        r = run_cell(cell, pytest_args, folder)
        results.append(r)
        failed = sum(not t["ok"] for t in r["tests"].values())
        print(f"[matrix] {cell}: {len(r['tests'])} tests, {failed} failed, {r['seconds']:.0f} s, pytest exit {r['rc']}, "
              f"torch capability, default threads, mkldnn: {r['probe']}", flush=True)
        if r["rc"] not in (0, 1):
            print(f"[matrix] {cell}: pytest did not run the tests; see {folder / (cell + '.log')}", flush=True)
    rows = table(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if args.out:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
        head = [f"Trajectory tests by cell on {cpu}, {os.cpu_count()} cores: `{' '.join(sys.argv)}`", ""]
        head += [f"- {r['cell']}: torch capability, default threads, mkldnn {r['probe']}, {r['seconds']:.0f} s" for r in results]
        args.out.write_text("\n".join([*head, "", markdown(rows), ""]))
        print(f"[matrix] wrote {args.out}")
    if not args.keep:
        print(f"[matrix] junit XML and logs in {folder}")
    sys.exit(1 if any(not t["ok"] for r in results for t in r["tests"].values()) or
             any(r["rc"] not in (0, 1) for r in results) else 0)


if __name__ == "__main__":
    main()
