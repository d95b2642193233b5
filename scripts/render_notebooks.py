"""Execute the notebooks and store their outputs in the committed .ipynb files (`make notebooks-outputs`).

Each notebook's source is its jupytext `.py`. This script reads it, executes it
top to bottom in a fresh kernel (this .venv's `python3`), and writes the
`.ipynb` with every cell's outputs, the registered `stagewise` kernelspec, and
a `stagewise` metadata block:

    source_sha256   sha256 of the .py it was made from (tests/test_notebooks.py compares it
                    with the .py, without executing anything)
    mode            "quick" (STAGEWISE_NOTEBOOK_QUICK=1: the smaller workloads) or "full"

Timings on a page must be the machine's, not the contention's. A code cell that prints or draws
a timing carries the tag `timing` in its jupytext header (`# %% tags=["timing"]`). While each
timing cell runs, the load probe (`stagewise/tuning/cpu_load.py`) measures the share of the
machine that processes other than the notebook's kernel (and its children) used (a cell too
short to tell counts with the whole run's share); when any timing cell ran above the probe's
limit (`STAGEWISE_BUSY_SHARE`, 25% by default) the notebook is not written, and the script says
so and exits non-zero. `--allow-load` writes it anyway (to keep a changed notebook's outputs
paired with its source; its timings then need a quiet rerun). Every render is recorded in
`notebooks/render_log.json`, outside the student's page: when, which mode, the worst timing
cell's load share, the whole run's, and whether the limit was bypassed.

Usage: python scripts/render_notebooks.py [--quick] [--stale] [--jobs N] [--allow-load] [NAME ...]
(default: every notebook). --stale executes only the notebooks whose .ipynb was not made from
their current .py. With --jobs above 1 the notebooks count as each other's other processes.
"""

import argparse
import copy
import datetime
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stagewise.tuning.cpu_load import LoadProbe, busy_share

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
RENDER_LOG = NOTEBOOKS / "render_log.json"
KERNELSPEC = {"name": "stagewise", "display_name": "Python (stagewise)", "language": "python"}
TIMING_TAG = "timing"  # cell tag of a code cell whose output is a timing


def source_hash(py: Path) -> str:
    """The hash tests/test_notebooks.py recomputes: sha256 of the .py's bytes."""
    return hashlib.sha256(py.read_bytes()).hexdigest()


def is_stale(name: str) -> bool:
    """True when notebooks/<name>.ipynb is missing or its stored source hash is not the .py's."""
    import nbformat

    ipynb = NOTEBOOKS / f"{name}.ipynb"
    if not ipynb.is_file():
        return True
    stored = nbformat.read(ipynb, as_version=4).metadata.get("stagewise", {}).get("source_sha256")
    return stored != source_hash(NOTEBOOKS / f"{name}.py")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid`, its children that have exited, and its live descendants (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state ppid ...
        except OSError:
            continue  # gone meanwhile
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        fields = stats.get(p)
        if fields is None:
            continue
        utime, stime, cutime, cstime = (int(v) for v in fields[11:15])  # stat fields 14-17
        total += utime + stime + cutime + cstime
        todo += children.get(p, [])
    return total / ticks


class LoadMeter:
    """nbclient hooks: the load share of other processes while each timing cell, and the whole run, executes."""

    def __init__(self, client):
        self.client, self.cells, self.pid = client, [], None
        self.run, self.run_share, self.probe = None, None, None

    def own(self) -> float:
        """The kernel's process tree and this process: everything else on the machine is "others"."""
        kernel = tree_cpu_seconds(self.pid) if self.pid and Path("/proc").is_dir() else 0.0
        return time.process_time() + kernel

    def start(self, **_) -> None:
        self.pid = getattr(self.client.km.provisioner, "pid", None)  # the kernel's process
        self.run = LoadProbe(own=self.own).__enter__()

    def cell_start(self, cell, cell_index, **_) -> None:
        if TIMING_TAG in cell.get("metadata", {}).get("tags", []):
            self.probe = LoadProbe(own=self.own).__enter__()

    def cell_done(self, cell, cell_index, **_) -> None:
        if self.probe is not None:
            self.probe.__exit__(None, None, None)
            share = None if self.probe.others is None else round(self.probe.others, 3)
            self.cells.append({"cell": cell_index, "others_share": share})
            self.probe = None
        so_far = copy.copy(self.run)  # the run up to this cell (the kernel is gone before the run ends)
        so_far.__exit__(None, None, None)
        self.run_share = None if so_far.others is None else round(so_far.others, 3)

    def report(self) -> dict:
        # a timing cell too short for the probe (None) counts with the whole run's share
        shares = [self.run_share if c["others_share"] is None else c["others_share"] for c in self.cells]
        known = [share for share in shares if share is not None]
        return {
            "timing_cells": self.cells,
            "others_share_timing": max(known) if known else None,  # the worst timing cell
            "others_share_run": self.run_share,
        }


def render(name: str, quick: bool, allow_load: bool) -> dict:
    """Execute notebooks/<name>.py; write notebooks/<name>.ipynb unless a timing cell ran contended.

    -> the render's log entry ("written": whether the .ipynb was written).
    """
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    text = (NOTEBOOKS / f"{name}.py").read_bytes()  # hashed and executed: the same bytes, even if the file changes
    nb = jupytext.reads(text.decode(), fmt="py:percent")
    os.environ["STAGEWISE_NOTEBOOK_QUICK"] = "1" if quick else "0"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    meter = LoadMeter(client)
    client.on_notebook_start = meter.start
    client.on_cell_execute, client.on_cell_executed = meter.cell_start, meter.cell_done  # sent; its reply came
    start = time.perf_counter()
    client.execute()
    entry = {
        "rendered_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "seconds": round(time.perf_counter() - start, 1),
        **meter.report(),
        "limit": busy_share(),
        "load_check_bypassed": False,
    }
    share = entry["others_share_timing"]
    if share is not None and share > busy_share():
        if not allow_load:
            return {**entry, "written": False}
        entry["load_check_bypassed"] = True
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["stagewise"] = {"source_sha256": hashlib.sha256(text).hexdigest(), "mode": entry["mode"]}
    nbformat.write(nb, NOTEBOOKS / f"{name}.ipynb")
    return {**entry, "written": True}


def record(entries: dict) -> None:
    """Merge the written notebooks' entries into notebooks/render_log.json (one entry per notebook)."""
    log = json.loads(RENDER_LOG.read_text()) if RENDER_LOG.is_file() else {}
    log.update({name: {k: v for k, v in e.items() if k != "written"} for name, e in entries.items() if e["written"]})
    RENDER_LOG.write_text(json.dumps(dict(sorted(log.items())), indent=1) + "\n")


def _share(value) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names such as 00_pipeline (default: all)")
    parser.add_argument("--quick", action="store_true", help="STAGEWISE_NOTEBOOK_QUICK=1: the smaller workloads")
    parser.add_argument("--stale", action="store_true", help="only notebooks whose outputs are not from their .py")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at once (default 1)")
    parser.add_argument(
        "--allow-load", action="store_true", help="write a notebook whose timing cells ran on a busy machine (logged)"
    )
    args = parser.parse_args(argv)
    names = args.names or sorted(p.stem for p in NOTEBOOKS.glob("[0-9]*.py"))
    missing = [n for n in names if not (NOTEBOOKS / f"{n}.py").is_file()]
    if missing:
        print(f"render_notebooks: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"render_notebooks: --jobs must be at least 1, not {args.jobs}", file=sys.stderr)
        return 2
    if args.stale:
        names = [n for n in names if is_stale(n)]
        print(f"stale: {' '.join(names) or 'none'}", flush=True)
    failed, entries = [], {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {name: pool.submit(render, name, args.quick, args.allow_load) for name in names}
        for name, future in futures.items():
            try:
                entry = future.result()
            except Exception as err:  # a failing cell: name it, go on with the others
                failed.append(name)
                print(f"{name}: FAILED, .ipynb left as it was: {str(err).strip().splitlines()[-1]}", flush=True)
                continue
            entries[name] = entry
            load = f"others used {_share(entry['others_share_timing'])} of the CPU in its timing cells"
            if not entry["timing_cells"]:
                load = f"no timing cells (others used {_share(entry['others_share_run'])} of the CPU over the run)"
            if not entry["written"]:
                failed.append(name)
                print(
                    f"{name}: NOT written, {load} (limit {entry['limit']:.0%}): rerun on a quieter machine", flush=True
                )
                continue
            bypass = " (over the limit: --allow-load)" if entry["load_check_bypassed"] else ""
            print(f"{name}: executed in {entry['seconds']:.0f} s ({entry['mode']} mode), {load}{bypass}", flush=True)
    record(entries)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
