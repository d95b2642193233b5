"""Execute the notebooks and store their outputs in the committed .ipynb files (`make notebooks-outputs`).

Each notebook's source is its jupytext `.py`. This script reads it, executes it
top to bottom in a fresh kernel (this .venv's `python3`), and writes the
`.ipynb` with every cell's outputs, the registered `stagewise` kernelspec, and
a `stagewise` metadata block:

    source_sha256   sha256 of the .py it was made from (tests/test_notebooks.py compares it
                    with the .py, without executing anything)
    mode            "quick" (STAGEWISE_NOTEBOOK_QUICK=1: the smaller workloads) or "full"

Usage: python scripts/render_notebooks.py [--quick] [--stale] [--jobs N] [NAME ...]   (default: every notebook)
--stale executes only the notebooks whose .ipynb was not made from their current .py.
"""

import argparse
import hashlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNELSPEC = {"name": "stagewise", "display_name": "Python (stagewise)", "language": "python"}


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


def render(name: str, quick: bool) -> tuple[str, float]:
    """Execute notebooks/<name>.py, write notebooks/<name>.ipynb with its outputs; (name, seconds)."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    text = (NOTEBOOKS / f"{name}.py").read_bytes()  # hashed and executed: the same bytes, even if the file changes
    nb = jupytext.reads(text.decode(), fmt="py:percent")
    os.environ["STAGEWISE_NOTEBOOK_QUICK"] = "1" if quick else "0"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    start = time.perf_counter()
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    seconds = time.perf_counter() - start
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["stagewise"] = {"source_sha256": hashlib.sha256(text).hexdigest(), "mode": "quick" if quick else "full"}
    nbformat.write(nb, NOTEBOOKS / f"{name}.ipynb")
    return name, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names such as 00_pipeline (default: all)")
    parser.add_argument("--quick", action="store_true", help="STAGEWISE_NOTEBOOK_QUICK=1: the smaller workloads")
    parser.add_argument("--stale", action="store_true", help="only notebooks whose outputs are not from their .py")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at once (default 1)")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.stem for p in NOTEBOOKS.glob("[0-9]*.py"))
    missing = [n for n in names if not (NOTEBOOKS / f"{n}.py").is_file()]
    if missing:
        print(f"render_notebooks: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.stale:
        names = [n for n in names if is_stale(n)]
        print(f"stale: {' '.join(names) or 'none'}", flush=True)
    failed = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {name: pool.submit(render, name, args.quick) for name in names}
        for name, future in futures.items():
            try:
                _, seconds = future.result()
                print(f"{name}: executed in {seconds:.0f} s ({'quick' if args.quick else 'full'} mode)", flush=True)
            except Exception as err:  # a failing cell: name it, go on with the others
                failed.append(name)
                print(f"{name}: FAILED, .ipynb left as it was: {str(err).strip().splitlines()[-1]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
