"""StepMesh's tests/fserver/test_kernel_wait.py, in shape, on host threads:
the compute side runs seq_add_one -> write_flag(signal) -> wait_flag(ack) per
step (a CUDA graph in StepMesh, skipped without CUDA), and a CPU proxy thread
polls the signal, does push_pull(need_event=False) + wait, and writes the ack;
the server answers with respond_vec. Checks each step's reply."""

import os
import threading

import torch

import fserver_lib as f

STEPS = int(os.environ.get("FSERVER_TEST_ITERS", "24"))
role = os.environ.get("DMLC_ROLE")
bsz, tokens, dim = 1, 8, 8

f.init()
if role == "worker":
    f.barrier(False, True)
    signal = f.map_pinned_tensor(torch.zeros(1, dtype=torch.int64), 0)
    ack = f.map_pinned_tensor(torch.zeros(1, dtype=torch.int64), 0)
    seq = torch.zeros(1, dtype=torch.int64)
    send = torch.zeros(tokens, dim)
    recv = [torch.zeros(tokens, dim)]
    errors = []

    def proxy():
        try:
            for step in range(1, STEPS + 1):
                f.wait_flag(signal, torch.tensor([step]))
                h = f.push_pull([send], [0], recv, [1], need_event=False)
                f.wait(h)
                f.write_flag(ack, torch.tensor([step]))
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            f.write_flag(ack, torch.tensor([1 << 40]))

    th = threading.Thread(target=proxy)
    th.start()
    for step in range(1, STEPS + 1):
        send.fill_(step)
        f.seq_add_one(seq)
        f.write_flag(signal, seq)
        f.wait_flag(ack, seq)
        assert not errors, errors
        assert torch.equal(recv[0], send * 3), (step, recv[0][0, 0].item())
    th.join(10)
    assert int(seq[0]) == STEPS
    print("worker test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    ret_buffer = torch.zeros(tokens, dim)
    for _ in range(STEPS):
        batches = f.get_batch()
        ret_buffer.copy_(batches[0][1][0] * 3)
        f.respond_vec(ret_buffer, [b[1][0] for b in batches], [b[0] for b in batches])
    print("server test done", flush=True)
f.stop()
