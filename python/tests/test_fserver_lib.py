"""StepMesh-shaped programs (programs/stepmesh_shaped/, written from
StepMesh's documented API) run through `import fserver_lib` as separate
processes over TCP on 127.0.0.1, launched the way StepMesh's scripts launch
them (DMLC_* variables, DMLC_ENABLE_RDMA=zmq, DMLC_INTERFACE=auto with
DMLC_NODE_HOST). This test process is the scheduler (DMLC_PS_ROOT_PORT=0: the
OS picks the port) and, as StepMesh's scheduler does, it calls stop() right
after init(), on a thread: stop() waits as long as the participants run."""

import os
import socket
import threading
import time

import pytest

import stepmesh
import fserver_lib as f
from test_fserver_compat import ForkRunner

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HERE, "programs", "stepmesh_shaped")


@pytest.fixture(scope="module")
def runner():
    r = ForkRunner(modules=["torch", "torch.utils.dlpack", "numpy", "fserver_lib", "fserver"])
    try:
        yield r
    finally:
        r.close()


def run_with_scheduler(monkeypatch, runner, env, make_children):
    """This process becomes the scheduler of `env` (DMLC_PS_ROOT_PORT=0) and, as
    StepMesh's scheduler program does (`f.init(); f.stop()`), calls stop() at
    once, on a thread; make_children(port) are then run. Returns (outputs,
    seconds stop() took) after checking every child exited 0 and stop() succeeded."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    f.init()
    port = f.scheduler_address().rsplit(":", 1)[1]
    stopped = {}

    def stop():
        t0 = time.monotonic()
        try:
            f.stop()
            stopped["ok"] = time.monotonic() - t0
        except BaseException as e:
            stopped["error"] = e

    th = threading.Thread(target=stop)
    th.start()
    children = make_children(port)
    try:
        results = runner.run({"timeout_s": 200, "children": children}, timeout_s=240)
    finally:
        th.join(60)
    assert not th.is_alive(), "the scheduler's stop() did not return after the job"
    bad = [f"{c['name']}: rc {r['rc']}{' (timed out)' if r['timed_out'] else ''}\n{r['output']}"
           for c, r in zip(children, results) if r["rc"] != 0]
    assert not bad, "\n----\n".join(bad)
    assert "error" not in stopped, f"scheduler stop(): {stopped.get('error')!r}"
    return [r["output"] for r in results], stopped["ok"]


def run_mesh(monkeypatch, runner, program, workers, servers, group_size=1, extra=None,
             timeout="30s"):
    """Runs `program` as every participant, launched as StepMesh's scripts do."""
    env = {"DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": str(workers),
           "DMLC_NUM_SERVER": str(servers), "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "0", "DMLC_GROUP_SIZE": str(group_size),
           "DMLC_ENABLE_RDMA": "zmq", "STEPMESH_TIMEOUT": timeout}

    def children(port):
        common = {**env, "DMLC_PS_ROOT_PORT": port, "DMLC_INTERFACE": "auto",
                  "DMLC_NODE_HOST": "127.0.0.1", "STEPMESH_POLL_MODE": "blocking",
                  **(extra or {})}
        return [{"program": os.path.join(PROGRAMS, program),
                 "name": f"{role} rank {r} gpu {g}",
                 "env": {**common, "DMLC_ROLE": role, "DMLC_NODE_RANK": str(r),
                         "STEPMESH_GPU": str(g)}}
                for role, n in (("server", servers), ("worker", workers))
                for r in range(n) for g in range(group_size)]
    return run_with_scheduler(monkeypatch, runner, env, children)


def run_afd(monkeypatch, runner, program, attention, extra):
    """For a program that sets its own DMLC_* (1 FFN server): the children get
    only AFD_ROLE / AFD_RANK, the scheduler's address and `extra`."""
    env = {"DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": str(attention), "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "0", "STEPMESH_TIMEOUT": "30s"}

    def children(port):
        common = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": port,
                  "STEPMESH_TIMEOUT": "30s", "STEPMESH_POLL_MODE": "blocking", **extra}
        return [{"program": os.path.join(PROGRAMS, program), "name": f"{role} {r}",
                 "env": {**common, "AFD_ROLE": role, "AFD_RANK": str(r)}}
                for role, n in (("ffn", 1), ("attention", attention)) for r in range(n)]
    return run_with_scheduler(monkeypatch, runner, env, children)[0]


def count(outs, text):
    return sum(text in o for o in outs)


def test_one_worker_one_server(monkeypatch, runner):
    outs, _ = run_mesh(monkeypatch, runner, "test_fserver.py", workers=1, servers=1)
    assert count(outs, "worker test done") == 1 and count(outs, "server test done") == 1, outs


def test_two_workers_one_server(monkeypatch, runner):
    outs, _ = run_mesh(monkeypatch, runner, "test_fserver.py", workers=2, servers=1)
    assert count(outs, "worker test done") == 2 and count(outs, "server test done") == 1, outs


def test_group_size_eight_is_eight_independent_pairs(monkeypatch, runner):
    outs, _ = run_mesh(monkeypatch, runner, "group_pairs.py", workers=1, servers=1, group_size=8)
    for g in range(8):
        assert count(outs, f"worker {g} test done") == 1, outs
        assert count(outs, f"server {g} test done") == 1, outs


# (program, workers, servers): each participant prints "test done" once.
SHAPED_MESHES = [
    ("rank_keys.py", 2, 2),  # per-rank keys batch by arrival
    ("diff_stage.py", 2, 2),  # three stages in flight
    ("multi_pull.py", 2, 2),  # several pulls per server in one request
    ("register_recv.py", 2, 1),  # recv buffers with worker subsets and several keys
    ("kernel_wait.py", 1, 1),  # host flags through the proxy thread
]


@pytest.mark.parametrize("program,workers,servers", SHAPED_MESHES,
                         ids=[p for p, _, _ in SHAPED_MESHES])
def test_every_participant_finishes(monkeypatch, runner, program, workers, servers):
    outs, _ = run_mesh(monkeypatch, runner, program, workers=workers, servers=servers)
    assert count(outs, "test done") == workers + servers, outs


def test_vllm_connector_shape(monkeypatch, runner):
    # The program sets its DMLC_* itself from AFD_* (as the connector does from vLLM's config).
    extra = {"AFD_NUM_ATTENTION": "2"}
    outs = run_afd(monkeypatch, runner, "vllm_connector.py", attention=2, extra=extra)
    assert count(outs, "attention 0 test done") == 1 and count(outs, "attention 1 test done") == 1
    assert count(outs, "ffn test done") == 1, outs


def test_joint_role_is_scheduler_and_server(runner):
    # The joint process binds the scheduler port itself: take a free one (bound
    # and released here; nothing else on this host is told of it).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    common = {"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
              "DMLC_PS_ROOT_PORT": port, "DMLC_ENABLE_RDMA": "zmq", "STEPMESH_TIMEOUT": "30s",
              "STEPMESH_POLL_MODE": "blocking"}
    children = [{"program": os.path.join(PROGRAMS, "joint.py"),
                 "env": {**common, "DMLC_ROLE": role}} for role in ("joint", "worker")]
    results = runner.run({"timeout_s": 120, "children": children}, timeout_s=150)
    assert all(r["rc"] == 0 for r in results), results
    assert "joint test done" in results[0]["output"], results
    assert "worker test done" in results[1]["output"], results


def test_benchmark_prints_its_500_iteration_window(monkeypatch, runner):
    # The benchmark's window at a CI size (docs/benchmarks.md has the 1024 x 7168 run).
    outs, _ = run_mesh(monkeypatch, runner, "bmk_comm_latency.py", workers=1, servers=1,
                       extra={"BMK_TOKENS": "16", "BMK_DIM": "256", "BMK_ITERS": "500"})
    worker = next(o for o in outs if "worker 0 test done" in o)
    assert "(1 windows)" in worker, worker
    assert "comm bmk rank=0: mean=" in worker and "p99=" in worker, worker
    for name in ("push 1", "push 2", "pull 1"):
        assert f"rank=0 {name}:" in worker, worker
    for stage in ("python_req", "req_send", "req_recv", "process", "rsp_send", "rsp_recv",
                  "python_rsp", "net_cost"):
        assert worker.count(stage) == 3, (stage, worker)


def test_scheduler_waits_for_a_job_longer_than_the_timeout(monkeypatch, runner):
    outs, took = run_mesh(monkeypatch, runner, "long_job.py", workers=1, servers=1,
                          timeout="2s", extra={"FSERVER_JOB_S": "6", "FSERVER_IDLE_S": "3"})
    assert count(outs, "test done") == 2, outs
    assert took > 5, f"the scheduler's stop() returned after {took:.1f} s, before the job ended"


def test_wait_flag_is_bounded_and_names_the_values():
    import torch
    flag = torch.zeros(1, dtype=torch.int64)
    f.write_flag(flag, torch.tensor([3]))
    f.wait_flag(flag, torch.tensor([3]))  # already there
    f.seq_add_one(flag)
    assert int(flag[0]) == 4
    with pytest.raises(stepmesh.DeadlineExceeded, match="flag is 4, still below seq 9"):
        f.wait_flag(flag, torch.tensor([9]), timeout_ms=50)


def test_barrier_takes_stepmesh_argument_names():
    # Before init: the names are checked first (StepMesh's include_client, or include_worker).
    with pytest.raises(TypeError):
        f.barrier(True, include_client=True, include_worker=True)
    with pytest.raises(RuntimeError, match="call init"):
        f.barrier(True, include_client=False)
    with pytest.raises(RuntimeError, match="call init"):
        f.barrier(include_server=True, include_worker=False, instance_barrier=True)


def test_fabric_van_selects_the_libfabric_transport(monkeypatch):
    """StepMesh's DMLC_ENABLE_RDMA=fabric is our libfabric transport (whether
    this build has it is core_tests' "DMLC_ENABLE_RDMA=fabric makes ...")."""
    monkeypatch.setenv("DMLC_ENABLE_RDMA", "fabric")
    assert stepmesh.MeshOptions.from_env().transport == "libfabric"
    monkeypatch.setenv("DMLC_ENABLE_RDMA", "zmq")
    assert stepmesh.MeshOptions.from_env().transport == "tcp"
