#include "src/rendezvous/etcd/curl_library.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace stepmesh::etcd {
namespace {

// The SONAME of libcurl's ABI since 7.16 (2006): the runtime package
// (Debian: libcurl4), not the -dev one, is what has to be installed.
constexpr char kLibrary[] = "libcurl.so.4";

}  // namespace

absl::StatusOr<std::unique_ptr<CurlLibrary>> CurlLibrary::Load() {
  std::unique_ptr<CurlLibrary> lib(new CurlLibrary());
  lib->handle_ = ::dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib->handle_ == nullptr) {
    const char* why = ::dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "the etcd rendezvous needs libcurl: cannot load ", kLibrary, " (",
        why != nullptr ? why : "unknown error", "; Debian: apt-get install libcurl4)"));
  }
  std::string missing;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib->handle_, name));
    if (fn == nullptr) absl::StrAppend(&missing, missing.empty() ? "" : ", ", name);
  };
  CURLcode (*global_init)(long) = nullptr;  // NOLINT(runtime/int): libcurl's signature
  bind(global_init, "curl_global_init");
  bind(lib->global_cleanup_, "curl_global_cleanup");
  bind(lib->easy_init, "curl_easy_init");
  bind(lib->easy_cleanup, "curl_easy_cleanup");
  bind(lib->easy_setopt, "curl_easy_setopt");
  bind(lib->easy_perform, "curl_easy_perform");
  bind(lib->easy_getinfo, "curl_easy_getinfo");
  bind(lib->easy_strerror, "curl_easy_strerror");
  bind(lib->slist_append, "curl_slist_append");
  bind(lib->slist_free_all, "curl_slist_free_all");
  bind(lib->multi_init, "curl_multi_init");
  bind(lib->multi_cleanup, "curl_multi_cleanup");
  bind(lib->multi_add_handle, "curl_multi_add_handle");
  bind(lib->multi_remove_handle, "curl_multi_remove_handle");
  bind(lib->multi_perform, "curl_multi_perform");
  bind(lib->multi_info_read, "curl_multi_info_read");
  bind(lib->multi_poll, "curl_multi_poll");
  bind(lib->multi_wakeup, "curl_multi_wakeup");
  if (!missing.empty()) {
    lib->global_cleanup_ = nullptr;  // nothing was initialised
    return absl::FailedPreconditionError(
        absl::StrCat("the etcd rendezvous needs libcurl >= 7.68: ", kLibrary, " lacks ", missing));
  }
  if (const CURLcode rc = global_init(CURL_GLOBAL_ALL); rc != CURLE_OK) {
    lib->global_cleanup_ = nullptr;
    return absl::FailedPreconditionError(
        absl::StrCat("curl_global_init failed: ", lib->easy_strerror(rc)));
  }
  return lib;
}

CurlLibrary::~CurlLibrary() {
  if (global_cleanup_ != nullptr) global_cleanup_();
  if (handle_ != nullptr) ::dlclose(handle_);
}

}  // namespace stepmesh::etcd
