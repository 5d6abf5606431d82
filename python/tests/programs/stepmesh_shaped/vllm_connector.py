"""StepMesh's vLLM connector (tests/vllm/stepmesh_connector.py), in shape:
the environment is set by the program itself after `import fserver_lib as
ps` (role from the AFD role, DMLC_ENABLE_RDMA, DMLC_INTERFACE=auto,
DMLC_GROUP_SIZE = world size 1, DMLC_NODE_RANK = the server rank), a
SimpleNotify made before init(). Attention: per stage a send buffer and one
receive buffer per FFN server, [max_tokens, hidden] bfloat16; send_attn_output
pushes buffer[:seq_len] under stage + rank * 1e6 and pulls under stage + 1000,
recv_ffn_output waits (timeout_ms=50000) and reads the traces of every
handle. FFN: recv_attn_output concatenates one batch per attention worker,
send_ffn_output copies f(x) into ret_buffer and answers with respond_vec
split by the workers' seq_lens. Each worker checks its own rows."""

import os
import random
from collections import deque

import torch

import fserver_lib as ps

afd_role = os.environ["AFD_ROLE"]  # attention | ffn (what vLLM's config says)
num_attention = int(os.environ["AFD_NUM_ATTENTION"])
rank = int(os.environ["AFD_RANK"])
STEPS = int(os.environ.get("FSERVER_TEST_ITERS", "8"))
STAGES, MAX_TOKENS, HIDDEN = 3, 16, 64

signal = ps.SimpleNotify()
signal.init()
os.environ["DMLC_ROLE"] = "worker" if afd_role == "attention" else "server"
os.environ["DMLC_NUM_WORKER"] = str(num_attention)
os.environ["DMLC_NUM_SERVER"] = "1"
os.environ["DMLC_ENABLE_RDMA"] = "zmq"  # the connector's ibverbs, on a host without RDMA
os.environ["DMLC_INTERFACE"] = "auto"
os.environ["STEPMESH_SPLIT_QP_LAG"] = "0"
os.environ["STEPMESH_BIND_CPU_CORE"] = "0"
os.environ["STEPMESH_GPU"] = "0"
os.environ["DMLC_NODE_HOST"] = "127.0.0.1"
os.environ["DMLC_NODE_RANK"] = str(rank if afd_role == "attention" else 0)
os.environ["DMLC_GROUP_SIZE"] = "1"
ps.init()


def ffn(x):
    return x * 2 + 1


if afd_role == "attention":
    rng = random.Random(rank)
    send_buffer = [torch.zeros(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16) for _ in range(STAGES)]
    recv_buffer = [[torch.zeros(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16)] for _ in range(STAGES)]
    events = deque(maxlen=STAGES)
    for step in range(STEPS):
        for stage in range(STAGES):  # send_attn_output for every stage, then the receives
            seq_len = MAX_TOKENS if step == 0 else rng.randint(1, MAX_TOKENS)
            hidden = torch.randn(seq_len, HIDDEN).to(torch.bfloat16)
            send_buffer[stage][:seq_len].copy_(hidden)
            event = ps.push_pull([send_buffer[stage][:seq_len]], [stage + int(rank * 1e6)],
                                 [t[:seq_len] for t in recv_buffer[stage]], [stage + 1000])
            events.append((event, stage, seq_len, hidden))
        while events:  # recv_ffn_output
            event, stage, seq_len, hidden = events.popleft()
            handlers = ps.get_all_handlers(event)
            ps.wait(event, timeout_ms=50000)
            costs = [ps.fetch_trace(h) for h in handlers]
            assert len(handlers) == 2 and all(len(c) == 8 for c in costs)
            got = recv_buffer[stage][0][:seq_len]
            assert torch.equal(got, ffn(hidden)), (rank, step, stage)
    print(f"attention {rank} test done", flush=True)
else:
    ret_buffer = torch.zeros(MAX_TOKENS * num_attention, HIDDEN, dtype=torch.bfloat16)
    for step in range(STEPS * STAGES):
        batches = ps.get_batch()  # recv_attn_output
        stage = step % STAGES
        tensors = [batches[r][1][0] for r in range(num_attention)]
        assert [batches[r][2][0] for r in range(num_attention)] == [
            stage + int(r * 1e6) for r in range(num_attention)]
        seq_lens = [t.shape[0] for t in tensors]
        out = ffn(torch.cat(tensors))  # send_ffn_output
        ret_buffer[:out.shape[0]].copy_(out)
        ps.respond_vec(ret_buffer, list(torch.split(out, seq_lens, dim=0)),
                       [b[0] for b in batches])
    print("ffn test done", flush=True)
ps.stop()
