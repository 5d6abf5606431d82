"""StepMesh-shaped fserver programs (python/tests/programs/) run unchanged
under stepmesh.fserver as separate processes over TCP. This test process is
the fserver scheduler (DMLC_ROLE=scheduler, DMLC_PS_ROOT_PORT=0: the OS picks
the port, no race) and hands the bound port to the children."""

import os

import pytest

import proc_util
import stepmesh
import stepmesh.fserver as f

HERE = os.path.dirname(os.path.abspath(__file__))


def run_mesh(monkeypatch, program, workers, servers, iters):
    proc_util.require_torch()
    monkeypatch.setenv("DMLC_ROLE", "scheduler")
    monkeypatch.setenv("DMLC_NUM_WORKER", str(workers))
    monkeypatch.setenv("DMLC_NUM_SERVER", str(servers))
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "127.0.0.1")
    monkeypatch.setenv("DMLC_PS_ROOT_PORT", "0")
    f.init()
    procs = []
    try:
        port = f.scheduler_address().rsplit(":", 1)[1]
        common = {"DMLC_PS_ROOT_PORT": port, "STEPMESH_TRANSPORT": "tcp",
                  "STEPMESH_TIMEOUT": "30s", "FSERVER_TEST_ITERS": str(iters)}
        for role, count in (("server", servers), ("worker", workers)):
            for r in range(count):
                procs.append(proc_util.spawn([os.path.join(HERE, "programs", program)],
                                             {**common, "DMLC_ROLE": role,
                                              "DMLC_NODE_RANK": str(r)}))
        outs = proc_util.reap(procs, timeout_s=240)
    finally:
        proc_util.kill_all(procs)
        f.stop()  # the scheduler: waits until every participant left
    return outs


def test_sum_program_two_workers_one_server(monkeypatch):
    outs = run_mesh(monkeypatch, "fserver_sum.py", workers=2, servers=1, iters=20)
    assert sum("worker test done" in o for o in outs) == 2, outs
    assert sum("server test done" in o for o in outs) == 1, outs


def test_dynamic_stages_program_two_workers_two_servers(monkeypatch):
    outs = run_mesh(monkeypatch, "fserver_stages.py", workers=2, servers=2, iters=30)
    assert sum("worker test done" in o for o in outs) == 2, outs
    assert sum("server test done" in o for o in outs) == 2, outs


def test_api_errors_before_init_and_unimplemented_cuda_helpers(monkeypatch):
    with pytest.raises(RuntimeError, match="call init"):
        f.push_pull([], [], [], [])
    with pytest.raises(stepmesh.Unimplemented, match="cuda.h"):
        f.SimpleNotify()
    monkeypatch.setenv("DMLC_ROLE", "ffn")
    with pytest.raises(ValueError, match="DMLC_ROLE='ffn'"):
        f.init()
