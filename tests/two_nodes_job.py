"""The rank side of tests/multihost/test_two_nodes.py's killed-task case: started by
``srun`` on the two simulated nodes, each rank initialises with no
arguments (the launcher's variables only), writes its pid (as its node's
PID namespace numbers it: what ``kill`` on that node takes) once a few
all_reduces went through, then all_reduces in a bounded loop with a
communicator timeout of ``TWO_NODES_TIMEOUT`` seconds until a rank is
killed from outside and the watchdog ends the others."""
import os
import time

import torch

import streamcoll

out = os.environ["TWO_NODES_OUT"]
comm = streamcoll.init(timeout=120)
comm.timeout = float(os.environ.get("TWO_NODES_TIMEOUT", "5"))
t = torch.zeros(16)
deadline = time.monotonic() + 120
i = 0
while time.monotonic() < deadline:  # bounded: the test kills a rank long before
    t.fill_(1.0)
    comm.all_reduce(t)
    if t[0].item() != comm.size:
        raise AssertionError(f"iteration {i}: {t[0].item()}")
    i += 1
    if i == 10:
        path = os.path.join(out, f"pid{comm.rank}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {os.uname().nodename}")
        os.replace(path + ".tmp", path)
    time.sleep(0.01)
streamcoll.destroy()
