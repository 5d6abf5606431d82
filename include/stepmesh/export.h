#pragma once
// STEPMESH_EXPORT marks the public API: libstepmesh is compiled with hidden
// visibility (-fvisibility=hidden -fvisibility-inlines-hidden), so only what
// carries this mark is in the shared library's dynamic symbol table. An
// internal class cannot become ABI by accident, and a consumer's own copy of
// a symbol never interposes on the library's. Polymorphic public classes are
// marked whole so their typeinfo and vtables are one object across the
// library and the application (dynamic_cast, exceptions, subclassing).
// Nothing changes for a consumer of the static library.

#if defined(__GNUC__) || defined(__clang__)
#define STEPMESH_EXPORT __attribute__((visibility("default")))
#else
#define STEPMESH_EXPORT
#endif
