// stepmesh_plan --watch's parts (src/tools/planner/{http_get,prometheus_text,
// watch}.h): the loopback HTTP client against the programs' real responder
// and against servers that misbehave, the Prometheus text reader, and how a
// scrape of a mesh becomes its shape and workload. The whole loop against a
// real example run is ctest planner_watch_example.

#include "src/tools/planner/watch.h"

#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/tools/metrics/metrics_http.h"
#include "src/tools/planner/http_get.h"
#include "src/tools/planner/prometheus_text.h"

namespace stepmesh::planner {
namespace {

std::string Message(const absl::Status& s) { return std::string(s.message()); }

HttpUrl Url(const std::string& text) {
  absl::StatusOr<HttpUrl> url = ParseHttpUrl(text);
  REQUIRE(url.ok());
  return *url;
}

TEST_CASE("watch: URLs are loopback http with a port", "[planner][watch]") {
  HttpUrl u = Url("http://127.0.0.1:9100/metrics");
  CHECK(u.host == "127.0.0.1");
  CHECK(u.port == 9100);
  CHECK(u.path == "/metrics");
  u = Url("127.0.0.1:9101");
  CHECK(u.path == "/metrics");
  u = Url("localhost:1/x");
  CHECK(u.host == "127.0.0.1");
  CHECK(u.path == "/x");
  CHECK(Url("127.8.9.10:80").port == 80);
  for (const auto& [url, expect] : {
           std::pair{"https://127.0.0.1:1/", "only http:// URLs are read"},
           {"http://10.0.0.1:9100/metrics", "must be a loopback address"},
           {"http://example.com:80/", "must be a loopback address"},
           {"http://127.0.0.1/metrics", "needs a port"},
           {"127.0.0.1:0", "port must be in [1, 65535]"},
           {"127.0.0.1:70000", "port must be in [1, 65535]"},
           {"127.0.0.1:80/a b", "blank or control"},
       }) {
    INFO(url);
    absl::StatusOr<HttpUrl> bad = ParseHttpUrl(url);
    REQUIRE(!bad.ok());
    CHECK(Message(bad.status()).find(std::string(url) + ": ") == 0);
    CHECK(Message(bad.status()).find(expect) != std::string::npos);
  }
}

TEST_CASE("watch: the HTTP client reads the programs' metrics responder", "[planner][watch]") {
  const std::string text = "# TYPE x gauge\nx{role=\"worker\",rank=\"0\"} 1\n";
  absl::StatusOr<std::unique_ptr<tools::MetricsHttpServer>> server =
      tools::MetricsHttpServer::Start(0, [&] { return text; });
  REQUIRE(server.ok());
  const std::string base = absl::StrCat("http://127.0.0.1:", (*server)->port());
  absl::StatusOr<std::string> body = HttpGet(Url(base + "/metrics"), absl::Seconds(10));
  REQUIRE(body.ok());
  CHECK(*body == text);
  absl::StatusOr<std::string> missing = HttpGet(Url(base + "/nothing"), absl::Seconds(10));
  REQUIRE(!missing.ok());
  CHECK(Message(missing.status()) == base + "/nothing: HTTP status 404 Not Found");
  absl::StatusOr<std::string> small = HttpGet(Url(base + "/metrics"), absl::Seconds(10), 8);
  REQUIRE(!small.ok());
  CHECK(Message(small.status()).find("answer larger than 8 bytes") != std::string::npos);
  CHECK((*server)->served() == 2);
}

TEST_CASE("watch: the HTTP client's deadline and a server that misbehaves", "[planner][watch]") {
  // Listening, never accepting: the kernel completes the connection, nobody
  // answers; the deadline ends it.
  absl::StatusOr<base::UniqueFd> silent = base::ListenTcp("127.0.0.1", 0, 4);
  REQUIRE(silent.ok());
  absl::StatusOr<uint16_t> port = base::LocalPort(silent->get());
  REQUIRE(port.ok());
  const std::string url = absl::StrCat("http://127.0.0.1:", *port, "/metrics");
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> r = HttpGet(Url(url), absl::Milliseconds(200));
  REQUIRE(!r.ok());
  CHECK(absl::IsDeadlineExceeded(r.status()));
  CHECK(Message(r.status()) == url + ": deadline passed while reading the answer");
  CHECK(absl::Now() - start < absl::Seconds(5));

  // A body cut short of its Content-Length.
  absl::StatusOr<base::UniqueFd> listener = base::ListenTcp("127.0.0.1", 0, 4);
  REQUIRE(listener.ok());
  absl::StatusOr<uint16_t> short_port = base::LocalPort(listener->get());
  REQUIRE(short_port.ok());
  std::thread peer([&] {
    absl::StatusOr<base::UniqueFd> conn =
        base::AcceptTcp(listener->get(), absl::Now() + absl::Seconds(10));
    if (!conn.ok()) return;
    char buf[1024];
    (void)::recv(conn->get(), buf, sizeof(buf), 0);
    const std::string answer = "HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\nshort";
    (void)::send(conn->get(), answer.data(), answer.size(), MSG_NOSIGNAL);
  });
  const std::string short_url = absl::StrCat("127.0.0.1:", *short_port);
  r = HttpGet(Url(short_url), absl::Seconds(10));
  peer.join();
  REQUIRE(!r.ok());
  CHECK(Message(r.status()) == short_url + ": body of 5 bytes, Content-Length 100");

  // Nothing listening any more.
  silent->Reset();
  r = HttpGet(Url(url), absl::Seconds(10));
  REQUIRE(!r.ok());
  CHECK(Message(r.status()) == url + ": connect: Connection refused");
}

TEST_CASE("watch: Prometheus text parses into samples and names a bad line", "[planner][watch]") {
  absl::StatusOr<std::vector<PromSample>> s = ParsePrometheusText(
      "# HELP a A.\n# TYPE a counter\n"
      "a{role=\"worker\",rank=\"0\",peer_role=\"server\",peer=\"1\"} 32832\n"
      "\n"
      "b_bucket{stage=\"total\",le=\"+Inf\"} 7 1700000000\n"
      "c{v=\"q\\\"uote\\\\ \\n\"} -2.5e3\n"
      "d NaN\n");
  REQUIRE(s.ok());
  REQUIRE(s->size() == 4);
  CHECK((*s)[0].name == "a");
  CHECK(*(*s)[0].Label("peer") == "1");
  CHECK((*s)[0].value == 32832);
  CHECK((*s)[0].Label("missing") == nullptr);
  CHECK(*(*s)[1].Label("le") == "+Inf");
  CHECK((*s)[1].value == 7);
  CHECK(*(*s)[2].Label("v") == "q\"uote\\ \n");
  CHECK((*s)[2].value == -2500);
  CHECK(std::isnan((*s)[3].value));
  for (const auto& [text, expect] : {
           std::pair{"ok 1\n{x=\"1\"} 2\n", "metrics line 2: expected a metric name"},
           {"a{x=1} 2", "metrics line 1: a: expected label=\"value\""},
           {"a{x=\"1} 2", "metrics line 1: a: unterminated label value"},
           {"a 1 2 3", "metrics line 1: a: expected a value (and a timestamp)"},
           {"a one", "metrics line 1: a: bad value \"one\""},
       }) {
    INFO(text);
    absl::StatusOr<std::vector<PromSample>> bad = ParsePrometheusText(text);
    REQUIRE(!bad.ok());
    CHECK(Message(bad.status()) == expect);
  }
}

// What afd_attention (stepmesh's worker series plus the example's workload
// series) and afd_ffn serve, trimmed to what the watch reads.
std::string Attention(int rank, int requests, int context_tokens, int micro_batches,
                      const std::vector<int>& servers, int lost_server = -1) {
  std::string t;
  for (int s : servers) {
    const std::string l =
        absl::StrCat("{role=\"worker\",rank=\"", rank, "\",peer_role=\"server\",peer=\"", s, "\"}");
    absl::StrAppend(&t, "stepmesh_peer_sent_bytes_total", l, " 100\n", "stepmesh_peer_losses_total",
                    l, " ", s == lost_server ? 1 : 0, "\n", "stepmesh_peer_rejoins_total", l,
                    " 0\n");
  }
  const std::string l = absl::StrCat("{role=\"worker\",rank=\"", rank, "\"}");
  absl::StrAppend(&t, "stepmesh_in_flight", l, " 0\n", "afd_workload_requests", l, " ", requests,
                  "\n", "afd_workload_context_tokens", l, " ", context_tokens, "\n",
                  "afd_workload_micro_batches", l, " ", micro_batches, "\n",
                  "afd_workload_decode_tokens_total", l, " ", 10 * requests, "\n");
  return t;
}

std::string Ffn(int rank, const std::vector<int>& workers) {
  std::string t;
  for (int w : workers) {
    absl::StrAppend(&t, "stepmesh_peer_sent_bytes_total{role=\"server\",rank=\"", rank,
                    "\",peer_role=\"worker\",peer=\"", w, "\"} 5\n");
  }
  return absl::StrCat(t, "stepmesh_in_flight{role=\"server\",rank=\"", rank, "\"} 0\n");
}

TEST_CASE("watch: a scrape becomes the mesh's shape and workload", "[planner][watch]") {
  // 2 attention instances (6 and 4 requests over 3 and 2 micro-batches), 2
  // FFN instances; only one FFN endpoint given, the workers see both.
  absl::StatusOr<MeshSample> s = SummariseScrape({
      {"a0", Attention(0, 6, 6 * 100, 3, {0, 1})},
      {"a1", Attention(1, 4, 4 * 200, 2, {0, 1})},
      {"f0", Ffn(0, {0, 1})},
  });
  REQUIRE(s.ok());
  CHECK(s->attention == 2);
  CHECK(s->ffn == 2);
  CHECK(s->requests == 10);
  CHECK(s->workload.mean_context == Approx(140));  // (600 + 800) / 10 requests
  CHECK(s->workload.batch == Approx(2));           // 10 requests / 5 micro-batches
  CHECK(s->decode_tokens == 100);
  // The FFN endpoint sees a third attention instance the URLs do not name.
  s = SummariseScrape({{"a0", Attention(0, 6, 600, 3, {0})}, {"f0", Ffn(0, {0, 1, 2})}});
  REQUIRE(s.ok());
  CHECK(s->attention == 3);
  CHECK(s->ffn == 1);
  // A server the worker counted out (a loss not followed by a rejoin) is gone.
  s = SummariseScrape({{"a0", Attention(0, 6, 600, 3, {0, 1}, /*lost_server=*/1)}});
  REQUIRE(s.ok());
  CHECK(s->ffn == 1);

  struct Bad {
    std::vector<std::pair<std::string, std::string>> scraped;
    std::string expect;
  };
  for (const Bad& b : {
           Bad{{{"f0", Ffn(0, {0})}}, "no attention (worker) endpoint among the URLs"},
           Bad{{{"http://127.0.0.1:5/metrics",
                 "stepmesh_in_flight{role=\"worker\",rank=\"0\"} 0\n"}},
               "http://127.0.0.1:5/metrics: an attention endpoint without afd_workload_* series"},
           Bad{{{"a0", Attention(0, 0, 0, 3, {0})}}, "no request in flight yet"},
           Bad{{{"a0", Attention(0, 6, 600, 0, {0})}},
               "a0: afd_workload_micro_batches = 0: must be >= 1"},
           Bad{{{"a0", Attention(0, 6, 600, 3, {})}}, "no FFN instance is known"},
           Bad{{{"a0", "up 1\n"}}, "a0: no stepmesh series with a role label"},
           Bad{{{"a0", "x{ 1\n"}}, "a0: metrics line 1"},
           Bad{{{"a0", Attention(0, 6, 600, 3, {0}) + Ffn(0, {0})}}, "a0: series of two roles"},
       }) {
    INFO(b.expect);
    absl::StatusOr<MeshSample> r = SummariseScrape(b.scraped);
    REQUIRE(!r.ok());
    CHECK(Message(r.status()).find(b.expect) != std::string::npos);
  }
}

TEST_CASE("watch: the loop is bounded and refuses an empty or unbounded watch",
          "[planner][watch]") {
  absl::StatusOr<AutoscalePlan> plan =
      ReadAutoscalePlan(STEPMESH_PLANNER_CONFIG_DIR "/watch_example.json");
  REQUIRE(plan.ok());
  WatchOptions o;
  absl::StatusOr<WatchSummary> r = RunWatch(*plan, o, stdout, stderr);
  REQUIRE(!r.ok());
  CHECK(Message(r.status()) == "--watch needs at least one URL");
  o.urls.push_back(Url("127.0.0.1:1"));
  r = RunWatch(*plan, o, stdout, stderr);
  REQUIRE(!r.ok());
  CHECK(Message(r.status()).find("--watch needs --watch-count or --watch-seconds") == 0);

  // An endpoint serving a fixed mesh, observed three times.
  const std::string text =
      Attention(0, 6, 6 * 600, 3, {0}) + "";  // context 600: the plan's best is 4A1F
  absl::StatusOr<std::unique_ptr<tools::MetricsHttpServer>> server =
      tools::MetricsHttpServer::Start(0, [&] { return text; });
  REQUIRE(server.ok());
  o.urls = {Url(absl::StrCat("127.0.0.1:", (*server)->port()))};
  o.count = 3;
  o.interval = absl::Milliseconds(20);
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  r = RunWatch(*plan, o, out, stderr);
  REQUIRE(r.ok());
  CHECK(r->observations == 3);
  CHECK(r->failures == 0);
  // confirmations 2: the second observation recommends 4A1F, the third sees
  // nothing better than what was recommended.
  CHECK(r->changes == 1);
  std::rewind(out);
  std::string printed;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), out)) > 0;) printed.append(buf, n);
  std::fclose(out);
  CHECK(printed.find("watch 2: recommend 4A1F (was 1A1F): ") != std::string::npos);
  CHECK(printed.find("watch 3 t=") != std::string::npos);
  CHECK(printed.find("watch 4") == std::string::npos);
}

}  // namespace
}  // namespace stepmesh::planner
