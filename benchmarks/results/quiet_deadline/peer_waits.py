import sys, json
sys.path.insert(0, ".")
from world import World, free_port
import test_async_contract as t
if __name__ == "__main__":
    w = World(2)
    try:
        for how in ["sleep", "python", "gloo", "store"]:
            res = w.run(t._peer_waits, free_port(), [how], 5, timeout=300)
            row = {k.split("/")[1]: round(sorted(x["s"] for x in v)[2]*1000, 2) for k, v in res[1].items()}
            print(how, json.dumps(row), flush=True)
    finally:
        w.close()
