"""stepmesh.vllm.StepMeshAFDConnector against the vLLM AFD plugin's contract.

In-process: the extra config, registration in the plugin's factory and names
tuple, constructor checks, the custom ops' fake implementations. Over real
processes (children of fork_runner.py, one torch import): 2A2F and 4A2F in
both topologies (variable and idle token counts per step, warm-up and capture
flags through the control plane, bf16 router logits, ref_tensor reused, bad
shapes and metadata), a lost FFN rank, and our own base when no afd_plugin is
importable. The plugin's classes come from the stand-in under
afd_plugin_standin/ (written from the documented contract); where the real
afd_plugin (with vLLM) is importable the process suite runs against it too.
"""
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(HERE, "afd_plugin_standin")
PEER = os.path.join(HERE, "programs", "vllm_peer.py")
RUNNER = os.path.join(HERE, "fork_runner.py")
# Looked up before the stand-in goes first on this process's path.
REAL_PLUGIN = (importlib.util.find_spec("afd_plugin") is not None
               and importlib.util.find_spec("vllm") is not None)
sys.path.insert(0, STANDIN)

import proc_util  # noqa: E402

torch = proc_util.require_torch()
import stepmesh.vllm as sv  # noqa: E402
from afd_plugin import config as plugin_config  # noqa: E402  (the stand-in)
from afd_plugin.connectors.base import AFDConnectorBase  # noqa: E402
from afd_plugin.connectors.factory import AFDConnectorFactory  # noqa: E402

H = 16


def vllm_config(extra=None, hidden=H, **model):
    afd = {"connector": sv.NAME}
    if extra is not None:
        afd["connector_extra_config"] = extra
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(hidden_size=hidden), dtype=torch.bfloat16,
            enforce_eager=True, **model),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64),
        parallel_config=types.SimpleNamespace(data_parallel_rank=0, data_parallel_size=1),
        compilation_config=None, additional_config={"afd": afd})


def afd_config(**kw):
    fields = dict(connector=sv.NAME, role="attention", host="127.0.0.1", port=29999,
                  num_attention_ranks=2, num_ffn_ranks=2)
    fields.update(kw)
    return plugin_config.AFDConfig(**fields)


# ----------------------------------------------------------------- in-process
def test_uses_the_plugin_base_when_importable():
    assert sv.PLUGIN_BASE
    assert issubclass(sv.StepMeshAFDConnector, AFDConnectorBase)
    assert isinstance(sv.StepMeshAFDConnector.parse_extra_config({}), sv.StepMeshExtraInfo)


def test_parse_extra_config():
    parse = sv.StepMeshAFDConnector.parse_extra_config
    assert parse({}) == parse(None) == sv.StepMeshExtraInfo()
    info = parse({"topology": "all_to_all", "transport": "tcp", "interface": "lo",
                  "auth_token": "none", "poll_mode": "spin", "trace": "off",
                  "num_stages": 3, "timeout": 2})
    assert (info.topology, info.transport, info.interface, info.trace) == \
        ("all_to_all", "tcp", "lo", False)
    assert info.to_mapping()["num_stages"] == 3 and info.timeout == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.topology = "subgroup"
    with pytest.raises(ValueError, match="unknown key 'topolgy'"):
        parse({"topolgy": "subgroup"})
    with pytest.raises(ValueError, match="topology='ring'"):
        parse({"topology": "ring"})
    with pytest.raises(ValueError, match="num_stages='two'"):
        parse({"num_stages": "two"})
    with pytest.raises(ValueError, match="auth_token='secret'"):
        parse({"auth_token": "secret"})
    with pytest.raises(TypeError, match="must be a mapping"):
        parse(["topology"])


def test_registration_in_the_plugin_factory():
    assert sv.register() and sv.register()  # idempotent
    assert plugin_config.SUPPORTED_AFD_CONNECTORS.count(sv.NAME) == 1
    afd_config().validate()  # the validator reads the tuple at call time
    conn = AFDConnectorFactory.create_connector(0, 0, vllm_config({"max_tokens": 8}),
                                                afd_config(role="ffn"))
    assert type(conn) is sv.StepMeshAFDConnector
    assert (conn.role_rank, conn.attn_size, conn.ffn_size) == (0, 2, 2)
    assert conn.control_plane is not None and not conn.is_initialized
    conn.close()
    conn.close()  # never initialised: still fine, twice
    # The stand-in is as strict as the plugin: a non-connector is refused...
    AFDConnectorFactory.register_connector("NotAConnector", "stepmesh.vllm",
                                           "StepMeshExtraInfo", replace=True)
    with pytest.raises(TypeError, match="is not an AFDConnectorBase"):
        AFDConnectorFactory.create_connector(
            0, 0, vllm_config(), afd_config(connector="NotAConnector"))
    # ... and so is a name outside the supported tuple.
    with pytest.raises(ValueError, match="AFD connector must be one of"):
        afd_config(connector="Unlisted").validate()


def test_setup_py_declares_the_vllm_entry_point():
    root = os.environ.get("PYTEST_STEPMESH_ROOT", os.path.dirname(os.path.dirname(HERE)))
    with open(os.path.join(root, "setup.py"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'"vllm\.general_plugins": \["stepmesh_afd = ([\w.]+):(\w+)"\]', text)
    assert m, "setup.py has no vllm.general_plugins entry point"
    assert m.groups() == ("stepmesh.vllm", "register") and callable(sv.register)


def test_constructor_checks_name_the_field():
    make = sv.StepMeshAFDConnector
    with pytest.raises(ValueError, match=r"num_attention_ranks \(3\).*num_ffn_ranks \(2\)"):
        make(0, 0, vllm_config(), afd_config(num_attention_ranks=3), 0)
    with pytest.raises(ValueError, match="role_rank=2 out of range"):
        make(0, 0, vllm_config(), afd_config(), 2)
    with pytest.raises(ValueError, match="hf_config.hidden_size"):
        make(0, 0, vllm_config(hidden=None), afd_config(), 0)
    with pytest.raises(ValueError, match="unknown key 'hidden'"):
        make(0, 0, vllm_config({"hidden": 3}), afd_config(), 0)
    conn = make(0, 0, vllm_config({"topology": "all_to_all"}), afd_config(num_attention_ranks=3),
                1)  # any A, F for all_to_all
    assert conn.max_tokens == 64 and conn.dtype == torch.bfloat16  # from vllm_config
    ctx = sv.AFDTransferContext(metadata=sv.AFDTransferMetadata(0, 0, [1]))
    with pytest.raises(RuntimeError, match="not initialised"):
        conn.send_attn_output(torch.zeros(1, H, dtype=torch.bfloat16), ctx)
    with pytest.raises(RuntimeError, match="not initialised"):
        conn.recv_ffn_output(torch.zeros(1, H, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="not initialised"):
        conn.control_plane.recv_dp_metadata_list()


def test_mesh_options_come_from_the_configs(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\nignored\n")
    extra = {"transport": "tcp", "interface": "lo", "poll_mode": "spin", "trace": False,
             "backend": "cpu_mock", "timeout": 7, "auth_token": f"file:{token}",
             "topology": "all_to_all"}
    conn = sv.StepMeshAFDConnector(0, 0, vllm_config(extra), afd_config(
        role="ffn", num_attention_ranks=3, num_ffn_ranks=2, port=31000), 1)
    o = conn._mesh_options()
    assert (o.role, o.rank, o.num_workers, o.num_servers) == ("server", 1, 3, 2)
    assert (o.scheduler, o.transport, o.interface, o.poll_mode) == \
        ("127.0.0.1:31000", "tcp", "lo", "spin")
    assert (o.trace, o.timeout, o.backend, o.auth_token) == (False, 7.0, "cpu_mock", "s3cret")
    sub = sv.StepMeshAFDConnector(0, 0, vllm_config({"auth_token": "none"}), afd_config(
        num_attention_ranks=4, num_ffn_ranks=2, port=31000), 3)  # attention 3 -> FFN 1
    o = sub._mesh_options()
    assert (o.role, o.rank, o.num_workers, o.num_servers, o.scheduler, o.auth_token) == \
        ("worker", 1, 2, 1, "127.0.0.1:31001", "")
    missing = sv.StepMeshAFDConnector(0, 0, vllm_config({"auth_token": "file:/nonexistent/t"}),
                                      afd_config(), 0)
    with pytest.raises(ValueError, match="auth_token: cannot read '/nonexistent/t'"):
        missing._mesh_options()


def test_graph_mode_settings_from_the_configs():
    # The plugin captures the FFN forward in a CUDA graph unless the FFN instance is
    # enforce_eager; ours receives from host code, so init refuses it first, having
    # started nothing (no scheduler: the port stays free, the connector uninitialised).
    extra = {"backend": "cuda", "transport": "tcp"}
    cfg = vllm_config(extra)
    cfg.model_config.enforce_eager = False  # an FFN instance started without --enforce-eager
    ffn = sv.StepMeshAFDConnector(0, 0, cfg, afd_config(role="ffn"), 0)
    with pytest.raises(RuntimeError, match="FFN rank 0.*--enforce-eager"):
        ffn.init_afd_connector()
    assert not ffn.is_initialized and ffn._scheduler is None
    # The graph trigger holds a slot per captured send: capture sizes x layers x stages.
    cfg = vllm_config({"num_stages": 2})
    cfg.model_config.hf_config.num_hidden_layers = 58
    cfg.compilation_config = types.SimpleNamespace(cudagraph_capture_sizes=list(range(51)))
    assert sv.StepMeshAFDConnector(0, 0, cfg, afd_config(), 0)._graph_slot_capacity() == 5916
    assert sv.StepMeshAFDConnector(0, 0, vllm_config(), afd_config(),
                                   0)._graph_slot_capacity() == 4096  # not given: the default


def test_traced_calls_are_the_ops_alone(monkeypatch):
    # Under torch.compile (vLLM compiles the model whole, fullgraph) a call into the
    # binding or a read of the connector's state while tracing is a graph break: the
    # traced data path must be the custom op and nothing else (its kernel checks the
    # state when it runs). Torch 1.13 has no Dynamo, so the trace is modelled: the
    # connector's "is compiling" says yes, every binding object raises when touched,
    # and meta tensors run the ops' fakes.
    from stepmesh import _vllm_wire

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"{name} touched while tracing")

    sv.register_ops()
    monkeypatch.setattr(_vllm_wire, "_IS_COMPILING", lambda: True)
    meta = torch.empty(3, H, device="meta", dtype=torch.bfloat16)
    ctx = sv.AFDTransferContext(metadata=sv.AFDTransferMetadata(1, 0, [3]))
    attn = sv.StepMeshAFDConnector(0, 0, vllm_config(), afd_config(), 0)
    attn._node = attn._lanes = attn._trigger = attn._fast = Untouchable()
    attn.send_attn_output(meta, ctx)
    attn.send_attn_output(meta, ctx, router_logits=torch.empty(3, 8, device="meta"))
    assert attn.recv_ffn_output(meta, ubatch_idx=0) is meta
    with pytest.raises(ValueError, match="needs ref_tensor"):
        attn.recv_ffn_output(None, 0)
    ffn = sv.StepMeshAFDConnector(0, 0, vllm_config(), afd_config(role="ffn"), 0)
    ffn._node = Untouchable()
    state = sv.StepMeshTransferState(batch=Untouchable(), stage=0, shape=Untouchable(), op_id=4)
    ffn.send_ffn_output(meta, sv.AFDTransferContext(metadata=ctx.metadata, states=state))


def test_custom_ops_have_fake_implementations():
    sv.register_ops()
    sv.register_ops()  # once per process
    assert sv.FAKE_REGISTRATION in ("register_fake", "impl_abstract", "meta")
    meta = torch.empty(4, H, device="meta", dtype=torch.bfloat16)
    # The fakes touch nothing (no connector with id 12345 exists).
    torch.ops.stepmesh.afd_send_attn(meta, None, 12345, 0, 0)
    torch.ops.stepmesh.afd_recv_ffn(meta, 12345, 0)
    torch.ops.stepmesh.afd_send_ffn(meta, 12345, 7)
    with pytest.raises(RuntimeError, match="id 12345 is not initialised"):
        torch.ops.stepmesh.afd_send_ffn(torch.zeros(4, H, dtype=torch.bfloat16), 12345, 7)
    with pytest.raises(RuntimeError, match="id 12345 is not initialised"):
        torch.ops.stepmesh.afd_recv_ffn(torch.zeros(4, H, dtype=torch.bfloat16), 12345, 0)


# ----------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def runner():
    """fork_runner.py with torch and numpy imported once; run(children) runs one
    spec (its own deadline) and returns each child's result."""
    env = dict(os.environ)
    env.setdefault("STEPMESH_AUTH", "off")  # loopback only; silences the no-token warning
    p = subprocess.Popen([sys.executable, RUNNER, "torch", "numpy"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env,
                         preexec_fn=proc_util._die_with_parent)
    try:
        line = p.stdout.readline()
        assert line.strip() == "ready", line

        def run(children, timeout_s=60):
            p.stdin.write(json.dumps({"timeout_s": timeout_s, "children": children}) + "\n")
            p.stdin.flush()
            return json.loads(p.stdout.readline())

        yield run
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


class TimedRun:
    """run(children) for proc_util.run_on_free_ports: the runner's, keeping
    how long the last run took (a run retried on new ports is not counted)."""

    def __init__(self, runner, timeout_s):
        self.runner, self.timeout_s, self.took = runner, timeout_s, 0.0

    def __call__(self, children):
        t0 = time.monotonic()
        results = self.runner(children, timeout_s=self.timeout_s)
        self.took = time.monotonic() - t0
        return results


def run_mesh(runner, A, F, topology, mode="normal", plugin="standin", steps=4, layers=2,
             timeout=5.0, custom_ops="auto", logits=True, device="cpu"):
    def make(port):
        children = []
        for role, n in (("ffn", F), ("attention", A)):
            for r in range(n):
                spec = dict(role=role, rank=r, A=A, F=F, topology=topology, port=port,
                            steps=steps, layers=layers, mode=mode, timeout=timeout,
                            custom_ops=custom_ops, logits=logits, device=device, standin=STANDIN if plugin == "standin" else "")
                children.append({"program": PEER, "env": {"VLLM_PEER_SPEC": json.dumps(spec)}})
        return children

    run = TimedRun(runner, timeout_s=60)
    children, results = proc_util.run_on_free_ports(F, make, run)
    took = run.took
    report = "\n----\n".join(f"[{c['env']['VLLM_PEER_SPEC']}] rc={r['rc']} "
                             f"timed_out={r['timed_out']}\n{r['output']}"
                             for c, r in zip(children, results))
    return results, took, report


PLUGINS = ["standin", pytest.param("real", marks=pytest.mark.skipif(
    not REAL_PLUGIN, reason="afd_plugin (with vLLM) is not importable here"))]


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("A,F,topology,custom_ops", [
    (2, 2, "subgroup", "always"), (4, 2, "subgroup", "auto"),
    (2, 2, "all_to_all", "auto"), (4, 2, "all_to_all", "always")])
def test_contract_over_processes(runner, A, F, topology, custom_ops, plugin):
    """custom_ops="always": every send/receive through torch.ops.stepmesh (the
    peers count the kernel calls); "auto": eager calls skip the dispatcher."""
    results, _, report = run_mesh(runner, A, F, topology, plugin=plugin, custom_ops=custom_ops)
    for i, r in enumerate(results):
        assert r["rc"] == 0 and " ok" in r["output"], report
    assert sum("] ok" in r["output"] for r in results) == A + F, report


@pytest.mark.parametrize("A,F,topology", [(2, 1, "subgroup"), (2, 2, "all_to_all")])
def test_the_common_case_is_one_binding_call(runner, A, F, topology):
    """No router logits, hidden states computed in send_buffer(s), outputs
    received in recv_buffer(s): send and receive are the lanes' one binding
    call each (python/src/attention_lanes.h), bytes checked as everywhere;
    the attention peers count the calls that took the Python path (only the
    other layer's copies), and the registered buffer with a wrong row count,
    stage, dtype, logits or a stage pending gets the Python path's error and
    changes nothing."""
    results, _, report = run_mesh(runner, A, F, topology, logits=False)
    for r in results:
        assert r["rc"] == 0 and " ok" in r["output"], report
    assert sum("] ok" in r["output"] for r in results) == A + F, report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: backend=cuda, CUDA tensors")
@pytest.mark.parametrize("A,F,topology,logits", [(2, 2, "subgroup", True),
                                                 (2, 2, "all_to_all", False)])
def test_contract_with_cuda_tensors(runner, A, F, topology, logits):
    """The contract on backend=cuda, every tensor on cuda:0 (all ranks on one
    GPU): outputs back on the caller's device, bytes against numpy; the calls
    are stream-ordered, so every one takes the Python path (the peers count
    them). Needs a _stepmesh built for the GPU host's python (docs/cuda.md)."""
    results, _, report = run_mesh(runner, A, F, topology, logits=logits, device="cuda")
    for r in results:
        assert r["rc"] == 0 and " ok" in r["output"], report
    assert sum("] ok" in r["output"] for r in results) == A + F, report


@pytest.mark.parametrize("mode,logits", [("lost", True), ("hung", True), ("lost", False)])
def test_lost_ffn_rank_is_named_within_the_timeout(runner, mode, logits):
    """FFN rank 1 killed (its connections close) or stopped (silent: the
    library's peer-silence deadline, options.timeout) at the start of step 1;
    without logits the in-place layer's receive fails in the lanes' call."""
    timeout = 5.0 if mode == "lost" else 2.0
    results, took, report = run_mesh(runner, 2, 2, "all_to_all", mode=mode, timeout=timeout,
                                     logits=logits)
    ffn0, ffn1, att0, att1 = results
    assert ffn1["rc"] == -signal.SIGKILL, report
    for r in (ffn0, att0, att1):
        assert r["rc"] == 0, report
    for r in (att0, att1):  # the peer program asserts "FFN rank 1" in the error, in time
        assert "lost detected" in r["output"] and "FFN rank 1" in r["output"], report
    assert took < 4 * timeout, report


@pytest.mark.skipif(REAL_PLUGIN, reason="afd_plugin is importable: no fallback base here")
def test_own_base_without_the_plugin(runner):
    spec = dict(role="attention", rank=0, A=1, F=1, topology="subgroup", port=0, steps=0,
                layers=0, mode="fallback", timeout=1.0, standin="")
    (r,) = runner([{"program": PEER, "env": {"VLLM_PEER_SPEC": json.dumps(spec)}}])
    assert r["rc"] == 0 and "fallback ok" in r["output"], r["output"]


GRAPH_PEER = os.path.join(HERE, "programs", "vllm_graph_peer.py")


def run_graph_mesh(runner, A, F, topology, replays=100, mode="normal", device="cpu", eager=0,
                   enforce_eager=False, timeout_s=120):
    """vllm_graph_peer.py's mesh: F FFN ranks, then A attention ranks."""
    def make(port):
        children = []
        for role, n in (("ffn", F), ("attention", A)):
            for r in range(n):
                spec = dict(role=role, rank=r, A=A, F=F, topology=topology, port=port,
                            replays=replays, standin=STANDIN, mode=mode, device=device,
                            eager=eager, enforce_eager=enforce_eager)
                children.append({"program": GRAPH_PEER,
                                 "env": {"VLLM_GRAPH_SPEC": json.dumps(spec)}})
        return children

    run = TimedRun(runner, timeout_s=timeout_s)
    children, results = proc_util.run_on_free_ports(F, make, run)
    report = "\n----\n".join(f"[{c['env']['VLLM_GRAPH_SPEC']}] rc={r['rc']}\n{r['output']}"
                             for c, r in zip(children, results))
    return results, run.took, report


def check_graph_run(results, F, replays, eager, report):
    for r in results:
        assert r["rc"] == 0 and "] ok" in r["output"], report
    for r in results[:F]:
        assert f"batches {(replays + eager) * 4}" in r["output"], report
    for r in results[F:]:
        assert f"replays {replays} posts {replays * 4}" in r["output"], report


@pytest.mark.parametrize("A,F,topology,enforce_eager", [
    (2, 1, "subgroup", False), (2, 2, "all_to_all", False), (2, 1, "subgroup", True)])
def test_graph_capture_replays_post_every_send(runner, A, F, topology, enforce_eager):
    """Graph mode on cpu_mock: one captured step (2 layers x 2 stages of
    send + receive), replayed 100 times; every replay's outputs checked against
    numpy, and every FFN rank serves 100 x 4 batches. With the sends posted
    from host code at capture (the ops' old path) a replay sends nothing; with
    the trigger made inside the capture (an allocation, which CUDA and now
    cpu_mock refuse while capturing) the capture breaks. The trigger comes from
    init_afd_connector(), or with enforce_eager from graph_capture()."""
    results, _, report = run_graph_mesh(runner, A, F, topology, enforce_eager=enforce_eager)
    check_graph_run(results, F, 100, 0, report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: torch.cuda.graph")
@pytest.mark.parametrize("A,F,topology", [(2, 1, "subgroup"), (2, 2, "all_to_all")])
def test_cuda_graph_capture_replays_100_times(runner, A, F, topology):
    """The same on backend=cuda with CUDA tensors: 20 eager steps, then one
    torch.cuda.graph capture (torch's default, global mode) of the step's send
    and receive ops and 100 replays, bytes checked after each. The attention
    peers print the eager step's and the replay's median time (docs/cuda.md).
    Needs a _stepmesh built for the GPU host's python (docs/cuda.md)."""
    results, _, report = run_graph_mesh(runner, A, F, topology, device="cuda", eager=20,
                                        timeout_s=90)
    check_graph_run(results, F, 100, 20, report)
    for r in results[F:]:
        print(next(line for line in r["output"].splitlines() if "step_us" in line))


def test_graph_replay_send_to_a_lost_ffn_rank_is_raised_by_the_next_host_call(runner):
    """FFN rank 1 killed at replay 10's control payload (2A2F all_to_all, graph
    mode): the replay's sends fail on the trigger's thread, the replay is
    released (not hung), and the next host call raises naming FFN rank 1."""
    results, took, report = run_graph_mesh(runner, 2, 2, "all_to_all", mode="lost",
                                           timeout_s=60)
    ffn0, ffn1, att0, att1 = results
    assert ffn1["rc"] == -signal.SIGKILL, report
    for r in (ffn0, att0, att1):
        assert r["rc"] == 0 and "] ok" in r["output"], report
    for r in (att0, att1):
        assert "lost detected" in r["output"] and "FFN rank 1" in r["output"], report
    assert took < 40, report


def test_a_mesh_whose_port_was_taken_runs_again_on_new_ports(monkeypatch):
    """The mesh tests above pick ports with free_port_run and bind them later:
    one taken in between (a test beside them, an ephemeral port) made the run
    fail with "Address already in use" (ctest -j2). run_on_free_ports runs it
    again on new ports; a run that keeps failing is returned as it is."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    offered = [taken.getsockname()[1]]  # the first port offered is already bound
    real = proc_util.free_port_run
    monkeypatch.setattr(proc_util, "free_port_run",
                        lambda n: offered.pop() if offered else real(n))

    def run(children):  # a child that binds its port, as the scheduler does
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", children[0]))
            return [{"output": "bound"}]
        except OSError as e:
            return [{"output": f"bind: {e.strerror}"}]
        finally:
            s.close()

    try:
        children, results = proc_util.run_on_free_ports(1, lambda port: [port], run)
        assert results == [{"output": "bound"}]
        assert children[0] != taken.getsockname()[1]
        # Every port taken: the last attempt's failure comes back, after 3 runs.
        runs = []
        monkeypatch.setattr(proc_util, "free_port_run", lambda n: taken.getsockname()[1])
        _, results = proc_util.run_on_free_ports(
            1, lambda port: [port], lambda ch: (runs.append(ch), run(ch))[1])
        assert len(runs) == 3 and "Address already in use" in results[0]["output"]
    finally:
        taken.close()
