"""deploy/kubernetes/*.yaml parse, and what they set is what stepmesh reads.

    kubernetes_manifests_test.py --env-doc build/src/stepmesh_env_doc --dir deploy/kubernetes

Checks: every document parses (python3-yaml); every STEPMESH_* name set in
an env list, and every one named in a comment (the alternatives an operator
uncomments), is in the environment table stepmesh_env_doc prints; each
StatefulSet's replicas equal the mesh size its pods announce, the rank is the
pod ordinal, readiness is the metrics endpoint its program serves; every
Secret / ConfigMap key referenced exists; the scheduler URL names the
scheduler Service and its port.
"""

import argparse
import glob
import os
import re
import subprocess
import sys

import yaml


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def env_table(tool):
    names = set()
    for section in ("main", "rdma", "stepmesh", "elsewhere"):
        out = subprocess.run([tool, section], capture_output=True, text=True, check=True).stdout
        names.update(re.findall(r"^\| `([A-Z0-9_]+)`", out, re.M))
    if "STEPMESH_RENDEZVOUS" not in names or len(names) < 40:
        fail("the environment table looks wrong (%d names)" % len(names))
    return names


def containers(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-doc", required=True)
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    known = env_table(a.env_doc)
    docs, texts = [], {}
    files = sorted(glob.glob(os.path.join(a.dir, "*.yaml")))
    if not files:
        fail("no manifests in %s" % a.dir)
    for f in files:
        texts[f] = open(f).read()
        try:
            docs += [(f, d) for d in yaml.safe_load_all(texts[f]) if d]
        except yaml.YAMLError as e:
            fail("%s does not parse: %s" % (f, e))
    by_kind = {}
    for f, d in docs:
        by_kind.setdefault(d["kind"], []).append((f, d))
    for kind in ("StatefulSet", "Deployment", "Service", "Secret", "ConfigMap", "Namespace"):
        if kind not in by_kind:
            fail("no %s among the manifests" % kind)
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {}) or d.get("data", {}))
               for _, d in by_kind["Secret"]}
    configmaps = {d["metadata"]["name"]: set(d.get("data", {})) for _, d in by_kind["ConfigMap"]}
    services = {d["metadata"]["name"]: [p["port"] for p in d["spec"]["ports"]]
                for _, d in by_kind["Service"]}

    checked = 0
    # Names in comments too: the documented alternatives must be real names.
    for f, text in texts.items():
        for line in text.splitlines():
            if line.lstrip().startswith("#"):
                for name in re.findall(r"\bSTEPMESH_[A-Z0-9_]+", line):
                    checked += 1
                    if name not in known:
                        fail("%s: comment names %s, which is not in the environment table"
                             % (f, name))
    for f, d in docs:
        for c in containers(d):
            env = {}
            for e in c.get("env", []):
                name = e["name"]
                if name.startswith(("STEPMESH_", "DMLC_")):
                    checked += 1
                    if name not in known:
                        fail("%s: container %s sets %s, which is not in the environment table"
                             % (f, c["name"], name))
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    r = ref["secretKeyRef"]
                    if r["key"] not in secrets.get(r["name"], set()):
                        fail("%s: %s refers to secret %s key %s, not defined"
                             % (f, name, r["name"], r["key"]))
                if "configMapKeyRef" in ref:
                    r = ref["configMapKeyRef"]
                    if r["key"] not in configmaps.get(r["name"], set()):
                        fail("%s: %s refers to configmap %s key %s, not defined"
                             % (f, name, r["name"], r["key"]))
                env[name] = e.get("value")
            url = env.get("STEPMESH_RENDEZVOUS")
            if url is not None:
                m = re.match(r"^scheduler://([a-z0-9.-]+):(\d+)$", url) or \
                    re.match(r"^etcd://", url)
                if not m:
                    fail("%s: STEPMESH_RENDEZVOUS=%r is neither scheduler:// nor etcd://" % (f, url))
                if url.startswith("scheduler://"):
                    host, port = m.group(1), int(m.group(2))
                    if host.split(".")[0] not in services or port not in services[host.split(".")[0]]:
                        fail("%s: %s names no Service port %s" % (f, url, port))
            if d["kind"] == "StatefulSet":
                replicas = d["spec"]["replicas"]
                role = env.get("STEPMESH_ROLE")
                size = env.get("STEPMESH_NUM_WORKERS" if role == "worker" else "STEPMESH_NUM_SERVERS")
                if str(replicas) != str(size):
                    fail("%s: %d replicas but the pods announce a mesh of %s %ss"
                         % (f, replicas, size, role))
                cmd = " ".join(c.get("command", []) + c.get("args", []))
                if '--rank "${HOSTNAME##*-}"' not in cmd:
                    fail("%s: the rank is not the pod ordinal: %s" % (f, cmd))
                port = re.search(r"--metrics-port (\d+)", cmd)
                probe = c.get("readinessProbe", {}).get("httpGet", {})
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                if not port or probe.get("path") != "/metrics" or \
                        ports.get(probe.get("port")) != int(port.group(1)):
                    fail("%s: readiness is not the metrics endpoint the program serves" % f)
    if checked < 20:
        fail("only %d STEPMESH_* names found: the manifests lost their environment?" % checked)
    print("PASS: %d manifests, %d documents, %d STEPMESH_* names checked"
          % (len(files), len(docs), checked))


if __name__ == "__main__":
    main()
