/* Every public signature of the module, written once: the parameters of
 * each function and method, in order, with how Python passes them, their
 * defaults and their types as the stub declares them, and the field of the
 * struct the parser fills.  After a change here run tools/gen_signatures.py:
 * it writes signatures.h (the structs, the defaults their readers apply,
 * these objects' declarations and each docstring's first line) and the
 * defs of kvbm_ext/__init__.pyi.
 *
 * The generator reads this file as text: a table is `static const kv_param
 * NAME[] = {...};` of KV_PARAM and KV_VAR_PARAM rows, a signature `const
 * kv_signature kv_<name>_signature = KV_...(...);`, every argument a
 * literal; nothing else is allowed here.  See arguments.h. */
#include "signatures.h"

/* ------------------------------------------------------------ conversions */

static const kv_param BLOCK_TO_UNIVERSAL[] = {
    KV_PARAM(kv_conversion_args, blocks, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[Sequence[_Array]]"),
    KV_PARAM(kv_conversion_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "'NHD'", "str"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_block_to_universal_signature =
    KV_SIGNATURE(NULL, "block_to_universal", kv_conversion_args, BLOCK_TO_UNIVERSAL, "None");

static const kv_param UNIVERSAL_TO_BLOCK[] = {
    KV_PARAM(kv_conversion_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, blocks, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[Sequence[_Array]]"),
    KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "'NHD'", "str"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_universal_to_block_signature =
    KV_SIGNATURE(NULL, "universal_to_block", kv_conversion_args, UNIVERSAL_TO_BLOCK, "None");

static const kv_param BLOCK_TO_OPERATIONAL[] = {
    KV_PARAM(kv_conversion_args, blocks, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[Sequence[_Array]]"),
    KV_PARAM(kv_conversion_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_block_to_operational_signature =
    KV_SIGNATURE(NULL, "block_to_operational", kv_conversion_args, BLOCK_TO_OPERATIONAL, "None");

static const kv_param OPERATIONAL_TO_BLOCK[] = {
    KV_PARAM(kv_conversion_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, blocks, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[Sequence[_Array]]"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_operational_to_block_signature =
    KV_SIGNATURE(NULL, "operational_to_block", kv_conversion_args, OPERATIONAL_TO_BLOCK, "None");

static const kv_param UNIVERSAL_TO_OPERATIONAL[] = {
    KV_PARAM(kv_conversion_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "'NHD'", "str"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_universal_to_operational_signature =
    KV_SIGNATURE(NULL, "universal_to_operational", kv_conversion_args, UNIVERSAL_TO_OPERATIONAL, "None");

static const kv_param OPERATIONAL_TO_UNIVERSAL[] = {
    KV_PARAM(kv_conversion_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "'NHD'", "str"),
    KV_PARAM(kv_conversion_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_conversion_args, num_ctas, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_conversion_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_operational_to_universal_signature =
    KV_SIGNATURE(NULL, "operational_to_universal", kv_conversion_args, OPERATIONAL_TO_UNIVERSAL, "None");

/* ------------------------------------------------------------ raw copies */

static const kv_param VECTORIZED_COPY[] = {
    KV_PARAM(kv_copy_args, src_ptrs, KV_POSITIONAL, KV_REQUIRED, "_Addresses"),
    KV_PARAM(kv_copy_args, dst_ptrs, KV_POSITIONAL, KV_REQUIRED, "_Addresses"),
    KV_PARAM(kv_copy_args, sizes, KV_POSITIONAL, KV_REQUIRED, "SupportsIndex | _Addresses"),
    KV_PARAM(kv_copy_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_vectorized_copy_signature =
    KV_SIGNATURE(NULL, "vectorized_copy", kv_copy_args, VECTORIZED_COPY, "None");

static const kv_param MEMCPY_BATCH[] = {
    KV_PARAM(kv_copy_args, src_ptrs, KV_POSITIONAL, KV_REQUIRED, "_Addresses"),
    KV_PARAM(kv_copy_args, dst_ptrs, KV_POSITIONAL, KV_REQUIRED, "_Addresses"),
    KV_PARAM(kv_copy_args, sizes, KV_POSITIONAL, KV_REQUIRED, "SupportsIndex | _Addresses"),
    KV_PARAM(kv_copy_args, mode, KV_KEYWORD_ONLY, "'batched_with_fallback'",
             "Literal[\"batched_with_fallback\", \"fallback_only\", \"batch_without_fallback\"] | str"),
    KV_PARAM(kv_copy_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_memcpy_batch_signature = KV_SIGNATURE(NULL, "memcpy_batch", kv_copy_args, MEMCPY_BATCH, "None");

const kv_signature kv_is_memcpy_batch_available_signature = KV_NO_ARGUMENTS(NULL, "is_memcpy_batch_available", "bool");

/* ------------------------------------------------------------ PagedKVCache */

static const kv_param PAGED_NEW[] = {
    KV_PARAM(kv_paged_new_args, layers, KV_POSITIONAL, KV_REQUIRED,
             "Sequence[_Array] | Sequence[tuple[_Array, _Array] | list[_Array]] | _Array"),
    KV_PARAM(kv_paged_new_args, layout, KV_POSITIONAL, KV_REQUIRED, "str"),
    KV_PARAM(kv_paged_new_args, block_size, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_paged_new_args, autograd_checks, KV_KEYWORD_ONLY, "True", "bool"),
};
const kv_signature kv_paged_new_signature = KV_CONSTRUCTOR("PagedKVCache", kv_paged_new_args, PAGED_NEW);

static const kv_param TO_UNIVERSAL[] = {
    KV_PARAM(kv_paged_args, block_ids, KV_POSITIONAL_ONLY, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_paged_args, layers, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, layer_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, heads, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, head_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, pack_layers, KV_KEYWORD_ONLY, "False", "bool"),
    KV_PARAM(kv_paged_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_paged_args, num_ctas, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_paged_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_paged_to_universal_signature =
    KV_SIGNATURE("PagedKVCache", "to_universal", kv_paged_args, TO_UNIVERSAL, "None");

static const kv_param FROM_UNIVERSAL[] = {
    KV_PARAM(kv_paged_args, universals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_paged_args, block_ids, KV_POSITIONAL_ONLY, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, layers, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, layer_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, heads, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, head_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, pack_layers, KV_KEYWORD_ONLY, "False", "bool"),
    KV_PARAM(kv_paged_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_paged_args, num_ctas, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_paged_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
};
const kv_signature kv_paged_from_universal_signature =
    KV_SIGNATURE("PagedKVCache", "from_universal", kv_paged_args, FROM_UNIVERSAL, "None");

static const kv_param TO_OPERATIONAL[] = {
    KV_PARAM(kv_paged_args, block_ids, KV_POSITIONAL_ONLY, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_paged_args, layout, KV_KEYWORD_ONLY, "'NHD'", "str"),
    KV_PARAM(kv_paged_args, layers, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, pack_layers, KV_KEYWORD_ONLY, "False", "bool"),
    KV_PARAM(kv_paged_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_paged_args, num_ctas, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_paged_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
    KV_PARAM(kv_paged_args, inner, KV_KEYWORD_ONLY, "None", "str | None"),
};
const kv_signature kv_paged_to_operational_signature =
    KV_SIGNATURE("PagedKVCache", "to_operational", kv_paged_args, TO_OPERATIONAL, "None");

static const kv_param FROM_OPERATIONAL[] = {
    KV_PARAM(kv_paged_args, operationals, KV_POSITIONAL_ONLY, KV_REQUIRED, "Sequence[_Array] | _Array"),
    KV_PARAM(kv_paged_args, block_ids, KV_POSITIONAL_ONLY, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, layout, KV_KEYWORD_ONLY, "'NHD'", "str"),
    KV_PARAM(kv_paged_args, layers, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, pack_layers, KV_KEYWORD_ONLY, "False", "bool"),
    KV_PARAM(kv_paged_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_paged_args, num_ctas, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_paged_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
    KV_PARAM(kv_paged_args, inner, KV_KEYWORD_ONLY, "None", "str | None"),
};
const kv_signature kv_paged_from_operational_signature =
    KV_SIGNATURE("PagedKVCache", "from_operational", kv_paged_args, FROM_OPERATIONAL, "None");

static const kv_param TO_CACHE[] = {
    KV_PARAM(kv_paged_args, dst, KV_POSITIONAL, KV_REQUIRED, "PagedKVCache"),
    KV_PARAM(kv_paged_args, src_ids, KV_POSITIONAL, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, dst_ids, KV_POSITIONAL, KV_REQUIRED, "_BlockIds"),
    KV_PARAM(kv_paged_args, layers, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, heads, KV_KEYWORD_ONLY, "None", "SupportsIndex | slice | range | None"),
    KV_PARAM(kv_paged_args, layer_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, head_offset, KV_KEYWORD_ONLY, "0", "int"),
    KV_PARAM(kv_paged_args, pack_layers, KV_KEYWORD_ONLY, "False", "bool"),
    KV_PARAM(kv_paged_args, backend, KV_KEYWORD_ONLY, "'auto'", "_Backend | str"),
    KV_PARAM(kv_paged_args, num_ctas, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_paged_args, stream, KV_KEYWORD_ONLY, "None", "_Stream"),
    KV_PARAM(kv_paged_args, defer, KV_KEYWORD_ONLY, "False", "bool"),
};
const kv_signature kv_paged_to_cache_signature =
    KV_SIGNATURE("PagedKVCache", "to_cache", kv_paged_args, TO_CACHE, "Deferred | None");

static const kv_param DEFERRED_RESULT[] = {
    KV_PARAM(kv_deferred_args, timeout, KV_POSITIONAL, "None", "float | None"),
};
const kv_signature kv_deferred_result_signature =
    KV_SIGNATURE("Deferred", "result", kv_deferred_args, DEFERRED_RESULT, "None");
const kv_signature kv_deferred_done_signature = KV_NO_ARGUMENTS("Deferred", "done", "bool");

/* ------------------------------------------------------------ staging */

static const kv_param SET_STAGING[] = {
    KV_PARAM(kv_staging_args, size_bytes, KV_POSITIONAL, "None", "SupportsIndex | None"),
    KV_PARAM(kv_staging_args, lanes, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
};
const kv_signature kv_set_staging_signature = KV_SIGNATURE(NULL, "set_staging", kv_staging_args, SET_STAGING, "None");

static const kv_param RESERVE_STAGING[] = {
    KV_PARAM(kv_staging_args, device, KV_POSITIONAL, "None", "SupportsIndex | None"),
};
const kv_signature kv_reserve_staging_signature =
    KV_SIGNATURE(NULL, "reserve_staging", kv_staging_args, RESERVE_STAGING, "None");

static const kv_param STAGING_INFO[] = {
    KV_PARAM(kv_staging_args, device, KV_POSITIONAL, "None", "SupportsIndex | None"),
};
const kv_signature kv_staging_info_signature =
    KV_SIGNATURE(NULL, "staging_info", kv_staging_args, STAGING_INFO, "_StagingInfo");

/* ------------------------------------------------------------ build facts, checksums */

const kv_signature kv_is_using_stubs_signature = KV_NO_ARGUMENTS(NULL, "is_using_stubs", "bool");
const kv_signature kv_build_info_signature = KV_NO_ARGUMENTS(NULL, "build_info", "_BuildInfo");
const kv_signature kv_cuda_devices_signature = KV_NO_ARGUMENTS(NULL, "cuda_devices", "list[_CudaDevice]");

static const kv_param CRC32C[] = {
    KV_PARAM(kv_crc32c_args, data, KV_POSITIONAL_ONLY, KV_REQUIRED, "Any"),
    KV_PARAM(kv_crc32c_args, value, KV_POSITIONAL, "0", "SupportsIndex"),
};
const kv_signature kv_crc32c_signature = KV_SIGNATURE(NULL, "crc32c", kv_crc32c_args, CRC32C, "int");

/* ------------------------------------------------------------ host pools */

static const kv_param PINNED_EMPTY[] = {
    KV_PARAM(kv_pinned_empty_args, shape, KV_POSITIONAL, KV_REQUIRED, "SupportsIndex | Sequence[SupportsIndex]"),
    KV_PARAM(kv_pinned_empty_args, dtype, KV_POSITIONAL, KV_REQUIRED, "_DType"),
    KV_PARAM(kv_pinned_empty_args, numa_node, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_pinned_empty_args, threads, KV_KEYWORD_ONLY, "None", "SupportsIndex | None"),
    KV_PARAM(kv_pinned_empty_args, huge_pages, KV_KEYWORD_ONLY, "'transparent'", "_HugePages"),
    KV_PARAM(kv_pinned_empty_args, device, KV_KEYWORD_ONLY, "None", "SupportsIndex | str | Any | None"),
    KV_PARAM(kv_pinned_empty_args, shared, KV_KEYWORD_ONLY, "None", "str | None"),
};
const kv_signature kv_pinned_empty_signature =
    KV_SIGNATURE(NULL, "pinned_empty", kv_pinned_empty_args, PINNED_EMPTY, "HostBuffer");

static const kv_param UNLINK_SHARED[] = {
    KV_PARAM(kv_unlink_shared_args, name, KV_POSITIONAL, KV_REQUIRED, "str"),
};
const kv_signature kv_unlink_shared_signature =
    KV_SIGNATURE(NULL, "unlink_shared", kv_unlink_shared_args, UNLINK_SHARED, "bool");

static const kv_param HOST_BUFFER_DLPACK[] = {
    KV_PARAM(kv_dlpack_args, stream, KV_KEYWORD_ONLY, "None", "int | None"),
    KV_PARAM(kv_dlpack_args, max_version, KV_KEYWORD_ONLY, "None", "tuple[int, int] | None"),
    KV_PARAM(kv_dlpack_args, dl_device, KV_KEYWORD_ONLY, "None", "tuple[int, int] | None"),
    KV_PARAM(kv_dlpack_args, copy, KV_KEYWORD_ONLY, "None", "bool | None"),
};
const kv_signature kv_host_buffer_dlpack_signature =
    KV_SIGNATURE("HostBuffer", "__dlpack__", kv_dlpack_args, HOST_BUFFER_DLPACK, "Any");

const kv_signature kv_host_buffer_dlpack_device_signature =
    KV_NO_ARGUMENTS("HostBuffer", "__dlpack_device__", "tuple[int, int]");
const kv_signature kv_host_buffer_close_signature = KV_NO_ARGUMENTS("HostBuffer", "close", "None");
const kv_signature kv_host_buffer_enter_signature = KV_NO_ARGUMENTS("HostBuffer", "__enter__", "HostBuffer");

static const kv_param HOST_BUFFER_EXIT[] = {
    KV_VAR_PARAM(exc_info, "object"),
};
const kv_signature kv_host_buffer_exit_signature = KV_UNPARSED("HostBuffer", "__exit__", HOST_BUFFER_EXIT, "bool");
