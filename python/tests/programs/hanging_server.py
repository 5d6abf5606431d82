"""A server that takes one batch and never answers it (killed by the test)."""
import sys
import time

import numpy as np

import stepmesh

with stepmesh.Server(scheduler=sys.argv[1], transport="tcp", timeout=10.0,
                     heartbeat_interval=0.2) as s:
    s.register_recv(1, np.zeros(8, np.float32))
    s.register_reply(2, np.zeros(8, np.float32))
    s.barrier()
    batch = s.get_batch(timeout=20)
    print("got batch", flush=True)
    time.sleep(60)  # bounded: the test kills this process long before
