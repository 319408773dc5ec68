import os
import warnings

import pytest
from hypothesis import settings

# CI replays a fixed set of examples so a landing never depends on the draw; local runs explore.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

for category in (UserWarning, FutureWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=category)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "recipes")


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: runs real megatron-core ranks (gloo, CPU)")
    config.addinivalue_line("markers", "release_slice: the slice CI runs on the oldest and newest supported "
                                       "megatron-core too (tests/test_release_slice.py)")


def pytest_report_header(config):
    """The megatron-core under test, in every log (CI runs the suite on more than one release)."""
    import megatron.core

    where = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))))
    return f"megatron-core {megatron.core.__version__} from {where}"


class Runs:
    """Runs recipes once per session and keeps their traces: a reference is shared by every
    candidate of the same recipe (it does not depend on the candidate's injected bug)."""

    def __init__(self, root):
        self.root = root
        self._refs = {}

    def reference(self, recipe):
        from ttrace_megatron.adapter.run.launch import launch
        from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options

        key = repr(sorted(recipe.to_json().items(), key=str))
        if key not in self._refs:
            out = os.path.join(self.root, f"{recipe.name}-{recipe.dtype}-{len(self._refs)}")
            trace = trace_options(os.path.join(out, "reference"), os.path.join(out, "seed.safetensors"))
            launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace), timeout_s=300)
            self._refs[key] = out
        return self._refs[key]

    def perturbed(self, recipe, seed=1):
        """The perturbation-estimate run of the recipe's reference (round-off-sized noise in every
        module), next to the reference; its trace directory."""
        from ttrace_megatron.adapter.run.launch import launch
        from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options

        out = self.reference(recipe)
        trace_dir = os.path.join(out, f"reference-perturbed-{seed}")
        if not os.path.exists(trace_dir):
            # lock-stepped on the reference, as ttrace run runs it
            trace = trace_options(trace_dir, os.path.join(out, "seed.safetensors"), perturb=seed,
                                  lockstep=os.path.join(out, "reference"))
            launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace), timeout_s=300)
        return trace_dir

    def candidate(self, recipe, inject=(), name="candidate", probes=None, lockstep=True, **trace_kwargs):
        """A candidate run next to the recipe's reference; ``trace_kwargs`` are TraceOptions fields
        (iterations, modules, replay, reference, keep_tensors, ...). ``lockstep``: in lock-step with
        the reference, as ``ttrace run`` runs it (False: on its own weights)."""
        from ttrace_megatron.adapter.run.launch import launch
        from ttrace_megatron.adapter.run.runner import CANDIDATE, Probes, RunSpec, trace_options

        out = self.reference(recipe)
        trace_dir = os.path.join(out, f"{name}-{'-'.join(inject) or 'clean'}".replace(":", "_").replace("*", "x"))
        if lockstep:
            trace_kwargs["lockstep"] = os.path.join(out, "reference")
        else:
            trace_dir += "-own-weights"
        trace = trace_options(trace_dir, os.path.join(out, "seed.safetensors"), **trace_kwargs)
        launch(RunSpec(recipe=recipe.to_json(), role=CANDIDATE, trace=trace, inject=list(inject)), timeout_s=300,
               probes=probes or Probes())
        return os.path.join(out, "reference"), trace_dir


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return Runs(str(tmp_path_factory.mktemp("runs")))


def load(name, **overrides):
    """A shipped recipe, with top-level overrides (e.g. dtype="bf16"); a dict overrides those fields
    of its section (model={"moe_expert_capacity_factor": 1.0})."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    path = os.path.join(RECIPES, name + ".yaml")
    with open(path) as f:
        raw = yaml.safe_load(f)
    for field, value in overrides.items():
        raw[field] = {**raw.get(field, {}), **value} if isinstance(value, dict) else value
    raw.setdefault("name", name)
    return recipe_from_dict(raw, source=path)


def error_dirs():
    """The rank error directories (``ttrace-errors-*``) that exist now: a test takes them before a
    launch, and :func:`rank_pid` looks only at the ones made after."""
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ttrace-errors-*")))


def rank_pid(before, trace_dir, rank):
    """The pid of ``rank`` of the run writing ``trace_dir`` (its stack file's head: "pid N trace DIR"),
    among the error directories made since ``before``; None while it has not started."""
    for d in error_dirs() - before:
        path = os.path.join(d, f"rank{rank}.stack")
        if os.path.exists(path):
            with open(path) as f:
                head = f.readline().split()
            if head[3:] == [str(trace_dir)]:  # this run's rank, not a run beside it
                return int(head[1])
    return None


def launch_in_thread(spec, timeout_s):
    """``launch(spec)`` on a thread: (the thread, a dict that gets the RunFailed message as "error")."""
    import threading

    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.errors import RunFailed

    outcome = {}

    def run():
        try:
            launch(spec, timeout_s=timeout_s)
        except RunFailed as e:
            outcome["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome
