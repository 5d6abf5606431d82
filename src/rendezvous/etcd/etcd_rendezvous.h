#pragma once
// The etcd implementation of the rendezvous seam (src/core/rendezvous.h),
// STEPMESH_RENDEZVOUS=etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX].
//
// Keys under PREFIX (default /stepmesh/<mesh_id or "default">), every one
// attached to the lease of the process that wrote it last, so an orderly
// shutdown (lease revoked) or a dead process (lease expired) leaves nothing:
//   PREFIX/shape                   "workers=W servers=S mesh=ID": a joiner of
//                                  another shape is refused, naming the key
//   PREFIX/members/worker/00003    {"endpoint", "workers", "servers", "mesh",
//   PREFIX/members/server/00000     "proof", "left"}: one per participant
//   PREFIX/barriers/7              how many members entered barrier 7
// join     a transaction per rank: create the member key if absent (a rank
//          asked for, or the lowest free one);
// roster   a range of PREFIX/members/, then a watch from the revision after
//          it until every member is there;
// events   the same watch, kept open from the roster's revision (no event
//          between the two is missed): a put after a loss is a join under an
//          old rank, a put with "left" an orderly leave, a delete without it
//          a lost member (its lease expired: no keep-alive within the TTL);
//          the epoch of an event is its store revision;
// barriers compare-and-swap on the counter (txn on its mod_revision),
//          released when the watch shows it at the live member count;
// liveness a lease of TTL options.timeout (at least 2 s), kept alive every
//          third of it; the mesh token (options.auth_token) signs each
//          member value (HMAC), so a writer without it cannot add an endpoint.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/core/rendezvous.h"
#include "stepmesh/options.h"

namespace stepmesh::etcd {

// A core::RendezvousFactory for etcd:// rendezvous.
absl::StatusOr<std::unique_ptr<core::Rendezvous>> JoinEtcd(const MeshOptions& options,
                                                           const std::string& endpoint);

}  // namespace stepmesh::etcd
