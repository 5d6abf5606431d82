"""One rank of the StepMeshAFDConnector graph-mode test, a child of
fork_runner.py. The attention ranks capture one step (LAYERS layers x STAGES
stages of send_attn_output + recv_ffn_output, layer 1 sending what layer 0
received) on cpu_mock's model of a CUDA graph, then replay it REPLAYS times,
writing each replay's inputs into the captured input tensors between replays
(as vLLM does) and checking every replay's outputs against a numpy reference.
The FFN ranks run their usual host loop and check every batch's bytes and
layer index; each reports how many batches it served.
VLLM_GRAPH_SPEC: role, rank, A, F, topology, port, replays, standin, mode
("normal", or "lost": FFN rank 1 kills itself when replay LOST_AT's control
payload arrives; the attention ranks' replay LOST_AT is released, not hung,
and their next host call raises naming FFN rank 1), device ("cpu": cpu_mock
and graph_capture(), the default; "cuda": backend=cuda, CUDA tensors, one
torch.cuda.graph capture in torch's default global mode, as vLLM's), eager
(steps run eagerly before the capture, default 0; the attention ranks then
print the median eager step and replay times, "step_us"), enforce_eager
(model_config's, default False: the trigger is made at init; True on cpu_mock:
by graph_capture())."""
import json
import os
import signal
import sys
import time
import types

SPEC = json.loads(os.environ["VLLM_GRAPH_SPEC"])
sys.path.insert(0, SPEC["standin"])

import numpy as np  # noqa: E402
import torch  # noqa: E402

import stepmesh.vllm as sv  # noqa: E402

ROLE, RANK, A, F = SPEC["role"], SPEC["rank"], SPEC["A"], SPEC["F"]
TOPO, REPLAYS = SPEC["topology"], SPEC["replays"]
H, MAX, STAGES, WIDTH, LAYERS = 16, 12, 2, 8, 2
BF16 = torch.bfloat16
RATIO = A // F if TOPO == "subgroup" else A
MODE = SPEC.get("mode", "normal")
# cuda:0, not "cuda": a tensor's device has its index, and torch.device("cuda") != it.
DEVICE = torch.device("cuda", 0) if SPEC.get("device") == "cuda" else torch.device("cpu")
EAGER = SPEC.get("eager", 0)
assert MODE == "normal" or (EAGER == 0 and DEVICE.type == "cpu"), SPEC
LOST_AT = 10
TIMEOUT = 5.0 if MODE == "lost" else 10.0


def log(*a):
    print(f"[{ROLE} {RANK}]", *a, flush=True)


def tokens(stage, a):
    """Fixed per (stage, rank): a captured graph is for one batch shape."""
    return 1 + (stage * 5 + a * 3) % MAX


def inputs(replay, stage, a):
    g = torch.Generator().manual_seed((replay * 7 + stage) * 101 + a)
    n = tokens(stage, a)
    return (torch.randint(-8, 9, (n, H), generator=g).to(BF16),
            torch.randint(-4, 5, (n, WIDTH), generator=g).to(BF16))


def ffn_fn(x, logits, f):
    return 2 * x + (f + 1) + logits[:, :1]


def ffn_ranks_of(a):
    return [a // RATIO] if TOPO == "subgroup" else list(range(F))


def reference(replay, stage, a):
    """Layer 0's and layer 1's outputs (layer 1 sends layer 0's output)."""
    x, lg = inputs(replay, stage, a)
    xs, ls = x.float().numpy(), lg.float().numpy()
    out0 = sum(2 * xs + (f + 1) + ls[:, :1] for f in ffn_ranks_of(a))
    out1 = sum(2 * out0 + (f + 1) + ls[:, :1] for f in ffn_ranks_of(a))
    return out0, out1


def connector():
    extra = {"topology": TOPO, "transport": "tcp",
             "backend": "cuda" if DEVICE.type == "cuda" else "cpu_mock", "max_tokens": MAX,
             "num_stages": STAGES, "router_logits_width": WIDTH, "timeout": TIMEOUT,
             "poll_mode": "blocking"}
    # The FFN side runs eagerly (on CUDA init refuses it otherwise).
    eager = ROLE == "ffn" or SPEC.get("enforce_eager", False)
    vcfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(hidden_size=H),
                                           dtype=BF16, enforce_eager=eager),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4096),
        compilation_config=types.SimpleNamespace(cudagraph_mode="FULL"),
        additional_config={"afd": {"connector": sv.NAME, "connector_extra_config": extra}})
    cfg = types.SimpleNamespace(connector=sv.NAME, role=ROLE, host="127.0.0.1",
                                port=SPEC["port"], num_attention_ranks=A, num_ffn_ranks=F)
    return sv.StepMeshAFDConnector(RANK, 0, vcfg, cfg, RANK)


def payload(capturing=False):
    dp = {s: sv.AFDDPMetadata(num_tokens_across_dp_cpu=torch.tensor(
        [tokens(s, a) for a in range(A)], dtype=torch.int32)) for s in range(STAGES)}
    return sv.AFDControlPayload(dp_metadata_list=dp, is_graph_capturing=capturing,
                                is_warmup=False)


def publish(cp, p):
    """What the plugin's attention runner does before every forward."""
    cp.update_state_from_dp_metadata(p)
    cp.send_dp_metadata_list(p)


def attention(conn):
    Ctx, Meta = sv.AFDTransferContext, sv.AFDTransferMetadata
    cp = conn.control_plane
    # Static buffers, as a captured model has: inputs, logits, per-layer outputs.
    x_in = [inputs(0, s, RANK)[0].to(DEVICE) for s in range(STAGES)]
    lg_in = [inputs(0, s, RANK)[1].to(DEVICE) for s in range(STAGES)]
    outs = [[torch.zeros(tokens(s, RANK), H, dtype=BF16, device=DEVICE) for s in range(STAGES)]
            for _ in range(LAYERS)]

    def step():  # one decode step's sends and receives, as the model's forward makes them
        for layer in range(LAYERS):
            for s in range(STAGES):
                src = x_in[s] if layer == 0 else outs[layer - 1][s]
                ctx = Ctx(metadata=Meta(layer_idx=layer, stage_idx=s, seq_lens=[tokens(s, RANK)]))
                conn.send_attn_output(src, ctx, router_logits=lg_in[s])
            for s in range(STAGES):
                out = conn.recv_ffn_output(outs[layer][s], ubatch_idx=s)
                assert out is outs[layer][s]

    def load_inputs(r):  # step r's inputs into the static tensors
        for s in range(STAGES):
            x, lg = inputs(r, s, RANK)
            x_in[s].copy_(x)
            lg_in[s].copy_(lg)
            for layer in range(LAYERS):
                outs[layer][s].fill_(-99)

    def check(r):
        for s in range(STAGES):
            want0, want1 = reference(r, s, RANK)
            np.testing.assert_array_equal(outs[0][s].float().cpu().numpy(), want0, f"step {r}")
            np.testing.assert_array_equal(outs[1][s].float().cpu().numpy(), want1, f"step {r}")

    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    eager_us = []
    for r in range(EAGER):  # vLLM runs eagerly (warm-up) before it captures
        publish(cp, payload())
        load_inputs(r)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        eager_us.append((time.perf_counter() - t0) * 1e6)
        check(r)
    # As the plugin: the capture step's payload (is_graph_capturing) goes out
    # before the capture; the FFN ranks answer that step with dummies, waiting
    # for nothing (the captured sends post nothing).
    publish(cp, payload(capturing=True))
    if DEVICE.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture_error_mode "global", as vLLM's
            step()
        replay = graph.replay
    else:
        with conn.graph_capture() as g:
            step()
        assert len(g.graph) > 0
        replay = g.replay

        def sync():
            g.synchronize(4 * TIMEOUT)  # never hangs: a failed send releases the stream
    assert conn._trigger.posts == 0, "capturing posted a send"
    replay_us = []
    for r in range(EAGER, EAGER + REPLAYS):
        if MODE == "lost" and r == LOST_AT + 1:
            t0 = time.monotonic()
            try:
                publish(cp, payload())
            except ConnectionError as e:  # replay LOST_AT's send failed: raised here
                assert "FFN rank 1" in str(e) and "graph replay" in str(e), e
                log(f"lost detected: {e}")
                assert time.monotonic() - t0 < TIMEOUT
                return
            raise AssertionError("the failed device-triggered send was not raised")
        publish(cp, payload())  # host code per step, as vLLM's runner
        load_inputs(r)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        sync()
        replay_us.append((time.perf_counter() - t0) * 1e6)
        if MODE == "lost" and r >= LOST_AT:
            continue
        check(r)
    if MODE == "lost":
        raise AssertionError("FFN rank 1's loss was not detected")
    posts = conn._trigger.posts
    assert posts == REPLAYS * LAYERS * STAGES, posts
    log(f"replays {REPLAYS} posts {posts}")
    if EAGER:
        log(f"step_us ({LAYERS} layers x {STAGES} stages, {DEVICE.type}): eager p50 "
            f"{np.median(eager_us):.1f} over {EAGER}, replay p50 {np.median(replay_us):.1f} "
            f"p90 {np.percentile(replay_us, 90):.1f} over {REPLAYS}")


def ffn(conn):
    cp = conn.control_plane
    served = list(range(RANK * RATIO, (RANK + 1) * RATIO)) if TOPO == "subgroup" else list(range(A))
    spec = sv.AFDExpertRoutingSpec(router_logits_width=WIDTH, router_logits_dtype=BF16)
    batches = dummies = 0
    # The eager steps, the capture step (its payload says capturing), the replays.
    for r, capturing in [(r, False) for r in range(EAGER)] + [(EAGER, True)] + \
            [(r, False) for r in range(EAGER, EAGER + REPLAYS)]:
        try:
            p = cp.recv_dp_metadata_list()
        except (ConnectionError, TimeoutError) as e:
            if MODE == "lost" and r > LOST_AT:
                log(f"peer gone: {e}")
                return
            raise
        assert p.is_graph_capturing == capturing, (r, p)
        if MODE == "lost" and r == LOST_AT and RANK == 1 and not capturing:
            log("dying")
            os.kill(os.getpid(), signal.SIGKILL)
        cp.update_state_from_dp_metadata(p)
        for layer in range(LAYERS):
            for s in range(STAGES):
                try:
                    t0 = time.monotonic()
                    got = conn.recv_attn_output(ubatch_idx=s, routing_spec=spec)
                except (ConnectionError, TimeoutError) as e:
                    if MODE == "lost" and r >= LOST_AT:
                        log(f"peer gone: {e}")
                        return
                    raise
                md, st = got.context.metadata, got.context.states
                if capturing:  # nothing sent: the announced shape at once, nothing answered
                    assert time.monotonic() - t0 < 1.0, "a capture step's receive waited"
                    assert st.is_graph_capturing and md.seq_lens == [tokens(s, a) for a in served]
                    assert got.hidden_states.shape == (sum(md.seq_lens), H)
                    conn.send_ffn_output(ffn_fn(got.hidden_states, got.router_logits, RANK),
                                         got.context)
                    dummies += 1
                    continue
                # A replay's batch is a decode step's, whatever the capture step's payload said.
                assert not st.is_graph_capturing and not st.is_warmup, (r, st)
                assert md.layer_idx == layer and md.stage_idx == s, (r, md)
                want = []
                for a in served:
                    x, lg = inputs(r, s, a)
                    if layer == 1:
                        x = torch.from_numpy(reference(r, s, a)[0]).to(BF16)
                    want.append((x, lg))
                assert got.hidden_states.device == DEVICE, got.hidden_states.device
                assert torch.equal(got.hidden_states.cpu(), torch.cat([w[0] for w in want])), \
                    f"step {r} layer {layer} stage {s}: wrong hidden states"
                assert torch.equal(got.router_logits.cpu(), torch.cat([w[1] for w in want]))
                conn.send_ffn_output(ffn_fn(got.hidden_states, got.router_logits, RANK),
                                     got.context)
                batches += 1
    assert dummies == LAYERS * STAGES, dummies
    log(f"batches {batches}")


def main():
    conn = connector()
    conn.init_afd_connector()
    (attention if ROLE == "attention" else ffn)(conn)
    conn.close()
    log("ok")


main()
