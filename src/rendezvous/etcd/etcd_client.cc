#include "src/rendezvous/etcd/etcd_client.h"

#include <json/json.h>

#include <algorithm>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/rendezvous/etcd/curl_library.h"
#include "stepmesh/status.h"

namespace stepmesh::etcd {
namespace {

// One attempt at one member: connecting must be quick (a dead member refuses
// or times out here), the request itself may wait for a leader election.
constexpr absl::Duration kConnectTimeout = absl::Milliseconds(300);
constexpr absl::Duration kAttemptTimeout = absl::Seconds(2);
constexpr absl::Duration kRoundPause = absl::Milliseconds(50);

size_t AppendToString(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

// What every POST to etcd sets on `curl`: `payload` (JSON, with `headers`) to
// `target`, the reply handed to `write(data)`, a short connect timeout.
void SetUpPost(const CurlLibrary& lib, CURL* curl, const std::string& target, curl_slist* headers,
               const std::string& payload, size_t (*write)(char*, size_t, size_t, void*),
               void* data) {
  lib.easy_setopt(curl, CURLOPT_URL, target.c_str());
  lib.easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  lib.easy_setopt(curl, CURLOPT_POSTFIELDS, payload.c_str());
  lib.easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
  lib.easy_setopt(curl, CURLOPT_WRITEFUNCTION, write);
  lib.easy_setopt(curl, CURLOPT_WRITEDATA, data);
  lib.easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  lib.easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                  static_cast<long>(absl::ToInt64Milliseconds(kConnectTimeout)));
}

int64_t Int(const Json::Value& v) {
  if (v.isString()) {
    int64_t out = 0;
    return absl::SimpleAtoi(v.asString(), &out) ? out : 0;
  }
  return v.isNumeric() ? v.asInt64() : 0;
}

KeyValue ParseKv(const Json::Value& kv) {
  KeyValue out;
  out.key = EtcdClient::Decode(kv["key"].asString());
  out.value = EtcdClient::Decode(kv["value"].asString());
  out.create_revision = Int(kv["create_revision"]);
  out.mod_revision = Int(kv["mod_revision"]);
  out.lease = Int(kv["lease"]);
  return out;
}

absl::StatusOr<Json::Value> ParseJson(absl::string_view text) {
  Json::CharReaderBuilder builder;
  std::unique_ptr<Json::CharReader> reader(builder.newCharReader());
  Json::Value out;
  std::string errors;
  if (!reader->parse(text.data(), text.data() + text.size(), &out, &errors)) {
    return absl::DataLossError(absl::StrCat("not JSON (", errors, "): ", text.substr(0, 200)));
  }
  return out;
}

std::string Compact(const Json::Value& v) {
  Json::StreamWriterBuilder builder;
  builder["indentation"] = "";
  return Json::writeString(builder, v);
}

// A gateway error body ({"error": ..., "code": N, "message": ...}) as a
// status; `retry` when another member (or a new leader) may answer.
absl::Status GatewayError(const Json::Value& reply, long http, bool* retry) {
  const std::string message =
      reply.isMember("message") ? reply["message"].asString() : reply["error"].asString();
  const int code = reply["code"].asInt();
  *retry = code == 14 /* UNAVAILABLE */ || code == 4 /* DEADLINE_EXCEEDED */ ||
           absl::StrContains(message, "leader") || http >= 500;
  if (absl::StrContains(message, "authentication failed") ||
      absl::StrContains(message, "user name is empty") ||
      absl::StrContains(message, "invalid auth token") || code == 16 || code == 7) {
    *retry = false;
    return absl::PermissionDeniedError(message);
  }
  return absl::Status(*retry ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal,
                      absl::StrCat("HTTP ", http, ": ", message));
}

}  // namespace

std::string EtcdUrl::Endpoints() const { return absl::StrJoin(endpoints, ","); }

absl::StatusOr<EtcdUrl> ParseEtcdUrl(absl::string_view rest) {
  EtcdUrl url;
  const size_t slash = rest.find('/');
  absl::string_view hosts = rest.substr(0, slash);
  if (slash != absl::string_view::npos) {
    url.prefix = std::string(rest.substr(slash));
    while (url.prefix.size() > 1 && url.prefix.back() == '/') url.prefix.pop_back();
    if (url.prefix == "/") url.prefix.clear();
  }
  if (const size_t at = hosts.rfind('@'); at != absl::string_view::npos) {
    absl::string_view cred = hosts.substr(0, at);
    hosts = hosts.substr(at + 1);
    const size_t colon = cred.find(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(
          "etcd rendezvous: credentials must be USER:PASSWORD@ before the endpoints");
    }
    url.user = std::string(cred.substr(0, colon));
    url.password = std::string(cred.substr(colon + 1));
  }
  for (absl::string_view h : absl::StrSplit(hosts, ',', absl::SkipEmpty())) {
    const size_t colon = h.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(h.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd rendezvous: endpoint '", h, "' is not HOST:PORT"));
    }
    url.endpoints.emplace_back(h);
  }
  if (url.endpoints.empty()) {
    return absl::InvalidArgumentError("etcd rendezvous: no HOST:PORT endpoint given");
  }
  return url;
}

std::string PrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

std::string EtcdClient::Encode(absl::string_view bytes) { return absl::Base64Escape(bytes); }

std::string EtcdClient::Decode(absl::string_view text) {
  std::string out;
  return absl::Base64Unescape(text, &out) ? out : std::string();
}

EtcdClient::EtcdClient(EtcdUrl url, std::unique_ptr<CurlLibrary> lib)
    : url_(std::move(url)), lib_(std::move(lib)) {}

EtcdClient::~EtcdClient() { Cancel(); }

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const EtcdUrl& url,
                                                                absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<CurlLibrary> lib, CurlLibrary::Load());
  std::unique_ptr<EtcdClient> client(new EtcdClient(url, std::move(lib)));
  if (!url.user.empty()) {
    STEPMESH_RETURN_IF_ERROR(client->Authenticate(deadline));
  } else {
    // Reach it now, so an unreachable cluster fails here with its endpoints.
    STEPMESH_RETURN_IF_ERROR(client->Range("/", "", deadline).status());
  }
  return client;
}

std::string EtcdClient::Token() const {
  base::MutexLock lock(&mu_);
  return token_;
}

absl::Status EtcdClient::Authenticate(absl::Time deadline) {
  Json::Value body;
  body["name"] = url_.user;
  body["password"] = url_.password;
  absl::StatusOr<Json::Value> reply = Call("/v3/auth/authenticate", body, deadline);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(),
                        absl::StrCat("etcd user '", url_.user, "': ", reply.status().message()));
  }
  base::MutexLock lock(&mu_);
  token_ = (*reply)["token"].asString();
  return absl::OkStatus();
}

absl::StatusOr<Json::Value> EtcdClient::Call(const std::string& path, const Json::Value& body,
                                             absl::Time deadline) {
  const std::string payload = Compact(body);
  absl::Status last = absl::DeadlineExceededError("no attempt made");
  bool reauthenticated = false;
  const size_t n = url_.endpoints.size();
  for (int round = 0;; ++round) {
    for (size_t i = 0; i < n; ++i) {
      const size_t at = (current_.load(std::memory_order_relaxed) + i) % n;
      const std::string& endpoint = url_.endpoints[at];
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration() && round + i > 0) {
        return absl::Status(
            last.code() == absl::StatusCode::kUnavailable ? absl::StatusCode::kUnavailable
                                                          : absl::StatusCode::kDeadlineExceeded,
            absl::StrCat("etcd at ", url_.Endpoints(), ": POST ", path, ": ", last.message()));
      }
      std::unique_ptr<CURL, void (*)(CURL*)> curl(lib_->easy_init(), lib_->easy_cleanup);
      if (curl == nullptr) return absl::ResourceExhaustedError("curl_easy_init failed");
      const std::string target = absl::StrCat("http://", endpoint, path);
      std::string response;
      curl_slist* headers = lib_->slist_append(nullptr, "Content-Type: application/json");
      const std::string token = Token();
      if (!token.empty() && path != "/v3/auth/authenticate") {
        headers = lib_->slist_append(headers, absl::StrCat("Authorization: ", token).c_str());
      }
      const long attempt_ms = static_cast<long>(std::clamp(
          absl::ToInt64Milliseconds(std::min(left, kAttemptTimeout)), int64_t{50}, int64_t{2000}));
      SetUpPost(*lib_, curl.get(), target, headers, payload, AppendToString, &response);
      lib_->easy_setopt(curl.get(), CURLOPT_TIMEOUT_MS, attempt_ms);
      const CURLcode rc = lib_->easy_perform(curl.get());
      long http = 0;
      lib_->easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &http);
      lib_->slist_free_all(headers);
      if (rc != CURLE_OK) {
        last = absl::UnavailableError(absl::StrCat(endpoint, ": ", lib_->easy_strerror(rc)));
        current_.store((at + 1) % n, std::memory_order_relaxed);
        continue;
      }
      absl::StatusOr<Json::Value> reply = ParseJson(response);
      if (!reply.ok()) {
        last = absl::UnavailableError(absl::StrCat(endpoint, ": ", reply.status().message()));
        current_.store((at + 1) % n, std::memory_order_relaxed);
        continue;
      }
      if (http == 200) {
        current_.store(at, std::memory_order_relaxed);
        return reply;
      }
      bool retry = false;
      absl::Status error = GatewayError(*reply, http, &retry);
      if (absl::IsPermissionDenied(error) &&
          absl::StrContains(error.message(), "invalid auth token") && !reauthenticated &&
          !url_.user.empty()) {
        reauthenticated = true;  // tokens expire (etcd's simple tokens after 5 minutes)
        STEPMESH_RETURN_IF_ERROR(Authenticate(deadline));
        --i;
        continue;
      }
      if (!retry) {
        return absl::Status(error.code(), absl::StrCat("etcd at ", endpoint, ": POST ", path, ": ",
                                                       error.message()));
      }
      last = absl::UnavailableError(absl::StrCat(endpoint, ": ", error.message()));
      current_.store((at + 1) % n, std::memory_order_relaxed);
    }
    absl::SleepFor(std::min(kRoundPause, std::max(deadline - absl::Now(), absl::ZeroDuration())));
  }
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(int64_t ttl_seconds, absl::Time deadline) {
  Json::Value body;
  body["TTL"] = Json::Int64(ttl_seconds);
  STEPMESH_ASSIGN_OR_RETURN(Json::Value reply, Call("/v3/lease/grant", body, deadline));
  if (!reply["error"].asString().empty()) {
    return absl::InternalError(absl::StrCat("etcd lease grant: ", reply["error"].asString()));
  }
  return Int(reply["ID"]);
}

absl::StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease, absl::Time deadline) {
  Json::Value body;
  body["ID"] = std::to_string(lease);
  STEPMESH_ASSIGN_OR_RETURN(Json::Value reply, Call("/v3/lease/keepalive", body, deadline));
  if (reply.isMember("error")) {
    bool retry = false;
    return GatewayError(reply["error"], 200, &retry);
  }
  return Int(reply["result"]["TTL"]);
}

absl::Status EtcdClient::Revoke(int64_t lease, absl::Time deadline) {
  Json::Value body;
  body["ID"] = std::to_string(lease);
  return Call("/v3/lease/revoke", body, deadline).status();
}

absl::StatusOr<int64_t> EtcdClient::TimeToLive(int64_t lease, absl::Time deadline) {
  Json::Value body;
  body["ID"] = std::to_string(lease);
  STEPMESH_ASSIGN_OR_RETURN(Json::Value reply, Call("/v3/lease/timetolive", body, deadline));
  return reply.isMember("TTL") ? Int(reply["TTL"]) : -1;
}

absl::StatusOr<RangeResult> EtcdClient::Range(const std::string& key, const std::string& range_end,
                                              absl::Time deadline) {
  Json::Value body;
  body["key"] = Encode(key);
  if (!range_end.empty()) body["range_end"] = Encode(range_end);
  STEPMESH_ASSIGN_OR_RETURN(Json::Value reply, Call("/v3/kv/range", body, deadline));
  RangeResult out;
  out.revision = Int(reply["header"]["revision"]);
  for (const Json::Value& kv : reply["kvs"]) out.kvs.push_back(ParseKv(kv));
  return out;
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease,
                             absl::Time deadline) {
  Json::Value body;
  body["key"] = Encode(key);
  body["value"] = Encode(value);
  if (lease != 0) body["lease"] = std::to_string(lease);
  return Call("/v3/kv/put", body, deadline).status();
}

absl::Status EtcdClient::DeleteRange(const std::string& key, const std::string& range_end,
                                     absl::Time deadline) {
  Json::Value body;
  body["key"] = Encode(key);
  if (!range_end.empty()) body["range_end"] = Encode(range_end);
  return Call("/v3/kv/deleterange", body, deadline).status();
}

absl::StatusOr<TxnResult> EtcdClient::Txn(const Json::Value& request, absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(Json::Value reply, Call("/v3/kv/txn", request, deadline));
  TxnResult out;
  out.succeeded = reply["succeeded"].asBool();
  out.revision = Int(reply["header"]["revision"]);
  for (const Json::Value& r : reply["responses"]) {
    if (r.isMember("response_range")) {
      for (const Json::Value& kv : r["response_range"]["kvs"]) out.range.push_back(ParseKv(kv));
      break;
    }
  }
  return out;
}

void EtcdClient::Cancel() {
  cancelled_.store(true);
  base::MutexLock lock(&mu_);
  if (watch_multi_ != nullptr) lib_->multi_wakeup(static_cast<CURLM*>(watch_multi_));
}

namespace {

// What a watch stream's write callback accumulates: complete JSON objects,
// one per line, handed over as they arrive.
struct WatchStream {
  std::string buffer;
  std::function<bool(absl::string_view line)> on_line;
  bool stopped = false;  // on_line returned false
};

size_t WatchWrite(char* data, size_t size, size_t count, void* p) {
  auto* s = static_cast<WatchStream*>(p);
  s->buffer.append(data, size * count);
  size_t start = 0;
  for (size_t nl; !s->stopped && (nl = s->buffer.find('\n', start)) != std::string::npos;
       start = nl + 1) {
    absl::string_view line(s->buffer.data() + start, nl - start);
    if (!line.empty() && !s->on_line(line)) s->stopped = true;
  }
  s->buffer.erase(0, start);
  return s->stopped ? 0 : size * count;  // 0 aborts the transfer
}

}  // namespace

absl::Status EtcdClient::WatchOnce(
    const std::string& endpoint, const std::string& body_prefix, absl::Time deadline,
    int64_t* next_revision, bool* delivered_any,
    const std::function<bool(int64_t, const std::vector<WatchEvent>&)>& cb) {
  Json::Value create = *ParseJson(body_prefix);
  create["create_request"]["start_revision"] = std::to_string(*next_revision);
  const std::string payload = Compact(create);
  std::unique_ptr<CURL, void (*)(CURL*)> curl(lib_->easy_init(), lib_->easy_cleanup);
  std::unique_ptr<CURLM, CURLMcode (*)(CURLM*)> multi(lib_->multi_init(), lib_->multi_cleanup);
  if (curl == nullptr || multi == nullptr) return absl::ResourceExhaustedError("curl init failed");
  const std::string target = absl::StrCat("http://", endpoint, "/v3/watch");
  curl_slist* headers = lib_->slist_append(nullptr, "Content-Type: application/json");
  const std::string token = Token();
  if (!token.empty()) {
    headers = lib_->slist_append(headers, absl::StrCat("Authorization: ", token).c_str());
  }
  absl::Status stream_error;
  WatchStream stream;
  stream.on_line = [&](absl::string_view line) {
    absl::StatusOr<Json::Value> m = ParseJson(line);
    if (!m.ok()) {
      stream_error = m.status();
      return false;
    }
    if (m->isMember("error")) {
      bool retry = false;
      stream_error = GatewayError((*m)["error"], 200, &retry);
      return false;
    }
    const Json::Value& result = (*m)["result"];
    if (result["canceled"].asBool()) {
      stream_error = absl::DataLossError(absl::StrCat(
          "etcd cancelled the watch from revision ", *next_revision,
          Int(result["compact_revision"]) > 0
              ? absl::StrCat(" (compacted up to ", Int(result["compact_revision"]), ")")
              : std::string(),
          ": ", result["cancel_reason"].asString()));
      return false;
    }
    if (!result.isMember("events")) return true;  // created / progress
    std::vector<WatchEvent> events;
    for (const Json::Value& e : result["events"]) {
      WatchEvent event;
      event.deleted = e["type"].asString() == "DELETE";
      event.kv = ParseKv(e["kv"]);
      events.push_back(std::move(event));
    }
    const int64_t revision = Int(result["header"]["revision"]);
    *next_revision = std::max(*next_revision, revision + 1);
    for (const WatchEvent& e : events) {
      *next_revision = std::max(*next_revision, e.kv.mod_revision + 1);
    }
    *delivered_any = true;
    return cb(revision, events);
  };
  SetUpPost(*lib_, curl.get(), target, headers, payload, WatchWrite, &stream);
  lib_->easy_setopt(curl.get(), CURLOPT_TCP_KEEPALIVE, 1L);
  lib_->multi_add_handle(multi.get(), curl.get());
  {
    base::MutexLock lock(&mu_);
    watch_multi_ = multi.get();
  }
  absl::Status out;
  for (;;) {
    if (cancelled_.load()) break;
    if (absl::Now() >= deadline) {
      out = absl::DeadlineExceededError("the watch reached its deadline");
      break;
    }
    int running = 0;
    lib_->multi_perform(multi.get(), &running);
    if (stream.stopped && stream_error.ok()) break;  // the callback is done
    if (running == 0) {
      int queued = 0;
      CURLcode rc = CURLE_OK;
      while (CURLMsg* msg = lib_->multi_info_read(multi.get(), &queued)) {
        if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
      }
      long http = 0;
      lib_->easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &http);
      if (!stream_error.ok()) {
        out = stream_error;
      } else if (rc != CURLE_OK) {
        out = absl::UnavailableError(absl::StrCat(endpoint, ": ", lib_->easy_strerror(rc)));
      } else if (http != 200) {
        out = absl::UnavailableError(absl::StrCat(endpoint, ": watch answered HTTP ", http));
      } else {
        out = absl::UnavailableError(absl::StrCat(endpoint, ": the watch stream ended"));
      }
      break;
    }
    const int64_t wait_ms =
        std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()) + 1, 1, 1000);
    lib_->multi_poll(multi.get(), nullptr, 0, static_cast<int>(wait_ms), nullptr);
  }
  {
    base::MutexLock lock(&mu_);
    watch_multi_ = nullptr;
  }
  lib_->multi_remove_handle(multi.get(), curl.get());
  lib_->slist_free_all(headers);
  return out;
}

absl::Status EtcdClient::Watch(
    const std::string& key, const std::string& range_end, int64_t start_revision,
    absl::Duration reconnect_window, absl::Time deadline,
    const std::function<bool(int64_t, const std::vector<WatchEvent>&)>& on_events) {
  Json::Value create;
  create["create_request"]["key"] = Encode(key);
  if (!range_end.empty()) create["create_request"]["range_end"] = Encode(range_end);
  const std::string body = Compact(create);
  int64_t next = start_revision;
  absl::Time failing_since = absl::InfiniteFuture();
  const size_t n = url_.endpoints.size();
  while (!cancelled_.load()) {
    const size_t at = current_.load(std::memory_order_relaxed) % n;
    bool delivered = false;
    absl::Status s = WatchOnce(url_.endpoints[at], body, deadline, &next, &delivered, on_events);
    if (s.ok()) return s;  // cancelled, or the callback had enough
    if (absl::IsDataLoss(s) || absl::IsPermissionDenied(s) || absl::IsDeadlineExceeded(s)) {
      return s;
    }
    const absl::Time now = absl::Now();
    if (delivered) failing_since = absl::InfiniteFuture();
    if (failing_since == absl::InfiniteFuture()) failing_since = now;
    if (now - failing_since > reconnect_window) {
      return absl::UnavailableError(
          absl::StrCat("etcd at ", url_.Endpoints(), ": no member kept the watch on ", key, " for ",
                       absl::FormatDuration(reconnect_window), ": ", s.message()));
    }
    STEPMESH_LOG(kInfo, "etcd watch on ", url_.endpoints[at], " ended (", s.message(),
                 "); resuming from revision ", next, " on the next member");
    current_.store((at + 1) % n, std::memory_order_relaxed);
    absl::SleepFor(kRoundPause);
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::etcd
