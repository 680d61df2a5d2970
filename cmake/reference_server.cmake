# The reference server: llama-server built from the PRISTINE pinned tree (patchtool unpacks it
# unpatched into POLYKV_PRISTINE_DIR) as a separate CMake project, with its own ggml, llama and
# common compiled as static libraries into the one executable.  Nothing it loads comes from the
# patched build, so a change the patch series makes to ggml-cpu, common or libllama shows up as a
# difference in the gate's default_output check instead of changing both servers alike.
#
# Built the same way as the patched tree: every GGML_*, LLAMA_* and Vulkan_* cache option of this project
# (the CPU probe's instruction sets, backends, LLAMA_BUILD_*, the Vulkan headers and glslc), the build type, compilers, flags
# and generator are forwarded; only BUILD_SHARED_LIBS differs (OFF).  The executable is installed
# as bin/llama-server-upstream.
include(ExternalProject)

set(_ref_bin_dir "${CMAKE_CURRENT_BINARY_DIR}/reference")
set(_ref_args
    -DBUILD_SHARED_LIBS:BOOL=OFF
    "-DCMAKE_BUILD_TYPE:STRING=${CMAKE_BUILD_TYPE}"
    "-DCMAKE_C_COMPILER:FILEPATH=${CMAKE_C_COMPILER}"
    "-DCMAKE_CXX_COMPILER:FILEPATH=${CMAKE_CXX_COMPILER}"
    "-DCMAKE_MAKE_PROGRAM:FILEPATH=${CMAKE_MAKE_PROGRAM}")
foreach(_v CMAKE_C_FLAGS CMAKE_CXX_FLAGS CMAKE_EXE_LINKER_FLAGS CMAKE_C_COMPILER_LAUNCHER CMAKE_CXX_COMPILER_LAUNCHER
           CMAKE_CUDA_COMPILER CMAKE_CUDA_ARCHITECTURES CMAKE_CUDA_FLAGS)
    if(DEFINED ${_v} AND NOT "${${_v}}" STREQUAL "")
        list(APPEND _ref_args "-D${_v}=${${_v}}")
    endif()
endforeach()
get_cmake_property(_cache_vars CACHE_VARIABLES)
foreach(_v IN LISTS _cache_vars)
    # Vulkan_*: the headers, loader and glslc FindVulkan chose (or -DVulkan_INCLUDE_DIR= named), so
    # that both trees compile ggml-vulkan against the same Vulkan headers
    if(NOT _v MATCHES "^(GGML|LLAMA|Vulkan)_")
        continue()
    endif()
    get_property(_type CACHE ${_v} PROPERTY TYPE)
    if(_type STREQUAL "INTERNAL" OR _type STREQUAL "STATIC" OR "${${_v}}" MATCHES "-NOTFOUND$")
        continue()   # a tool FindVulkan did not find (glslangValidator) is left for the inner project to look for
    endif()
    string(REPLACE ";" "|" _value "${${_v}}")   # a list value stays one argument (LIST_SEPARATOR below)
    list(APPEND _ref_args "-D${_v}:${_type}=${_value}")
endforeach()

ExternalProject_Add(polykv-reference-server
    SOURCE_DIR "${POLYKV_PRISTINE_DIR}"
    BINARY_DIR "${_ref_bin_dir}"
    LIST_SEPARATOR |
    CMAKE_ARGS ${_ref_args}
    BUILD_COMMAND "${CMAKE_COMMAND}" --build "${_ref_bin_dir}" --target llama-server
    BUILD_ALWAYS ON              # the inner build decides what is out of date (a no-op takes a second)
    INSTALL_COMMAND ""
    BUILD_BYPRODUCTS "${_ref_bin_dir}/bin/llama-server"
    DEPENDS llama-server         # after the patched server: its own build's jobs never run beside the outer ones
    USES_TERMINAL_BUILD ON)
set(POLYKV_REFERENCE_SERVER "${_ref_bin_dir}/bin/llama-server")
