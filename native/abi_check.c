/*
 * streamcoll ABI check: the C half.
 *
 * Built by tests/binding/test_abi.py (through streamcoll/_ffi/abi.py) against a
 * library's REAL installed header, as C (gcc) or C++ (g++; oneCCL's
 * oneapi/ccl/v2/types.h includes <cstddef>). It prints what the compiler
 * computes for every item cffi relies on, one "kind key value" line each;
 * the Python side compares them with cffi's values from streamcoll/_native/<lib>.h.
 *
 *   -DABI_HEADER=<nccl.h>                the real header
 *   -DABI_VERSION_MACRO=NCCL_VERSION_CODE  printed as "version header N"
 *   -DABI_ITEMS="/tmp/.../abi_items.inc" the generated statements: typedefs
 *                                        and the ABI_* macro calls below
 *
 * Type-identity checks print 1 or 0 rather than failing to compile, so a
 * wrong declaration is reported by name. Function types are taken in
 * unevaluated contexts (decltype / __typeof__): nothing is called or linked,
 * and oneCCL's CCL_C_NOT_IMPLEMENTED error attribute does not fire.
 */
#if !defined(ABI_HEADER) || !defined(ABI_ITEMS) || !defined(ABI_VERSION_MACRO)
#error "build with -DABI_HEADER=<...> -DABI_VERSION_MACRO=... -DABI_ITEMS=\"...\" (see streamcoll/_ffi/abi.py)"
#endif

#include ABI_HEADER
#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
#include <type_traits>
#define ABI_SAME(a, b) ((int)std::is_same<a, b>::value)
#define ABI_TYPEOF(x) decltype(x)
#define ABI_ALIGNOF(T) alignof(T)
#define ABI_IS_SIGNED(E) ((int)std::is_signed<std::underlying_type<E>::type>::value)
#else
#define ABI_SAME(a, b) ((int)__builtin_types_compatible_p(a, b))
#define ABI_TYPEOF(x) __typeof__(x)
#define ABI_ALIGNOF(T) _Alignof(T)
#define ABI_IS_SIGNED(E) ((int)((E)-1 < (E)0))
#endif

/* sizeof and alignment of a type. */
#define ABI_SIZE(key, T)                                                   \
    printf("size %s %lu\n", key, (unsigned long)sizeof(T));                \
    printf("align %s %lu\n", key, (unsigned long)ABI_ALIGNOF(T));
/* Whether an enum's underlying type is signed. */
#define ABI_SIGNED(key, E) printf("signed %s %d\n", key, ABI_IS_SIGNED(E));
/* An enumerator's value. */
#define ABI_ENUM(name) printf("enum %s %lld\n", #name, (long long)(name));
/* A field's offset and size (member may be a path: a.b). */
#define ABI_FIELD(key, T, member)                                          \
    printf("offset %s %lu\n", key, (unsigned long)offsetof(T, member));    \
    printf("fsize %s %lu\n", key, (unsigned long)sizeof(((T *)0)->member));
/* A field's declared type is exactly FT. */
#define ABI_FTYPE(key, T, member, FT)                                      \
    printf("ftype %s %d\n", key, ABI_SAME(ABI_TYPEOF(((T *)0)->member), FT));
/* A typedef names exactly TT. */
#define ABI_TYPEDEF(key, T, TT) printf("typedef %s %d\n", key, ABI_SAME(T, TT));
/* A function's pointer type is exactly FT (return, every parameter). */
#define ABI_FUNC(name, FT) printf("func %s %d\n", #name, ABI_SAME(ABI_TYPEOF(&name), FT));

int main(void)
{
    printf("version header %ld\n", (long)(ABI_VERSION_MACRO));
#include ABI_ITEMS
    return 0;
}
