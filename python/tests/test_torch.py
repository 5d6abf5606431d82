"""torch CPU tensors through stepmesh without linking torch: DLPack in and out,
every dtype torch 1.13 has that stepmesh carries. torch is a test dependency
(Debian python3-torch, installed by scripts/install-deps.sh): if it cannot be
imported the tests fail saying so, they are not skipped."""
import pytest

import proc_util
import stepmesh
import thread_util

torch = proc_util.require_torch()
from torch.utils.dlpack import from_dlpack  # noqa: E402

DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_round_trip(dtype):
    rows, cols, steps = 6, 8, 3
    sched = stepmesh.Scheduler()

    def server():
        with stepmesh.Server(scheduler=sched.address, transport="tcp", timeout=20.0) as s:
            recv = torch.zeros(rows, cols, dtype=dtype)
            reply = torch.zeros(rows, cols, dtype=dtype)
            s.register_recv(1, recv)
            s.register_reply(2, reply)
            s.barrier()
            for _ in range(steps):
                b = s.get_batch(timeout=20)
                part = from_dlpack(b.part(1, 0))  # zero-copy torch view
                assert part.dtype == dtype and part.data_ptr() == recv.data_ptr()
                reply[: part.shape[0]] = part + 1
                s.respond(b, rows={0: part.shape[0]})
            s.barrier()

    try:
        with thread_util.in_background(server):
            with stepmesh.Worker(scheduler=sched.address, transport="tcp", timeout=20.0) as w:
                x = torch.zeros(rows, cols, dtype=dtype)
                y = torch.zeros(rows, cols, dtype=dtype)
                assert stepmesh.describe(x)["dtype"] == str(dtype).split(".")[1]
                w.register_push(1, x)
                w.register_pull(2, 0, y)
                w.barrier()
                for step in range(steps):
                    n = [rows, 2, 5][step]
                    x.copy_(torch.randint(0, 100, (rows, cols)).to(dtype))
                    y.zero_()
                    w.wait(w.push_pull([stepmesh.Push(1, rows=n)], [(2, 0)]), timeout=20)
                    assert torch.equal(y[:n], x[:n] + 1)
                    assert not y[n:].any()
                w.barrier()
    finally:
        sched.stop()


def test_torch_bad_tensors():
    with pytest.raises(ValueError, match="not contiguous"):
        stepmesh.describe(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="float64"):
        stepmesh.describe(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="int8"):
        stepmesh.describe(torch.zeros(4, dtype=torch.int8))
    # a contiguous slice with an offset is fine: the address includes it
    base = torch.zeros(4, 6)
    assert stepmesh.describe(base[1:])["data_ptr"] == base[1:].data_ptr()


def test_host_tensor_to_torch_bfloat16():
    h = stepmesh.HostTensor([3, 4], "bfloat16")
    t = from_dlpack(h)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 4)
    t.fill_(1.5)
    assert torch.equal(from_dlpack(h), torch.full((3, 4), 1.5, dtype=torch.bfloat16))
