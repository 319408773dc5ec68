"""A per-tensor snapshot of every verdict, to prove a refactor changed no number.

For each shipped recipe (clean, one seed) and each zoo bug of ``margins.BUGS``, in the dtypes
asked for, this runs what ``margins.py`` runs (reference, candidate, the perturbation run where the
recipe asks for it, the iteration-1 replay) and writes, per run, every judged tensor's key, error,
tolerance, tolerance source and reason, plus the replay's culprits. Two snapshots taken at two
commits are then compared with ``--diff``: any tensor whose numbers differ is printed.

    python benchmarks/snapshot.py --out before.json [--dtypes fp32 bf16 fp8] [--recipes ...]
    python benchmarks/snapshot.py --diff before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import margins  # noqa: E402


def _results(comparison) -> list:
    return [[str(r.key), r.verdict, repr(r.error), repr(r.tolerance_eps), r.tolerance_source, r.reason]
            for r in comparison.results]


def take(args) -> None:
    warnings.filterwarnings("ignore")

    def run(r, inject=()):
        """What margins.py runs for one row (seed 1): the comparison as the recipe ships and the
        iteration-1 replay."""
        with tempfile.TemporaryDirectory() as tmp:
            c, loc, _ = margins.pair(r, tmp, inject)
            return {"verdict": c.verdict, "results": _results(c),
                    "missing": [str(k) for k in c.missing_in_candidate + c.missing_in_reference],
                    "skipped": [str(k) for k in c.skipped],
                    "replay": _results(loc.comparison),
                    "culprits": [[str(x.key), repr(x.error), x.reason] for x in loc.culprits]}

    recipe = margins.recipe
    wanted = (lambda n: n in args.recipes) if args.recipes else (lambda n: True)
    snapshot = {}
    if not args.bugs_only:
        for name in filter(wanted, margins.CLEAN):
            for dtype in args.dtypes:
                label = f"clean {name} {dtype}"
                print(label, flush=True)
                snapshot[label] = run(recipe(name, dtype, 1))
    for name, bug, _, _, *dtypes in (b for b in margins.BUGS if wanted(b[0])):
        for dtype in (d for d in (dtypes[0] if dtypes else margins.BUG_DTYPES) if d in args.dtypes):
            label = f"bug {name} {dtype} {bug}"
            print(label, flush=True)
            snapshot[label] = run(recipe(name, dtype, 1), [bug])
    with open(args.out, "w") as f:
        json.dump(snapshot, f, indent=0)


ULP_RELATIVE = 1e-12  # two computations of one error that differ only in the last bits (sqrt(x²) vs x)


def _same_number(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    if x == y or (x != x and y != y):
        return True
    return abs(x - y) <= ULP_RELATIVE * max(abs(x), abs(y))


def diff(before_path: str, after_path: str) -> int:
    """Print every run whose verdicts differ. Errors and tolerances that differ by no more than
    ``ULP_RELATIVE`` (relative) count as the same number and are counted apart."""
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    differing = last_bits = exact = 0
    for label in sorted(set(before) | set(after)):
        a, b = before.get(label), after.get(label)
        if a is None or b is None:
            differing += 1
            print(f"DIFFERS: {label}: only in", before_path if b is None else after_path)
            continue
        lines = [f"   {part}: {a[part]!r} -> {b[part]!r}" for part in ("verdict", "missing", "skipped")
                 if a[part] != b[part]]
        ca = [(row[0], row[2]) for row in a["culprits"]]
        cb = [(row[0], row[2]) for row in b["culprits"]]
        if [k for k, _ in ca] != [k for k, _ in cb]:
            lines.append(f"   culprits: {ca} -> {cb}")
        for part in ("results", "replay"):
            ra = {row[0]: row[1:] for row in a[part]}
            rb = {row[0]: row[1:] for row in b[part]}
            for key in sorted(set(ra) | set(rb)):
                x, y = ra.get(key), rb.get(key)
                if x == y:
                    exact += 1
                elif (x is not None and y is not None and x[0] == y[0] and x[3:] == y[3:]
                      and _same_number(x[1], y[1]) and _same_number(x[2], y[2])):
                    last_bits += 1
                else:
                    lines.append(f"   {part} {key}: {x} -> {y}")
        if lines:
            differing += 1
            print(f"DIFFERS: {label}")
            print("\n".join(lines))
    print(f"{len(set(before) | set(after))} runs, {differing} differ; per tensor: {exact} identical, "
          f"{last_bits} equal to {ULP_RELATIVE:g} relative (last bits)")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the snapshot here")
    parser.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two snapshots")
    parser.add_argument("--recipes", nargs="*")
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16", "fp8"])
    parser.add_argument("--bugs-only", action="store_true")
    args = parser.parse_args()
    if args.diff:
        return diff(*args.diff)
    if not args.out:
        parser.error("--out or --diff")
    take(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
