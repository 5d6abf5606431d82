"""A 1x1 mesh's server meeting through a TCPStore (test_store_rendezvous.py):
    store_server.py STORE_PORT
answers every batch with recv + 1 until its worker goes."""

import datetime
import sys

import numpy as np
from torch.distributed import TCPStore

import stepmesh

port = int(sys.argv[1])
store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
with stepmesh.Server(store=store, num_workers=1, num_servers=1, rank=0, transport="tcp",
                     scheduler="127.0.0.1:1", timeout=10.0,
                     heartbeat_interval=0.2) as s:
    recv = np.zeros(8, np.float32)
    reply = np.zeros(8, np.float32)
    s.register_recv(1, recv)
    s.register_reply(2, reply)
    s.barrier()
    while True:
        try:
            b = s.get_batch(timeout=30)
        except stepmesh.Error:
            break
        reply[:] = recv + 1
        s.respond(b)
