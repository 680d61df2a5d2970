# polykv's own C++ (this folder) added to upstream's targets: the patches in patches/ only call it.
#
#   llama/     what the public memory API lacks (SWA cells of a share) -> llama (libllama)
#   common/    polykv's command-line options                         -> llama-common (libllama-common)
#   server/    the shared KV prefix, reserved pools, pool files      -> server-context (libllama-server-impl)
#   ggml-cpu/  shared-prefix decode attention for the CPU backend     -> ggml-cpu
#   check/     polykv-fattn-check, the ggml-level kernel check         (CMakeLists.txt, section 4b)
#
# Included by the top-level CMakeLists.txt after add_subdirectory(<llama.cpp tree>), like ollama's
# llama/compat: a rebase of the pinned tree touches the patches' call sites, never this code.
# The reference server (cmake/reference_server.cmake) is built from the pristine tree and none
# of these files.

set(POLYKV_NATIVE_DIR "${CMAKE_CURRENT_LIST_DIR}")

# Every file here is part of the build stamp (patchtool series-hash hashes native/ too), so a change
# re-runs configure and build_info.json names the exact sources.
file(GLOB_RECURSE POLYKV_NATIVE_SOURCES CONFIGURE_DEPENDS
    "${POLYKV_NATIVE_DIR}/*.cpp" "${POLYKV_NATIVE_DIR}/*.c" "${POLYKV_NATIVE_DIR}/*.h" "${POLYKV_NATIVE_DIR}/*.cmake")
set_property(DIRECTORY "${CMAKE_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${POLYKV_NATIVE_SOURCES})

function(polykv_require_target name)
    if(NOT TARGET ${name})
        message(FATAL_ERROR "polykv: upstream target '${name}' not found; the pinned tree changed its layout "
                            "(native/polykv.cmake adds polykv's sources to it)")
    endif()
endfunction()

# ------------------------------------------------------------------ llama
polykv_require_target(llama)
target_sources(llama PRIVATE
    "${POLYKV_NATIVE_DIR}/llama/polykv-memory.cpp"
    "${POLYKV_NATIVE_DIR}/llama/polykv-memory.h")

# ------------------------------------------------------------------ common
polykv_require_target(llama-common)
target_sources(llama-common PRIVATE
    "${POLYKV_NATIVE_DIR}/common/polykv-args.cpp"
    "${POLYKV_NATIVE_DIR}/common/polykv-args.h")
target_include_directories(llama-common PRIVATE "${POLYKV_NATIVE_DIR}/common")

# ------------------------------------------------------------------ server
polykv_require_target(server-context)
target_sources(server-context PRIVATE
    "${POLYKV_NATIVE_DIR}/server/server-polykv.cpp"
    "${POLYKV_NATIVE_DIR}/server/server-polykv.h"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-slots.cpp"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-slots.h"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-files.cpp"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-files.h"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-provenance.cpp"
    "${POLYKV_NATIVE_DIR}/server/server-polykv-provenance.h")
# PUBLIC: upstream's server-task.h includes server-polykv.h (which includes polykv-memory.h), and llama-server-impl
# compiles it too
target_include_directories(server-context PUBLIC "${POLYKV_NATIVE_DIR}/server" "${POLYKV_NATIVE_DIR}/llama")

# ------------------------------------------------------------------ ggml-cpu
# One CPU backend (GGML_BACKEND_DL with GGML_CPU_ALL_VARIANTS builds ggml-cpu-<variant> targets: not supported)
polykv_require_target(ggml-cpu)
target_sources(ggml-cpu PRIVATE
    "${POLYKV_NATIVE_DIR}/ggml-cpu/polykv-fattn.cpp"
    "${POLYKV_NATIVE_DIR}/ggml-cpu/polykv-fattn.h"
    "${POLYKV_NATIVE_DIR}/ggml-cpu/polykv-mm.cpp"
    "${POLYKV_NATIVE_DIR}/ggml-cpu/polykv-mm.h")
target_include_directories(ggml-cpu PRIVATE "${POLYKV_NATIVE_DIR}/ggml-cpu")
