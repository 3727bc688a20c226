#pragma once

// Whether this binary was compiled with a sanitizer (tools/sanitize). Its runtime
// replaces glibc's malloc (the heap policy's tests read glibc's), and the worker
// zygote stays off there.
namespace autotp::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif
#else
inline constexpr bool kSanitizedBuild = false;
#endif

}  // namespace autotp::test
