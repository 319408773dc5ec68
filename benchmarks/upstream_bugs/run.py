"""Real Megatron-LM bugs, re-created in megatron-core, judged against their clean build.

Each entry (``entries/<name>/``) is an upstream change that fixed a silent numerical bug:
``entry.yaml`` (the fix's commit, what the bug did, the recipe that triggers it, the module and
phase a correct localization names) and ``bug.patch``, the few lines the fix changed, as a diff
against the installed megatron-core:

* ``kind: reverted`` — the fix is in the installed release; the patch takes it out again. The
  buggy build is an overlay copy with the patch applied, the clean build the installed package.
* ``kind: live`` — the bug is still in the installed release; the patch is the upstream fix. The
  buggy build is the installed package, the clean build the overlay. A live bug upstream has not
  fixed (found by ttrace) has ``commit: unfixed``, its ``url`` points at the code, and its patch is
  ttrace's proposed fix.

The installed files are never edited: an overlay is a copy of the installed ``megatron`` package
with the patch applied, run through ``--candidate-megatron``/``--reference-megatron``
(``adapter/run/side.py``). The reference is always the clean build on one rank. An entry counts as
**detected** only if the same recipe's candidate on the clean build passes and on the buggy build
fails, and as **localized** only if the replay's culprit is the module and phase the fix changed.

    python benchmarks/upstream_bugs/run.py [--only NAME ...] [--dtype fp32|bf16] > table.md
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
ENTRIES = os.path.join(HERE, "entries")
REVERTED, LIVE = "reverted", "live"
UNFIXED = "unfixed"  # the commit of a live bug upstream has no fix for
# the megatron-core release every bug.patch is written against (a patch re-creates its bug, or its
# fix, in that release's code; another release is another set of patches)
PATCHED_RELEASE = "0.16.1"


def installed_release() -> str:
    import megatron.core

    return str(megatron.core.__version__)


def check_release() -> None:
    if installed_release() != PATCHED_RELEASE:
        raise RuntimeError(f"the entries' patches are written against megatron-core {PATCHED_RELEASE}; "
                           f"{installed_release()} is installed")


@dataclasses.dataclass
class Entry:
    name: str
    kind: str  # REVERTED or LIVE
    commit: str  # the upstream fix
    title: str
    bug_class: str
    description: str
    recipe: str  # a shipped recipe
    overrides: Dict[str, Any]  # per section: fields to change in it
    modules: List[str]  # where a correct localization points: globs (any layer's copy of the module)
    phase: str
    patch: str  # path of bug.patch
    url: str = ""
    notes: str = ""


def load_entries(root: str = ENTRIES) -> List[Entry]:
    import yaml

    entries = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "entry.yaml")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            raw = yaml.safe_load(f)
        trigger, expected = raw["trigger"], raw["expected"]
        if raw["kind"] not in (REVERTED, LIVE):
            raise ValueError(f"{path}: kind must be {REVERTED} or {LIVE}, not {raw['kind']!r}")
        if str(raw["commit"]) == UNFIXED and (raw["kind"] != LIVE or not raw.get("url")):
            raise ValueError(f"{path}: an {UNFIXED} bug is live and needs a url to the code")
        entries.append(Entry(name=name, kind=raw["kind"], commit=str(raw["commit"]), title=raw["title"],
                             bug_class=raw["class"], description=raw["description"].strip(),
                             recipe=trigger["recipe"], overrides=trigger.get("overrides") or {},
                             modules=_globs(expected["module"]), phase=expected["phase"],
                             patch=os.path.join(root, name, "bug.patch"), url=raw.get("url", ""),
                             notes=(raw.get("notes") or "").strip()))
    return entries


def _globs(module) -> List[str]:
    """``expected.module``: one glob, or a list of them where the fix changed several modules."""
    return [module] if isinstance(module, str) else list(module)


def installed_tree() -> str:
    """The directory holding the installed ``megatron`` package."""
    import megatron.core

    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))))


def overlay(entry: Entry, dest: str) -> str:
    """A copy of the installed megatron-core with the entry's patch applied (``git apply``, which
    needs no repository); returns the tree to put first on PYTHONPATH."""
    shutil.copytree(os.path.join(installed_tree(), "megatron"), os.path.join(dest, "megatron"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(["git", "apply", "-p1", "--whitespace=nowarn", entry.patch], cwd=dest,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{entry.patch} does not apply to the installed megatron-core: {done.stderr.strip()}")
    return dest


def changed_files(entry: Entry) -> List[str]:
    """The files the entry's patch edits, relative to the tree (``megatron/core/...``)."""
    with open(entry.patch) as f:
        return sorted({line[len("+++ b/"):].split("\t")[0].strip() for line in f if line.startswith("+++ b/")})


def builds(entry: Entry, tmp: str) -> Dict[str, Optional[str]]:
    """The clean and the buggy build's trees (None: the installed package)."""
    patched = overlay(entry, os.path.join(tmp, "overlay"))
    return {"clean": None, "buggy": patched} if entry.kind == REVERTED else {"clean": patched, "buggy": None}


def recipe_of(entry: Entry, dtype: str, wide: bool = False):
    """The entry's recipe in ``dtype``; ``wide``: widened first as the zoo's are (``margins.widen``:
    8 layers, hidden 512, vocabulary 32k), the entry's overrides applied after."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    path = os.path.join(REPO, "recipes", entry.recipe + ".yaml")
    with open(path) as f:
        raw = yaml.safe_load(f)
    if wide:
        sys.path.insert(0, os.path.join(REPO, "benchmarks"))
        from margins import widen

        raw = widen(raw)
    for section, fields in entry.overrides.items():
        raw[section] = {**(raw.get(section) or {}), **fields} if isinstance(fields, dict) else fields
    raw.update(name=f"upstream-{entry.name}", dtype=dtype)
    return recipe_from_dict(raw, source=os.path.join(ENTRIES, entry.name, "entry.yaml"))


@dataclasses.dataclass
class Outcome:
    clean_verdict: str
    clean_worst: str  # the clean candidate's worst ratio and tensor
    buggy_verdict: str
    first_mismatch: str
    ratio: float  # the first mismatch's error / tolerance
    culprit: str
    detected: bool
    localized: bool
    error: str = ""


def judge(entry: Entry, tmp: str, dtype: str = "fp32", wide: bool = False, twin_seed: Optional[str] = None) -> Outcome:
    """Reference (clean build, 1 rank); candidate on the clean build (must pass) and on the buggy
    build (must fail); the replay of the buggy candidate at its first mismatch's iteration.
    ``twin_seed``: judge the recipe's fp32 twin instead (``recipe.fp32_twin``, as ``ttrace run``
    does), from this seed checkpoint (the low-precision check's)."""
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.compare import compare_traces, localize, phase_label
    from ttrace_megatron.recipe import fp32_twin

    check_release()
    r = recipe_of(entry, dtype, wide)
    if twin_seed:
        r = fp32_twin(r)
    trees = builds(entry, tmp)
    seed = twin_seed or os.path.join(tmp, "seed.safetensors")
    ref, pert = os.path.join(tmp, "ref"), os.path.join(tmp, "pert")

    def spec(role, trace_dir, tree, **trace):
        return RunSpec(recipe=r.to_json(), role=role, megatron=tree, trace=trace_options(trace_dir, seed, **trace))

    launch(spec(REFERENCE, ref, trees["clean"]))
    if r.tolerance.perturbation:
        launch(spec(REFERENCE, pert, trees["clean"], perturb=1, lockstep=ref))
    verdicts = {}
    for build in ("clean", "buggy"):
        cand = os.path.join(tmp, build)
        launch(spec(CANDIDATE, cand, trees[build], lockstep=ref))
        verdicts[build] = compare_traces(ref, cand, perturbed=pert if r.tolerance.perturbation else None)
    clean, buggy = verdicts["clean"], verdicts["buggy"]
    worst = max(clean.results, key=lambda x: x.ratio)
    fm = buggy.first_mismatch
    culprit, right = "—", False
    if fm is not None:
        replay = os.path.join(tmp, "replay")
        launch(spec(CANDIDATE, replay, trees["buggy"], replay=ref, iterations=[fm.key.iteration], lockstep=ref))
        cu = localize(ref, replay).culprit
        if cu is not None:
            culprit = f"{cu.key.module}, {phase_label(cu.key)}, {cu.key.tensor}"
            right = any(fnmatch.fnmatchcase(cu.key.module, g) for g in entry.modules) and cu.key.phase == entry.phase
    return Outcome(clean_verdict=clean.verdict, clean_worst=f"{worst.ratio:.2f} ({worst.key.module} {worst.key.phase} "
                   f"{worst.key.tensor})", buggy_verdict=buggy.verdict,
                   first_mismatch=f"{fm.key.module} {fm.key.phase} {fm.key.tensor} (iteration {fm.key.iteration})"
                   if fm else "—", ratio=fm.ratio if fm else 0.0, culprit=culprit,
                   detected=clean.verdict == "pass" and buggy.verdict == "fail", localized=right)


def main():
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="only these entries")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--wide", action="store_true", help="the recipes widened as margins.py --wide does")
    parser.add_argument("--twin", action="store_true", help="with a bf16/fp16/fp8 --dtype: also the fp32 twin of "
                        "each entry (the same recipe in fp32 from the same seed checkpoint), its columns beside")
    args = parser.parse_args()
    import megatron.core

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}; dtype {args.dtype}{'; widened (margins.WIDE)' if args.wide else ''}; machine: {os.cpu_count()} CPU cores, gloo, torch "
          f"{__import__('torch').__version__}, megatron-core {megatron.core.__version__}\n", flush=True)
    twin = args.twin and args.dtype != "fp32"
    print("| entry | upstream fix | class | kind | recipe | clean build: verdict (worst ratio) | buggy build: "
          "first mismatch | error / tolerance | detected | replay culprit | localized (expected module, phase) |"
          + (" fp32 twin: clean | twin: error / tolerance | twin: detected | twin: replay culprit | twin: localized |"
             if twin else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 5 if twin else ""), flush=True)
    outcomes = []
    for e in load_entries():
        if args.only and e.name not in args.only:
            continue
        twin_cells = ""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                o = judge(e, tmp, args.dtype, args.wide)
            except Exception as exc:  # noqa: BLE001 - a row of the table, with the error
                print(f"{e.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                o = Outcome("error", "—", "error", "—", 0.0, "—", False, False, error=(str(exc).splitlines() or [type(exc).__name__])[-1][:200])
            if twin and os.path.exists(os.path.join(tmp, "seed.safetensors")):
                tdir = os.path.join(tmp, "fp32_twin")
                os.makedirs(tdir)
                try:
                    t = judge(e, tdir, args.dtype, args.wide, twin_seed=os.path.join(tmp, "seed.safetensors"))
                    twin_cells = (f" {t.clean_verdict} {t.clean_worst} | {t.ratio:.3g} | {'yes' if t.detected else 'NO'}"
                                  f" | {t.culprit} | {'yes' if t.localized else 'NO'} |")
                except Exception as exc:  # noqa: BLE001
                    twin_cells = f" error: {(str(exc).splitlines() or [type(exc).__name__])[-1][:120]} | — | — | — | — |"
            elif twin:
                twin_cells = " — | — | — | — | — |"
        outcomes.append((e, o))
        print(f"| {e.name} | [{e.commit[:10]}]({e.url or 'https://github.com/NVIDIA/Megatron-LM/commit/' + e.commit}) "
              f"| {e.bug_class} | {e.kind} | {e.recipe} | {o.clean_verdict} {o.clean_worst} | {o.first_mismatch} | "
              f"{o.ratio:.3g} | {'yes' if o.detected else 'NO'} | {o.culprit} | "
              f"{'yes' if o.localized else 'NO'} ({' or '.join(e.modules)}, {e.phase}) |" + twin_cells
              + (f" error: {o.error}" if o.error else ""), flush=True)
    print_summary(outcomes)


def print_summary(outcomes) -> None:
    """Detected and localized out of N, per class and in all."""
    by_class: Dict[str, List[Outcome]] = {}
    for e, o in outcomes:
        by_class.setdefault(e.bug_class, []).append(o)
    print("\n| class | entries | clean build passes | detected | localized |\n|---|---|---|---|---|")
    for name, os_ in sorted(by_class.items()) + [("(all)", [o for _, o in outcomes])]:
        print(f"| {name} | {len(os_)} | {sum(o.clean_verdict == 'pass' for o in os_)} | {sum(o.detected for o in os_)} "
              f"| {sum(o.localized for o in os_)} |")


if __name__ == "__main__":
    main()
