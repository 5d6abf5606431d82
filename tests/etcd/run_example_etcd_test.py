"""scripts/run-example.sh with STEPMESH_RENDEZVOUS=etcd://127.0.0.1:PORT/PREFIX
against an etcd this test starts: the example's reference check passes, its
processes met through etcd (the store's revision moved, keys were under the
prefix while it ran), and nothing is left under the prefix afterwards.

    run_example_etcd_test.py --build BUILD_DIR --root SOURCE_DIR
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_cluster import EtcdCluster  # noqa: E402


def revision(cluster):
    out = cluster.etcdctl("endpoint", "status", "-w", "json")
    return int(json.loads(out)[0]["Status"]["header"]["revision"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--root", required=True)
    a = p.parse_args()
    prefix = "/stepmesh-example"
    with EtcdCluster(1) as cluster:
        before = revision(cluster)
        env = dict(os.environ, BUILD_DIR=a.build,
                   STEPMESH_RENDEZVOUS="etcd://%s%s" % (cluster.endpoints[0], prefix))
        proc = subprocess.Popen(["bash", os.path.join(a.root, "scripts", "run-example.sh")],
                                cwd=a.root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        seen = []

        def watch():  # the members' keys while the example runs
            while proc.poll() is None:
                try:
                    seen.extend(k for k in cluster.keys(prefix) if "/members/" in k)
                except Exception:
                    pass
                time.sleep(0.2)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            print("FAIL: run-example.sh did not finish within 240 s")
            return 1
        t.join(timeout=5)
        print(out[-3000:])
        if proc.returncode != 0 or "PASS" not in out:
            print("FAIL: run-example.sh exited %d" % proc.returncode)
            return 1
        members = sorted(set(seen))
        print("member keys seen under %s: %s" % (prefix, members))
        if len(members) != 4:
            print("FAIL: the 2A2F example did not meet through etcd (saw %s)" % members)
            return 1
        if revision(cluster) <= before:
            print("FAIL: etcd's revision did not move")
            return 1
        left = cluster.keys(prefix)
        if left:
            print("FAIL: keys left under %s: %s" % (prefix, left))
            return 1
    print("PASS run-example with STEPMESH_RENDEZVOUS=etcd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
