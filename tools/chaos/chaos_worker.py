"""Chaos worker: pushes +1 to every row of dense 'w' and every key of table 'emb',
journalling each round start and each flush outcome (line-buffered)."""
import json, os, sys, time
import numpy as np
import shmps

def main():
    spec = json.loads(sys.argv[1])
    jr = open(spec["journal"], "a", buffering=1)
    store = shmps.attach(spec["store"], namespace=spec["namespace"])
    w = store.dense("w", tuple(spec["wshape"]), "int32", shard_rows=spec["shard_rows"])
    emb = store.table("emb", dim=4, dtype="int32", capacity=1000)
    keys = np.asarray(spec["keys"], dtype=np.uint64)
    ones_w = np.ones(w.shape, dtype=np.int32)
    ones_e = np.ones((len(keys), 4), dtype=np.int32)
    jr.write(f"START {os.getpid()} {time.time():.3f}\n")
    n = 0
    def flush(tag):
        t0 = time.time()
        try:
            store.flush(timeout=spec["flush_timeout"])
            res = "ok"
        except shmps.PushesLost as e:
            res = "lost " + str(e).replace("\n", " ")[:300]
        except shmps.Timeout as e:
            res = "timeout " + str(e).replace("\n", " ")[:300]
        except Exception as e:
            res = f"err {type(e).__name__} " + str(e).replace("\n", " ")[:300]
        jr.write(f"F {n} {t0:.3f} {time.time()-t0:.3f} {tag} {res}\n")
    while not os.path.exists(spec["stop"]):
        n += 1
        jr.write(f"S {n}\n")
        w.push(ones_w)
        emb.push(keys, ones_e)
        time.sleep(spec["sleep"])
        if n % spec["flush_every"] == 0:
            flush("periodic")
    flush("final")
    # a second, final flush: must return ok (anything lost was reported by the first)
    flush("final2")
    jr.write("END\n")
    store.close()

main()
