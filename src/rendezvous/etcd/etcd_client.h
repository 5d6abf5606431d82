#pragma once
// A small etcd v3 client over etcd's JSON gateway (grpc-gateway, etcd 3.4:
// POST /v3/kv/range, /v3/kv/txn, /v3/lease/grant, /v3/lease/keepalive,
// /v3/lease/revoke, /v3/auth/authenticate and the streaming /v3/watch) with
// libcurl. Keys and values travel base64-encoded, 64-bit numbers as decimal
// strings. docs/deployment.md says why the gateway and not gRPC.
//
// Several endpoints are members of one cluster: a request that cannot reach
// one (refused, reset, timed out, "no leader") goes to the next, until its
// deadline. Thread-safe: every request uses its own connection.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/base/sync.h"

namespace Json {
class Value;
}

namespace stepmesh::etcd {

class CurlLibrary;  // curl_library.h: libcurl, loaded when a client is made

// etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX], after "etcd://".
struct EtcdUrl {
  std::vector<std::string> endpoints;  // host:port each
  std::string user;
  std::string password;
  std::string prefix;             // no trailing '/'; empty: the caller's default
  std::string Endpoints() const;  // "h:p,h:p" for messages
};
absl::StatusOr<EtcdUrl> ParseEtcdUrl(absl::string_view rest);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct RangeResult {
  std::vector<KeyValue> kvs;
  int64_t revision = 0;  // the store revision the range was read at
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;
  std::vector<KeyValue> range;  // the kvs of the first range response, if any
};

// One event of a watch: a put (with the new value) or a delete.
struct WatchEvent {
  bool deleted = false;
  KeyValue kv;  // a delete carries key and mod_revision only
};

// The key just after every key that starts with `prefix` (a range's end).
std::string PrefixEnd(absl::string_view prefix);

class EtcdClient {
 public:
  // Reaches the cluster (authenticates when the URL has a user) by `deadline`.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(const EtcdUrl& url,
                                                             absl::Time deadline);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  const EtcdUrl& url() const { return url_; }

  absl::StatusOr<int64_t> GrantLease(int64_t ttl_seconds, absl::Time deadline);
  // The lease's remaining TTL in seconds; 0 when it no longer exists.
  absl::StatusOr<int64_t> KeepAlive(int64_t lease, absl::Time deadline);
  absl::Status Revoke(int64_t lease, absl::Time deadline);
  // The lease's remaining TTL in seconds (-1: it does not exist).
  absl::StatusOr<int64_t> TimeToLive(int64_t lease, absl::Time deadline);
  // Every key in [key, range_end) (range_end empty: `key` alone).
  absl::StatusOr<RangeResult> Range(const std::string& key, const std::string& range_end,
                                    absl::Time deadline);
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease,
                   absl::Time deadline);
  absl::Status DeleteRange(const std::string& key, const std::string& range_end,
                           absl::Time deadline);
  // `request`: a TxnRequest in the gateway's JSON (keys already base64).
  absl::StatusOr<TxnResult> Txn(const Json::Value& request, absl::Time deadline);

  // Streams the events of [key, range_end) from `start_revision` until
  // `on_events` returns false or Cancel() is called (then OK), reconnecting
  // to the next endpoint from the revision after the last one delivered when
  // a member goes away. Fails when no member answers for `reconnect_window`,
  // or the revision was compacted away.
  // `deadline` (may be absl::InfiniteFuture()) ends it with DEADLINE_EXCEEDED.
  absl::Status Watch(
      const std::string& key, const std::string& range_end, int64_t start_revision,
      absl::Duration reconnect_window, absl::Time deadline,
      const std::function<bool(int64_t revision, const std::vector<WatchEvent>&)>& on_events);
  // Ends a Watch in progress (from any thread) and every later one.
  void Cancel();

  // Base64 as the gateway wants it.
  static std::string Encode(absl::string_view bytes);
  static std::string Decode(absl::string_view text);

 private:
  EtcdClient(EtcdUrl url, std::unique_ptr<CurlLibrary> lib);
  // One POST to `path` on whichever member answers; the parsed JSON reply.
  absl::StatusOr<Json::Value> Call(const std::string& path, const Json::Value& body,
                                   absl::Time deadline);
  absl::Status Authenticate(absl::Time deadline);
  // One attempt of a watch stream on `endpoint`; advances `*next_revision`.
  absl::Status WatchOnce(const std::string& endpoint, const std::string& body_prefix,
                         absl::Time deadline, int64_t* next_revision, bool* delivered_any,
                         const std::function<bool(int64_t, const std::vector<WatchEvent>&)>& cb);
  std::string Token() const;

  const EtcdUrl url_;
  const std::unique_ptr<CurlLibrary> lib_;  // declared before what uses it
  std::atomic<size_t> current_{0};          // the member requests go to first
  std::atomic<bool> cancelled_{false};
  mutable base::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
  void* watch_multi_ ABSL_GUARDED_BY(mu_) = nullptr;  // the CURLM of the watch in progress
};

}  // namespace stepmesh::etcd
