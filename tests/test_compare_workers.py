"""Compare on several processes gives the serial verdict bit for bit (issue #35)."""

import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from conftest import load
from ttrace_megatron import compare_workers, fork_server
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.errors import ConfigMismatchError, TraceError
from ttrace_megatron.report import to_json
from ttrace_megatron.step_bounds import RECLIPPED


def _both(monkeypatch, ref, cand, **kw):
    from ttrace_megatron.compare import _TraceJudge

    serial = compare_traces(ref, cand, workers=1, **kw)
    monkeypatch.setattr(compare_workers, "MIN_PARALLEL_BYTES", 0)  # these traces are small: use the pool anyway
    in_parent, real = [], _TraceJudge.tensor
    monkeypatch.setattr(_TraceJudge, "tensor", lambda self, key, *a, **k: (in_parent.append(key), real(self, key, *a, **k))[1])
    pooled = compare_traces(ref, cand, workers=2, **kw)
    # the parent judged the first chunk itself while the workers started (the last chunk went to the
    # pool first, never to be taken back), and the workers the last: both shares are in the verdicts
    shared = [r.key for r in pooled.results
              if compare_workers.measured_in_pool(r.key) or compare_workers.of_the_step(r.key)]
    assert shared[0] in in_parent and shared[-1] not in in_parent
    assert any(compare_workers.of_the_step(r.key) for r in pooled.results)
    return serial, pooled, in_parent


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,inject,dtype", [
    # SP's layernorm grads are partial sums (the main grad's cancellation factor adds up the workers'
    # magnitudes in the parent); the bug makes verdicts fail; 3 iterations carry the moments' state
    ("gpt_tp2_sp", ["row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"], "fp32"),
    ("gpt_tp2_sp", [], "bf16"),
    ("moe_tp2_sp_ep2", [], "fp32"),  # routing choices judged by their scores, aux losses
])
def test_workers_give_the_serial_verdict_bit_for_bit(runs, monkeypatch, name, inject, dtype):
    ref, cand = runs.candidate(load(name, dtype=dtype), inject=inject)
    serial, pooled, in_parent = _both(monkeypatch, ref, cand)
    a, b = to_json(serial), to_json(pooled)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert [(r.key, r.error, r.tolerance_eps, r.tolerance_source) for r in serial.results] == \
        [(r.key, r.error, r.tolerance_eps, r.tolerance_source) for r in pooled.results]
    assert any(r.key.microbatch >= 0 for r in serial.results) and any(r.key.microbatch < 0 for r in serial.results)
    assert serial.verdict == ("fail" if inject else "pass")
    if inject:  # the bug moves the clip coefficients: the workers decided the step's re-clip themselves
        assert any(RECLIPPED in r.tolerance_source and r.key not in in_parent for r in pooled.results)
    # each worker's own high-water mark over its start is measured (Linux): the bound per worker
    assert serial.worker_peak is None
    assert pooled.worker_peak is None if not os.path.exists("/proc/self/clear_refs") else pooled.worker_peak >= 0


@pytest.mark.multiprocess
def test_a_damaged_file_is_named_alike_with_workers(runs, monkeypatch, tmp_path):
    ref, cand = runs.candidate(load("gpt_tp2_sp"))
    damaged = tmp_path / "cand"
    shutil.copytree(cand, damaged)
    data = damaged / "rank-00001" / "iter-000002.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    data.write_bytes(bytes(raw))
    errors = []
    for workers in (1, 3):
        monkeypatch.setattr(compare_workers, "MIN_PARALLEL_BYTES", 0)
        with pytest.raises(TraceError) as e:
            compare_traces(ref, str(damaged), workers=workers)
        errors.append((str(e.value), e.value.rank, e.value.path))
    assert errors[0] == errors[1] and errors[0][1] == 1 and errors[0][2].endswith("iter-000002.safetensors")


def test_trace_errors_cross_processes_whole():
    for cls in (TraceError, ConfigMismatchError):
        e = pickle.loads(pickle.dumps(cls("bad", path="/x/rank-00001/f", rank=1, tensor="it1 m [forward] output")))
        assert type(e) is cls and (e.message, e.path, e.rank, e.tensor) == ("bad", "/x/rank-00001/f", 1,
                                                                             "it1 m [forward] output")
        assert str(e) == str(cls("bad", path="/x/rank-00001/f", rank=1, tensor="it1 m [forward] output"))


def test_the_parent_judges_every_chunk_no_worker_has_taken():
    """Until a worker has started, the parent claims and judges each chunk in turn."""
    import threading
    from concurrent.futures import Future

    from ttrace_megatron.keys import TensorKey

    keys = [TensorKey(1, 0, f"decoder.layers.{i}.mlp", "forward", "output") for i in range(40)]
    judged = []

    class Judge:
        common = keys

        def tensor(self, key):
            judged.append(key)
            return key

    class Pool:  # whose processes have not started: a chunk is measured after 5 s, unless the parent claimed it
        def submit(self, fn, i, chunk):
            future = Future()

            def start():
                if compare_workers.claimed(claims, i, compare_workers.WORKER):
                    future.set_result([(("measured by the pool", None), None)] * len(chunk))
                else:
                    future.set_result(None)
            timer = threading.Timer(5.0, start)
            timer.daemon = True
            timer.start()
            return future

    chunks = compare_workers._chunks(Judge(), 2)
    claims = multiprocessing.Array("b", len(chunks))
    assert len(chunks) > 3
    started = multiprocessing.Value("b", 0)
    assert list(compare_workers._shared_with_pool(Judge(), Pool(), chunks, claims, started, [])) == keys
    assert judged == keys and list(claims) == [compare_workers.PARENT] * len(chunks)


DYING_WORKER = r"""
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from ttrace_megatron import compare_workers as cw
from ttrace_megatron.keys import TensorKey

PARENT = os.getpid()

class Judge:
    common = [TensorKey(1, 0, f"decoder.layers.{i}.mlp", "forward", "output") for i in range(40)]
    partial_magnitudes = {}

    def tensor(self, key):
        if os.getpid() != PARENT:  # a worker dies at its first key, once the parent has claimed chunks
            time.sleep(1.0)
            os._exit(3)
        time.sleep(0.05)  # the parent judges slower than the workers start
        return key

def start(claims):  # (leaves `started` unset: the parent claims chunks until the pool breaks)
    cw._JUDGE, cw._CLAIMS = Judge(), claims

if __name__ == "__main__":
    judge, ctx = Judge(), multiprocessing.get_context("fork")
    chunks = cw._chunks(judge, 2)
    claims = ctx.Array("b", len(chunks))
    pool = ProcessPoolExecutor(2, mp_context=ctx, initializer=start, initargs=(claims,))
    try:
        started = ctx.Value("b", 0)
        print(list(cw._shared_with_pool(judge, pool, chunks, claims, started, [])) == judge.common, flush=True)
    finally:
        pool.shutdown(wait=True)
"""


@pytest.mark.multiprocess
def test_a_worker_that_dies_leaves_the_rest_to_the_parent_and_nothing_hung():
    """A pool that breaks after the parent claimed chunks: every verdict still comes, in order, and
    the pool stops cleanly. With ``Future.cancel`` in place of claims, the pool's manager thread died
    of an InvalidStateError on Python 3.11 (and the process could hang at exit)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(compare_workers.__file__))), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", DYING_WORKER], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "True"
    assert "compare workers stopped" in run.stdout
    assert "Traceback" not in run.stderr, run.stderr  # (the pool's manager thread: InvalidStateError)


def test_only_microbatch_keys_go_to_the_pool():
    from ttrace_megatron.keys import TensorKey

    assert compare_workers.per_microbatch(TensorKey(1, 0, "decoder.layers.0.mlp", "forward", "output"))
    assert not compare_workers.per_microbatch(TensorKey(1, -1, "decoder.layers.0.mlp.linear_fc1", "main_grad",
                                                        "weight.main_grad"))



def test_the_fork_server_hides_every_gpu_from_what_it_forks():
    """A CPU rank on a machine with GPUs runs through cuda_shim, which refuses a process that sees
    CUDA (`ttrace run --cpu` on the H100 machine did): the fork server the ranks and the compare
    workers come from starts with CUDA_VISIBLE_DEVICES empty; the calling process keeps its own."""
    script = (
        "import os\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"
        "from multiprocessing import forkserver\n"
        "from ttrace_megatron.fork_server import forkserver_context\n"
        "forkserver_context([])\n"
        "import time\n"
        "pid = forkserver._forkserver._forkserver_pid\n"
        "for _ in range(200):  # until the server has exec'd (before, /proc shows the parent's first environment)\n"
        "    with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
        "        if b'forkserver' in f.read():\n"
        "            break\n"
        "    time.sleep(0.05)\n"
        "with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "    env = f.read().split(b'\\0')\n"
        "assert b'CUDA_VISIBLE_DEVICES=' in env, env\n"
        "assert os.environ['CUDA_VISIBLE_DEVICES'] == '0'\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_the_fork_server_imports_what_the_ttrace_script_imports():
    """Each process forked from the server first runs the parent's ``__main__`` again; for the
    ``ttrace`` console script that is its entry module, which the server must have imported already
    (0.30-0.41 s a process otherwise, on the development VM). The server's command line lists its preload."""
    setup = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")).read()
    entry = setup.split('"ttrace=', 1)[1].split(":", 1)[0]
    assert entry == fork_server.ENTRY_MODULE
    script = (
        "import time\n"
        "from multiprocessing import forkserver\n"
        "from ttrace_megatron.fork_server import forkserver_context\n"
        "forkserver_context(['json'])\n"
        "pid = forkserver._forkserver._forkserver_pid\n"
        "for _ in range(200):\n"
        "    with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
        "        line = f.read()\n"
        "    if b'forkserver' in line:\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print(line.replace(b'\\0', b' ').decode())\n")
    line = subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True,
                          text=True).stdout
    assert f"['{fork_server.EXIT_MODULE}', 'json', '{entry}']" in line, line


def test_the_fork_server_runs_its_exit_handlers_and_skips_the_teardown(tmp_path):
    """The server holds its parent's stdout and stderr: a pipe reading ``ttrace run`` closes only
    when the server is gone, and the teardown of torch and megatron-core took ~1.3 s of that. A
    module the server preloads registers an exit handler (which must run) and holds an object
    whose finalizer would run in the teardown (which must not)."""
    (tmp_path / "probe_module.py").write_text(
        "import atexit, os\n"
        "OUT = os.environ['PROBE_OUT']\n"
        "atexit.register(lambda: open(os.path.join(OUT, 'atexit'), 'w').close())\n"
        "class Teardown:\n"
        "    def __del__(self, _open=open, _path=os.path.join(OUT, 'teardown')):\n"
        "        _open(_path, 'w').close()\n"
        "held = Teardown()\n"
        "open(os.path.join(OUT, 'imported'), 'w').close()\n")
    script = (
        "import time\n"
        "from multiprocessing import forkserver\n"
        "from ttrace_megatron.fork_server import forkserver_context\n"
        "forkserver_context(['probe_module'])\n"
        "import os\n"
        "for _ in range(400):  # until the server has imported its preload\n"
        "    if os.path.exists(os.path.join(os.environ['PROBE_OUT'], 'imported')):\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print(forkserver._forkserver._forkserver_pid)\n")
    env = dict(os.environ, PROBE_OUT=str(tmp_path),  # the server finds the probe where the parent did
               PYTHONPATH=os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p]))
    pid = int(subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True,
                             text=True, env=env).stdout.split()[-1])
    import time

    for _ in range(400):  # the parent is gone: the server exits
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    assert (tmp_path / "imported").exists() and (tmp_path / "atexit").exists()
    assert not (tmp_path / "teardown").exists()


@pytest.mark.parametrize("how", [["--cpu"], []])
def test_ttrace_run_starts_the_fork_server_before_it_imports_torch(how):
    """The server's imports (torch, megatron-core: ~4 s) run beside the command's own only if it
    starts first: ``ttrace run`` asked torch whether it had a GPU before, and its first rank began
    1.3 s later on the development VM. Here no GPU is in sight (none, or all hidden), or ``--cpu``."""
    script = (
        "import sys\n"
        "from ttrace_megatron.adapter.run import server\n"
        "def started(preload):\n"
        "    print('torch imported:', 'torch' in sys.modules, 'preload:', preload == server.PRELOAD)\n"
        "    raise SystemExit(0)\n"
        "server.forkserver_context = started\n"
        "from ttrace_megatron.cli import main\n"
        f"main(['run', '--no-disk-check'] + {how!r})\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True, text=True,
                         env=env).stdout
    assert "torch imported: False preload: True" in out, out


@pytest.mark.parametrize("size, workers, started", [(300 << 20, None, True), (1 << 20, None, False),
                                                    (300 << 20, 1, False)])
def test_ttrace_compare_starts_its_workers_server_before_torch_where_it_will_pool(tmp_path, size, workers, started):
    """A candidate of at least MIN_PARALLEL_BYTES on the disk, more than one worker: the server is
    started before the command imports torch. A sparse file stands for the candidate's data."""
    cand = tmp_path / "cand" / "rank-00000"
    cand.mkdir(parents=True)
    with open(cand / "iter-00000.safetensors", "wb") as f:
        f.truncate(size)
    script = (
        "import sys\n"
        "from ttrace_megatron import fork_server\n"
        "def started(preload):\n"
        "    print('started; torch imported:', 'torch' in sys.modules, preload == fork_server.COMPARE_PRELOAD)\n"
        "    raise SystemExit(0)\n"
        "fork_server.forkserver_context = started\n"
        "fork_server.available_cores = lambda: 2\n"
        "from ttrace_megatron.cli import main\n"
        f"main(['compare', {str(tmp_path / 'ref')!r}, {str(tmp_path / 'cand')!r}]"
        f" + {(['--workers', str(workers)] if workers else [])!r})\n")
    path = tmp_path / "main.py"  # a __main__ a worker could import, as the ttrace script is
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], timeout=120, capture_output=True, text=True).stdout
    assert ("started; torch imported: False True" in out) == started, out


def test_a_gpu_is_in_sight_unless_every_one_is_hidden(monkeypatch, tmp_path):
    from ttrace_megatron.adapter.run import server

    node = tmp_path / "nvidia0"
    node.write_text("")
    monkeypatch.setattr(server, "GPU_DEVICE_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert server.gpu_device_visible()
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not server.gpu_device_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    node.unlink()
    assert not server.gpu_device_visible()  # no device node: CPU, whatever the variable says


@pytest.mark.multiprocess
def test_ranks_under_torchrun_give_the_serial_verdict_bit_for_bit(runs, tmp_path):
    """``torchrun --nproc-per-node 2 -m ttrace_megatron.cli compare --distributed``: each rank
    judges its share of the keys (gloo), rank 0 decides them in order: the serial report bit for bit."""
    import os
    import socket

    ref, cand = runs.candidate(load("gpt_tp2_sp"), inject=["row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
    from ttrace_megatron.report import write_json

    write_json(compare_traces(ref, cand, workers=1), str(tmp_path / "serial.json"))
    serial = json.load(open(tmp_path / "serial.json"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "ttrace_megatron.cli",
                           "compare", ref, cand, "--distributed", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "FAIL" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]  # (rank 0's exit)
    assert json.dumps(json.load(open(out)), sort_keys=True) == json.dumps(serial, sort_keys=True)
