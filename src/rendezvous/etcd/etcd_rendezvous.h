#pragma once
// The etcd implementation of the rendezvous seam (src/core/rendezvous.h),
// STEPMESH_RENDEZVOUS=etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX].
//
// Keys under PREFIX (default /stepmesh/<mesh_id or "default">), every one
// attached to the lease of the process that wrote it last, so an orderly
// shutdown (lease revoked) or a dead process (lease expired) leaves nothing:
//   PREFIX/shape                   "workers=W servers=S [max_workers=MW
//                                  max_servers=MS] mesh=ID": a joiner of
//                                  another shape or capacity is refused
//   PREFIX/members/worker/00003    {"endpoint", "workers", "servers",
//   PREFIX/members/server/00000     ["max_workers", "max_servers"], "mesh",
//                                   "proof", "left", ["barriers"]}: one per
//                                   participant ("barriers": the newest
//                                   barrier it entered)
//   PREFIX/formed                  the start shape was complete once: the
//                                  mesh runs, joiners take ranks up to the
//                                  capacity (rewritten by a member when its
//                                  holder goes)
//   PREFIX/barriers/7              how many members entered barrier 7
// join     a transaction per rank: create the member key if absent (a rank
//          asked for, or the lowest free one: of the start shape while the
//          mesh forms, of the capacity max_workers/max_servers once it
//          formed; none free then is RESOURCE_EXHAUSTED naming the option);
//          so no two processes hold one rank, however many race;
// roster   a range of PREFIX/members/, then (the mesh not formed yet) a
//          watch from the revision after it until the start shape is there;
//          a join into a formed mesh takes the members of the read at once
//          (joined_running; the epoch is the read's revision);
// events   the same watch, kept open from the roster's revision (no event
//          between the two is missed): a put of a key the view lacks or
//          after a loss is a join, a put with "left" an orderly leave or the
//          start of a drain (AnnounceLeaving: the key stays, with its lease,
//          until Leave), a delete without it a lost member (its lease
//          expired: no keep-alive within the TTL); the epoch of an event is
//          its store revision;
// barriers compare-and-swap on the counter (txn on its mod_revision),
//          released when the watch shows it at the count of live members
//          that joined before the counter was created (a joiner skips the
//          barriers begun before it: its claim's txn reads the prefix, the
//          counters and the members' "barriers", at the claim's revision);
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
