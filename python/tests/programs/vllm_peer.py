"""One rank of the StepMeshAFDConnector contract suite, run as a child of
fork_runner.py (torch imported once in the parent). The spec is the JSON in
VLLM_PEER_SPEC: role, rank, A, F, topology, port, steps, layers, mode
("normal", "lost": FFN rank 1 killed, "hung": FFN rank 1 stopped, or
"fallback"), logits (false: no router logits configured, and layer 1 sent and
received in the registered buffers: the lanes' one-call common case), device
("cpu", the default, on cpu_mock; "cuda": backend=cuda, every tensor on cuda:0, outputs checked
to come back there; GPU hosts only), standin (a path put first on sys.path so
`afd_plugin` is the stand-in; empty: whatever is importable).

Both sides derive every tensor from (step, layer, stage, attention rank) with
a seeded generator, small integers so bf16 holds every value and every sum
exactly: the FFN checks the bytes it got, the attention side checks its output
against a numpy reference of the FFN function (summed over FFN ranks for
all_to_all)."""
import json
import os
import signal
import sys
import time
import types

SPEC = json.loads(os.environ["VLLM_PEER_SPEC"])
if SPEC.get("standin"):
    sys.path.insert(0, SPEC["standin"])

import numpy as np  # noqa: E402
import torch  # noqa: E402

import stepmesh.vllm as sv  # noqa: E402

ROLE, RANK, A, F = SPEC["role"], SPEC["rank"], SPEC["A"], SPEC["F"]
TOPO, STEPS, LAYERS = SPEC["topology"], SPEC["steps"], SPEC["layers"]
H, MAX, STAGES, WIDTH = 16, 12, 2, 8
BF16 = torch.bfloat16
RATIO = A // F if TOPO == "subgroup" else A
LOGITS = SPEC.get("logits", True)
# cuda:0, not "cuda": a tensor's device has its index, and torch.device("cuda") != it.
DEVICE = torch.device("cuda", 0) if SPEC.get("device") == "cuda" else torch.device("cpu")
IN_PLACE_LAYER = 1  # sent from send_buffer(s) (and, without logits, received in recv_buffer(s))


def log(*a):
    print(f"[{ROLE} {RANK}]", *a, flush=True)


def count(step, stage, a):
    """Tokens attention rank a has in (step, stage) per the DP metadata; 0 = idle."""
    if (step + a + stage) % 4 == 3:
        return 0
    return 1 + (step * 7 + stage * 5 + a * 11) % MAX


def sent(step, stage, a):
    return max(1, count(step, stage, a))  # an idle rank sends one dummy token


def data(step, layer, stage, a):
    g = torch.Generator().manual_seed(((step * 31 + layer) * 7 + stage) * 101 + a)
    n = sent(step, stage, a)
    x = torch.randint(-8, 9, (n, H), generator=g).to(BF16)
    logits = torch.randint(-4, 5, (n, WIDTH), generator=g).to(BF16)
    return x.to(DEVICE), logits.to(DEVICE)


CAPTURE_STEP = 2  # the attention ranks capture a graph: nothing is sent, the FFN gets dummies


def flags(step):
    return {"is_warmup": step == 0, "is_graph_capturing": step == CAPTURE_STEP}


def ffn_fn(x, logits, f):
    """What FFN rank f returns: integers, exact in bf16."""
    return 2 * x + (f + 1) + (logits[:, :1] if LOGITS else 0)


def vllm_config():
    extra = {"topology": TOPO, "transport": "tcp",
             "backend": "cuda" if DEVICE.type == "cuda" else "cpu_mock", "max_tokens": MAX,
             "num_stages": STAGES, "router_logits_width": WIDTH if LOGITS else 0, "timeout": SPEC["timeout"],
             "poll_mode": "blocking", "custom_ops": SPEC.get("custom_ops", "auto")}
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(hidden_size=H),
                                           dtype=BF16, enforce_eager=True),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4096),
        parallel_config=types.SimpleNamespace(  # role_rank = DP rank (TP 1, PCP 1)
            data_parallel_rank=RANK, data_parallel_size=A if ROLE == "attention" else F,
            tensor_parallel_size=1, prefill_context_parallel_size=1),
        compilation_config=None,
        additional_config={"afd": {"connector": sv.NAME, "connector_extra_config": extra}})


def make_connector():
    if sv.PLUGIN_BASE:
        from afd_plugin.config import AFDConfig
        from afd_plugin.connectors.factory import AFDConnectorFactory
        assert sv.register() and sv.register()  # idempotent
        cfg = AFDConfig(connector=sv.NAME, role=ROLE, host="127.0.0.1", port=SPEC["port"],
                        num_attention_ranks=A, num_ffn_ranks=F)
        conn = AFDConnectorFactory.create_connector(RANK, 0, vllm_config(), cfg)
        from afd_plugin.connectors.base import AFDConnectorBase
        assert isinstance(conn, AFDConnectorBase)
    else:
        cfg = types.SimpleNamespace(connector=sv.NAME, role=ROLE, host="127.0.0.1",
                                    port=SPEC["port"], num_attention_ranks=A, num_ffn_ranks=F)
        conn = sv.StepMeshAFDConnector(RANK, 0, vllm_config(), cfg, RANK)
    assert conn.attn_size == A and conn.ffn_size == F
    assert conn.control_plane is not None
    return conn


def expect_error(kind, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        for w in words:
            assert w in str(e), f"{kind.__name__} without {w!r}: {e}"
        return
    raise AssertionError(f"{fn.__name__} raised no {kind.__name__}")


def payload(step):
    dp = {s: sv.AFDDPMetadata(num_tokens_across_dp_cpu=torch.tensor(
        [count(step, s, a) for a in range(A)], dtype=torch.int32)) for s in range(STAGES)}
    return sv.AFDControlPayload(dp_metadata_list=dp, **flags(step))


def attention(conn):
    cp = conn.control_plane
    for step in range(STEPS):
        t0 = time.monotonic()
        try:
            attention_step(conn, cp, step)
        except (ConnectionError, TimeoutError) as e:
            if SPEC["mode"] in ("lost", "hung") and step >= 1:
                took = time.monotonic() - t0
                assert "FFN rank 1" in str(e), e
                assert took < SPEC["timeout"] * 1.5, took
                log(f"lost detected in {took:.3f}s: {e}")
                return
            raise
    if SPEC["mode"] in ("lost", "hung"):
        raise AssertionError("the lost FFN rank was not detected")


def attention_step(conn, cp, step):
    Ctx, Meta = sv.AFDTransferContext, sv.AFDTransferMetadata
    cp.update_state_from_dp_metadata(payload(step))
    cp.send_dp_metadata_list(payload(step))
    if step == CAPTURE_STEP:
        # As vLLM's capture step: the payload says capturing, the forward's sends
        # and receives are captured (nothing posted: see vllm_graph_peer.py). An
        # eager send now is refused, naming the reason, and changes nothing.
        x, logits = data(step, 0, 0, RANK)
        ctx = Ctx(metadata=Meta(layer_idx=0, stage_idx=0, seq_lens=[len(x)]))
        kw = {"router_logits": logits} if LOGITS else {}
        expect_error(RuntimeError, ["graph capture", "is_graph_capturing"],
                     conn.send_attn_output, x, ctx, **kw)
        if not LOGITS:  # the registered buffer (the lanes' case) is refused the same way
            buf = conn.send_buffer(0)[: len(x)]
            expect_error(RuntimeError, ["graph capture"], conn.send_attn_output, buf, ctx)
        expect_error(RuntimeError, ["stage 0", "no send_attn_output"],
                     conn.recv_ffn_output, x, 0)
        return
    for layer in range(LAYERS):
        sent_x = []
        for s in range(STAGES):
            x, logits = data(step, layer, s, RANK)
            if step == 0 and layer == 0 and s == 0 and RANK == 0:
                ctx = Ctx(metadata=Meta(layer_idx=layer, stage_idx=s, seq_lens=[len(x)]))
                expect_error(ValueError, ["hidden_states", "total_tokens"],
                             conn.send_attn_output, torch.cat([x, x]), ctx)
                expect_error(ValueError, ["hidden_states", "dtype"],
                             conn.send_attn_output, x.float(), ctx)
                expect_error(ValueError, ["router_logits"], conn.send_attn_output, x, ctx,
                             router_logits=logits[:-1] if len(x) > 1 else
                             torch.cat([logits, logits]))
                bad = Ctx(metadata=Meta(layer_idx=0, stage_idx=STAGES, seq_lens=[len(x)]))
                expect_error(ValueError, ["stage_idx"], conn.send_attn_output, x, bad)
                try:
                    Meta(layer_idx=0, stage_idx=0, seq_lens=[0])
                    raise AssertionError("seq_lens=[0] accepted")
                except ValueError:
                    pass
                expect_error(RuntimeError, ["stage 0", "no send_attn_output"],
                             conn.recv_ffn_output, x, 0)
            ctx = Ctx(metadata=Meta(layer_idx=layer, stage_idx=s, seq_lens=[len(x)]))
            kw = {"router_logits": logits} if LOGITS else {}
            if layer == IN_PLACE_LAYER and (s == 0 or not LOGITS):
                # computed in the registered buffer: sent without a copy
                buf = conn.send_buffer(s)[: len(x)]
                buf.copy_(x)
                if not LOGITS and step == 0 and s == 0 and RANK == 0:
                    declined_sends(conn, x, ctx)
                conn.send_attn_output(buf, ctx, **kw)
                if not LOGITS and step == 0 and s == 0 and RANK == 0:
                    expect_error(RuntimeError, ["stage 0", "pending"], conn.send_attn_output,
                                 buf, ctx)
            else:
                conn.send_attn_output(x, ctx, **kw)
            sent_x.append((x, logits))
        for s in range(STAGES):
            x, logits = sent_x[s]
            # before x is overwritten
            xs, ls = x.float().cpu().numpy().copy(), logits.float().cpu().numpy()
            ref = x  # the runner passes the tensor it sent as ref_tensor
            in_place = layer == IN_PLACE_LAYER and (s == 0 or not LOGITS)
            if in_place:  # or received in place
                ref = conn.recv_buffer(s)[: len(x)]
            ptr = ref.data_ptr()
            if step == 0 and layer == 0 and s == 0:
                expect_error(ValueError, ["ref_tensor"], conn.recv_ffn_output,
                             torch.empty(len(x) + 1, H, dtype=BF16, device=DEVICE), s)
            if step == 0 and in_place and s == 0 and not LOGITS:  # the lanes decline these
                other = len(x) - 1 if len(x) > 1 else 2
                expect_error(ValueError, ["ref_tensor"], conn.recv_ffn_output,
                             conn.recv_buffer(0)[:other], 0)
                expect_error(ValueError, ["ref_tensor", "float16"], conn.recv_ffn_output,
                             conn.recv_buffer(0)[: len(x)].view(torch.float16), 0)
            keep = s == 0 or in_place
            out = conn.recv_ffn_output(ref_tensor=ref if keep else None, ubatch_idx=s)
            if keep:
                assert out.data_ptr() == ptr and out is ref, "ref_tensor storage not reused"
            fs = [RANK // RATIO] if TOPO == "subgroup" else range(F)
            want = sum(2 * xs + (f + 1) + (ls[:, :1] if LOGITS else 0) for f in fs)
            got = out.float().cpu().numpy()
            assert out.dtype == BF16 and got.shape == want.shape, (out.dtype, got.shape)
            assert out.device == DEVICE, out.device  # on the caller's device
            np.testing.assert_array_equal(got, want)


def declined_sends(conn, x, ctx):
    """The registered buffer, but not the common case: the lanes decline, the
    Python path raises its error, and nothing changed (the send after works)."""
    Ctx, Meta = sv.AFDTransferContext, sv.AFDTransferMetadata
    n = len(x)
    other = n - 1 if n > 1 else 2
    expect_error(ValueError, ["hidden_states", "total_tokens"], conn.send_attn_output,
                 conn.send_buffer(0)[:other], ctx)
    bad = Ctx(metadata=Meta(layer_idx=IN_PLACE_LAYER, stage_idx=STAGES, seq_lens=[n]))
    expect_error(ValueError, ["stage_idx"], conn.send_attn_output, conn.send_buffer(0)[:n], bad)
    expect_error(ValueError, ["hidden_states", "dtype"], conn.send_attn_output,
                 conn.send_buffer(0)[:n].view(torch.float16), ctx)
    expect_error(ValueError, ["router_logits", "router_logits_width=0"],
                 conn.send_attn_output, conn.send_buffer(0)[:n], ctx,
                 router_logits=torch.zeros(n, WIDTH, dtype=BF16, device=DEVICE))


def count_python_path(conn):
    """Counts the connector's Python-path sends and receives (instance
    attributes shadow the methods)."""
    calls = {"send": 0, "recv": 0}
    send, recv = conn._send, conn._recv

    def counted_send(*a, **k):
        calls["send"] += 1
        return send(*a, **k)

    def counted_recv(*a, **k):
        calls["recv"] += 1
        return recv(*a, **k)

    conn._send, conn._recv = counted_send, counted_recv
    return calls


def ffn(conn):
    cp = conn.control_plane
    served = list(range(RANK * RATIO, (RANK + 1) * RATIO)) if TOPO == "subgroup" else list(range(A))
    spec = sv.AFDExpertRoutingSpec(router_logits_width=WIDTH, router_logits_dtype=BF16)
    routing = {"routing_spec": spec} if LOGITS else {}
    for step in range(STEPS):
        try:
            p = cp.recv_dp_metadata_list()
        except (ConnectionError, TimeoutError) as e:
            if SPEC["mode"] in ("lost", "hung") and step >= 1:
                log(f"attention ranks gone: {e}")
                return
            raise
        if SPEC["mode"] in ("lost", "hung") and RANK == 1 and step == 1:
            # Step 1's payload comes after the attention ranks received all of
            # step 0: dying (or hanging) now leaves no step 0 request behind.
            me = os.getpid()
            if SPEC["mode"] == "hung" and os.fork() == 0:  # ends the hang later (sleep, kill only)
                time.sleep(2 * SPEC["timeout"])
                os.kill(me, signal.SIGKILL)
                os._exit(0)
            log("dying" if SPEC["mode"] == "lost" else "hanging")
            os.kill(me, signal.SIGKILL if SPEC["mode"] == "lost" else signal.SIGSTOP)
        assert isinstance(p, sv.AFDControlPayload)
        assert p.is_warmup == flags(step)["is_warmup"], (step, p)
        assert p.is_graph_capturing == flags(step)["is_graph_capturing"], (step, p)
        assert sorted(p.dp_metadata_list) == list(range(STAGES))
        for s, dp in p.dp_metadata_list.items():
            assert dp.num_tokens_across_dp_cpu.dtype == torch.int32
            assert dp.num_tokens_across_dp_cpu.tolist() == [count(step, s, a) for a in range(A)]
        cp.update_state_from_dp_metadata(p)
        try:
            for layer in range(LAYERS):
                for s in reversed(range(STAGES)):  # out of order: stage 0 is kept meanwhile
                    got = conn.recv_attn_output(ubatch_idx=s, **routing)
                    assert isinstance(got, sv.AFDA2FTransferPayload)
                    md = got.context.metadata
                    st = got.context.states
                    assert isinstance(st, sv.AFDTransferState)
                    if step == CAPTURE_STEP:  # nothing was sent: a dummy of the announced shape
                        check_capture_step(conn, cp, got, s, served, routing)
                        continue
                    assert (st.is_warmup, st.is_graph_capturing) == \
                        (flags(step)["is_warmup"], flags(step)["is_graph_capturing"]), st
                    assert md.layer_idx == layer and md.stage_idx == s
                    assert md.seq_lens == [sent(step, s, a) for a in served], md.seq_lens
                    assert md.seq_lens == [cp.expected_tokens(s, a) for a in served]
                    want = [data(step, layer, s, a) for a in served]
                    assert got.hidden_states.device == DEVICE, got.hidden_states.device
                    assert torch.equal(got.hidden_states, torch.cat([w[0] for w in want]))
                    lg = got.router_logits
                    if LOGITS:
                        assert lg.dtype == BF16 and lg.shape == (md.total_tokens, WIDTH), lg.shape
                        assert torch.equal(lg, torch.cat([w[1] for w in want]))
                    else:
                        assert lg is None, lg
                    out = ffn_fn(got.hidden_states, lg, RANK)
                    if step == 0 and layer == 0:
                        expect_error(ValueError, ["ffn_output", "total_tokens"],
                                     conn.send_ffn_output, out[:-1] if len(out) > 1 else
                                     torch.cat([out, out]), got.context)
                    conn.send_ffn_output(out, got.context)
                    if step == 0 and layer == 0:
                        expect_error(RuntimeError, ["already answered"], conn.send_ffn_output,
                                     out, got.context)
        except (ConnectionError, TimeoutError) as e:
            if SPEC["mode"] in ("lost", "hung") and step >= 1:
                log(f"peer gone: {e}")
                return
            raise


def check_capture_step(conn, cp, got, s, served, routing):
    """recv_attn_output in a capture step returned at once (nothing waited
    for) with the token counts the payload announced; send_ffn_output of it
    sends nothing (a real batch would be answered out of order otherwise)."""
    md, st = got.context.metadata, got.context.states
    assert st.is_graph_capturing and md.stage_idx == s, (st, md)
    assert md.seq_lens == [cp.expected_tokens(s, a) for a in served], md.seq_lens
    assert tuple(got.hidden_states.shape) == (md.total_tokens, H), got.hidden_states.shape
    assert got.hidden_states.device == DEVICE and got.hidden_states.dtype == BF16
    if routing:
        assert tuple(got.router_logits.shape) == (md.total_tokens, WIDTH)
        assert got.router_logits.dtype == BF16
    else:
        assert got.router_logits is None
    # The stage's gather rows, not the receive region the next step's data lands in.
    assert got.hidden_states.data_ptr() == conn._gathers[s].data_ptr()
    out = ffn_fn(got.hidden_states, got.router_logits, RANK)
    conn.send_ffn_output(out, got.context)
    expect_error(RuntimeError, ["already answered"], conn.send_ffn_output, out, got.context)


def main():
    if SPEC["mode"] == "fallback":  # no afd_plugin importable: our own base
        assert not sv.PLUGIN_BASE
        assert not sv.register()
        assert issubclass(sv.StepMeshAFDConnector, sv.AFDConnectorBase)
        log("fallback ok")
        return
    assert sv.PLUGIN_BASE, "the stand-in (or the plugin) should be importable here"
    conn = make_connector()
    assert not conn.is_initialized
    x = torch.zeros(1, H, dtype=BF16, device=DEVICE)
    ctx = sv.AFDTransferContext(metadata=sv.AFDTransferMetadata(0, 0, [1]))
    expect_error(RuntimeError, ["not initialised"], conn.send_attn_output, x, ctx)
    expect_error(RuntimeError, ["not initialised"], conn.recv_attn_output, 0)
    conn.init_afd_connector()
    conn.init_afd_connector()  # idempotent
    assert conn.is_initialized
    python_path = count_python_path(conn) if ROLE == "attention" else None
    (attention if ROLE == "attention" else ffn)(conn)
    if ROLE == "attention" and SPEC["mode"] == "normal":  # the data path took the ops, or not
        # The capture step sends nothing; its refused eager sends (1, or 2
        # without logits) reach the Python path's post, which refuses them.
        data_steps = STEPS - (1 if STEPS > CAPTURE_STEP else 0)
        refused = (1 if LOGITS else 2) if STEPS > CAPTURE_STEP else 0
        calls = data_steps * LAYERS * STAGES
        always = SPEC.get("custom_ops") == "always"
        assert sv.OP_CALLS["afd_send_attn"] == (calls + refused if always else 0), sv.OP_CALLS
        assert sv.OP_CALLS["afd_recv_ffn"] == (calls if always else 0), sv.OP_CALLS
        # The in-place calls are the lanes' (one binding call each) unless
        # every call goes through the ops: the receives in recv_buffer(s), the
        # sends from send_buffer(s) without logits; the rest the Python path's.
        total = calls
        lanes = (not always and LAYERS > IN_PLACE_LAYER
                 and DEVICE.type == "cpu")  # CUDA calls are stream-ordered: the Python path
        in_place = data_steps * (STAGES if not LOGITS else 1) if lanes else 0
        want = {"send": total - (in_place if not LOGITS else 0) + refused,
                "recv": total - in_place}
        assert python_path == want, (python_path, want)
    if ROLE == "ffn" and SPEC["mode"] == "normal":  # the FFN side's send, likewise
        calls = STEPS * LAYERS * STAGES
        want = calls if SPEC.get("custom_ops") == "always" else 0
        assert sv.OP_CALLS["afd_send_ffn"] == want, (sv.OP_CALLS, want)
        assert not conn._ffn_contexts, "contexts left pending"
    conn.close()
    conn.close()
    assert not conn.is_initialized
    expect_error(RuntimeError, ["not initialised"], conn.send_attn_output, x, ctx)
    log("ok")


main()
