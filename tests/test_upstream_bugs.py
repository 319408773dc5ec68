"""Real Megatron-LM bugs (benchmarks/upstream_bugs): every entry is well formed and re-creates its
bug in an overlay of the installed megatron-core; a fast slice runs end to end on every submission
(the whole table is a benchmark: BENCHMARKS.md)."""

import os
import re
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "upstream_bugs"))

import run as upstream  # noqa: E402

from ttrace_megatron import keys  # noqa: E402

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
# the patches are written against one release (run.PATCHED_RELEASE): on another, they are not run
needs_patched_release = pytest.mark.skipif(
    upstream.installed_release() != upstream.PATCHED_RELEASE,
    reason=f"the entries' patches are written against megatron-core {upstream.PATCHED_RELEASE}")
MIN_ENTRIES = 15  # issue #18: at least 15 real upstream bugs
# the slice CI runs end to end: one entry per kind of build (a fix reverted, a live bug against its fix)
CI_SLICE = ("per_token_loss_num_tokens_not_reduced_over_dp", "expert_grads_reduced_over_dense_dp_group",
            "softmax_offset_counted_on_tp_rank0_only")


def test_entries_are_well_formed():
    entries = upstream.load_entries()
    assert len(entries) >= MIN_ENTRIES, f"only {len(entries)} upstream entries"
    assert len({e.name for e in entries}) == len(entries)
    for e in entries:
        assert re.fullmatch(r"[0-9a-f]{40}", e.commit) or e.commit == upstream.UNFIXED, \
            f"{e.name}: commit {e.commit!r} is not a full sha"
        assert e.phase in keys.PHASES, f"{e.name}: phase {e.phase!r}"
        assert os.path.isfile(os.path.join(RECIPES, e.recipe + ".yaml")), f"{e.name}: no recipe {e.recipe}"
        assert e.description and e.bug_class and e.modules
        upstream.recipe_of(e, "fp32")  # the overrides make a valid recipe


@needs_patched_release
@pytest.mark.parametrize("entry", upstream.load_entries(), ids=lambda e: e.name)
def test_patch_applies_to_the_installed_megatron_core(entry):
    """The patch re-creates the bug (or the fix) in a copy; the installed files are never edited."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = upstream.overlay(entry, tmp)
        changed = upstream.changed_files(entry)
        assert changed, f"{entry.name}: the patch changes no file"
        for rel in changed:
            with open(os.path.join(tree, rel)) as a, open(os.path.join(upstream.installed_tree(), rel)) as b:
                assert a.read() != b.read(), f"{entry.name}: {rel} unchanged by the patch"


@needs_patched_release
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CI_SLICE)
def test_upstream_bug_detected_and_localized(name):
    """The clean build passes, the buggy build fails, and the replay names the module and phase the
    upstream fix changed."""
    entry = next(e for e in upstream.load_entries() if e.name == name)
    with tempfile.TemporaryDirectory() as tmp:
        o = upstream.judge(entry, tmp)
    assert o.clean_verdict == "pass", f"clean build: {o.clean_verdict} (worst {o.clean_worst})"
    assert o.detected, f"not detected: buggy build {o.buggy_verdict}"
    assert o.localized, f"culprit {o.culprit}, expected {entry.modules} {entry.phase}"


@needs_patched_release
@pytest.mark.multiprocess
def test_cli_runs_the_candidate_on_a_given_megatron_tree(tmp_path, capsys):
    """``ttrace run RECIPE --candidate-megatron PATH``: the candidate imports megatron-core from the
    tree (here the installed release with an upstream fix taken out again), the reference from the
    installed package; run.json records which tree each side ran and the report says they differ."""
    import fnmatch
    import json

    from ttrace_megatron.cli import main

    entry = next(e for e in upstream.load_entries() if e.name == "row_parallel_bias_sp_grad_not_reduced")
    assert not entry.overrides  # the shipped recipe as it is
    tree = upstream.overlay(entry, str(tmp_path / "tree"))
    out, report_path = tmp_path / "out", tmp_path / "report.json"
    rc = main(["run", os.path.join(RECIPES, entry.recipe + ".yaml"), "--candidate-megatron", tree, "--out", str(out),
               "--json", str(report_path), "--no-localize"])
    assert rc == 1
    report = json.loads(report_path.read_text())
    fm = report["first_mismatch"]
    assert any(fnmatch.fnmatchcase(fm["module"], g) for g in entry.modules) and fm["phase"] == entry.phase, fm
    with open(out / "candidate" / "run.json") as f:
        assert json.load(f)["versions"]["megatron.core.path"] == tree
    with open(out / "reference" / "run.json") as f:
        assert json.load(f)["versions"]["megatron.core.path"] == upstream.installed_tree()
    assert any(line.startswith("megatron.core.path:") for line in report["versions_differ"])
    # a path that holds no megatron-core is refused before anything runs
    capsys.readouterr()
    assert main(["run", os.path.join(RECIPES, entry.recipe + ".yaml"), "--candidate-megatron",
                 str(tmp_path / "nowhere")]) == 2
    assert "not a megatron-core source tree" in capsys.readouterr().err
