"""StepMesh-shaped fserver programs (python/tests/programs/) run unchanged
under stepmesh.fserver as separate processes over TCP. This test process is
the fserver scheduler (DMLC_ROLE=scheduler, DMLC_PS_ROOT_PORT=0: the OS picks
the port, no race) and hands the bound port to the children. The children are
forked by one fork_runner.py process after its single torch import (an import
per process was most of this test's time)."""

import json
import os
import select
import subprocess
import sys

import pytest

import proc_util
import stepmesh
import stepmesh.fserver as f

HERE = os.path.dirname(os.path.abspath(__file__))


class ForkRunner:
    """fork_runner.py, started once for this file, dying with it."""

    def __init__(self, modules=("torch", "torch.utils.dlpack", "stepmesh.fserver")):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fork_runner.py"), *modules],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=proc_util._die_with_parent)
        assert self.read_line(120) == "ready", "fork_runner did not start (see its stderr)"

    def read_line(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise AssertionError(f"fork_runner gave no answer in {timeout_s} s")
        return self.proc.stdout.readline().strip()

    def run(self, spec: dict, timeout_s: float) -> list:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.read_line(timeout_s))

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, 9)
            self.proc.wait()


@pytest.fixture(scope="module")
def runner():
    r = ForkRunner()
    try:
        yield r
    finally:
        r.close()


def run_mesh(monkeypatch, runner, program, workers, servers, iters):
    monkeypatch.setenv("DMLC_ROLE", "scheduler")
    monkeypatch.setenv("DMLC_NUM_WORKER", str(workers))
    monkeypatch.setenv("DMLC_NUM_SERVER", str(servers))
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "127.0.0.1")
    monkeypatch.setenv("DMLC_PS_ROOT_PORT", "0")
    f.init()
    try:
        port = f.scheduler_address().rsplit(":", 1)[1]
        common = {"DMLC_ROLE": "", "DMLC_NUM_WORKER": str(workers),
                  "DMLC_NUM_SERVER": str(servers), "DMLC_PS_ROOT_URI": "127.0.0.1",
                  "DMLC_PS_ROOT_PORT": port, "STEPMESH_TRANSPORT": "tcp",
                  "STEPMESH_TIMEOUT": "30s", "FSERVER_TEST_ITERS": str(iters)}
        children = [{"program": os.path.join(HERE, "programs", program),
                     "env": {**common, "DMLC_ROLE": role, "DMLC_NODE_RANK": str(r)}}
                    for role, count in (("server", servers), ("worker", workers))
                    for r in range(count)]
        results = runner.run({"timeout_s": 200, "children": children}, timeout_s=240)
    finally:
        f.stop()  # the scheduler: waits until every participant left
    bad = [f"{c['program']} {c['env']['DMLC_ROLE']} {c['env']['DMLC_NODE_RANK']}: rc {r['rc']}"
           f"{' (timed out)' if r['timed_out'] else ''}\n{r['output']}"
           for c, r in zip(children, results) if r["rc"] != 0]
    assert not bad, "\n----\n".join(bad)
    return [r["output"] for r in results]


def test_sum_program_two_workers_one_server(monkeypatch, runner):
    outs = run_mesh(monkeypatch, runner, "fserver_sum.py", workers=2, servers=1, iters=20)
    assert sum("worker test done" in o for o in outs) == 2, outs
    assert sum("server test done" in o for o in outs) == 1, outs


def test_dynamic_stages_program_two_workers_two_servers(monkeypatch, runner):
    outs = run_mesh(monkeypatch, runner, "fserver_stages.py", workers=2, servers=2, iters=30)
    assert sum("worker test done" in o for o in outs) == 2, outs
    assert sum("server test done" in o for o in outs) == 2, outs


def test_simple_notify_program_on_cpu_mock_streams(monkeypatch, runner):
    outs = run_mesh(monkeypatch, runner, "fserver_notify.py", workers=2, servers=1, iters=5)
    assert sum("worker test done" in o for o in outs) == 2, outs
    assert sum("server test done" in o for o in outs) == 1, outs


def test_membership_program_a_worker_leaves_alone_and_everyone_hears_the_epoch(monkeypatch,
                                                                                runner):
    outs = run_mesh(monkeypatch, runner, "fserver_membership.py", workers=2, servers=1, iters=10)
    assert sum("worker test done" in o for o in outs) == 1, outs
    assert sum("worker 1 left" in o for o in outs) == 1, outs
    assert sum("server test done" in o for o in outs) == 1, outs
    # The change has one number everywhere: epoch 1, workers [0].
    assert sum("epoch 1 workers [0] servers [0]" in o for o in outs) == 2, outs


def test_server_drain_program_answers_what_it_holds_then_the_worker_pulls_from_one(
        monkeypatch, runner):
    outs = run_mesh(monkeypatch, runner, "fserver_server_drain.py", workers=1, servers=2,
                    iters=10)
    assert sum("worker test done" in o for o in outs) == 1, outs
    assert sum("server 1 drained and left" in o for o in outs) == 1, outs
    assert sum("server test done" in o for o in outs) == 1, outs
    assert sum("epoch 1 workers [0] servers [0]" in o for o in outs) == 2, outs


def test_api_errors_before_init(monkeypatch):
    with pytest.raises(RuntimeError, match="call init"):
        f.push_pull([], [], [], [])
    with pytest.raises(RuntimeError, match="call init"):
        f.SimpleNotify().block_now_stream()
    monkeypatch.setenv("DMLC_ROLE", "ffn")
    with pytest.raises(stepmesh.InvalidArgument, match="DMLC_ROLE='ffn'"):
        f.init()
