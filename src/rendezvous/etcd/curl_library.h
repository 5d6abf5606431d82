#pragma once
// libcurl for the etcd client, loaded (dlopen) when an etcd client is made
// rather than linked into libstepmesh. Only the etcd rendezvous speaks HTTP,
// and linking libcurl made every stepmesh process map and relocate it and
// its ~35 dependencies (TLS, Kerberos, LDAP, SSH, ...) at exec: about 4 ms
// of CPU per process start, which a 128-participant mesh pays 128 times
// (docs/benchmarks.md, "Scale"). The headers still give the types and
// constants; the functions come from the library through this table.

#include <curl/curl.h>

#include <memory>

#include "absl/status/statusor.h"

namespace stepmesh::etcd {

class CurlLibrary {
 public:
  // dlopen("libcurl.so.4") and every function below; curl_global_init.
  // FAILED_PRECONDITION naming the library (and what is missing) otherwise.
  static absl::StatusOr<std::unique_ptr<CurlLibrary>> Load();
  ~CurlLibrary();  // curl_global_cleanup, dlclose
  CurlLibrary(const CurlLibrary&) = delete;
  CurlLibrary& operator=(const CurlLibrary&) = delete;

  CURL* (*easy_init)() = nullptr;
  void (*easy_cleanup)(CURL*) = nullptr;
  CURLcode (*easy_setopt)(CURL*, CURLoption, ...) = nullptr;
  CURLcode (*easy_perform)(CURL*) = nullptr;
  CURLcode (*easy_getinfo)(CURL*, CURLINFO, ...) = nullptr;
  const char* (*easy_strerror)(CURLcode) = nullptr;
  curl_slist* (*slist_append)(curl_slist*, const char*) = nullptr;
  void (*slist_free_all)(curl_slist*) = nullptr;
  CURLM* (*multi_init)() = nullptr;
  CURLMcode (*multi_cleanup)(CURLM*) = nullptr;
  CURLMcode (*multi_add_handle)(CURLM*, CURL*) = nullptr;
  CURLMcode (*multi_remove_handle)(CURLM*, CURL*) = nullptr;
  CURLMcode (*multi_perform)(CURLM*, int*) = nullptr;
  CURLMsg* (*multi_info_read)(CURLM*, int*) = nullptr;
  CURLMcode (*multi_poll)(CURLM*, curl_waitfd[], unsigned int, int, int*) = nullptr;
  CURLMcode (*multi_wakeup)(CURLM*) = nullptr;

 private:
  CurlLibrary() = default;
  void* handle_ = nullptr;
  void (*global_cleanup_)() = nullptr;
};

}  // namespace stepmesh::etcd
