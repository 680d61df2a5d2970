# Writes the build-info record that polykv_py.native.build_info() reads.
function(polykv_write_build_info out)
    set(_flags "")
    foreach(_f SSE42 AVX AVX2 FMA F16C BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 AMX_BF16)
        if(GGML_${_f})
            list(APPEND _flags "\"${_f}\"")
        endif()
    endforeach()
    if(GGML_NATIVE)
        list(APPEND _flags "\"NATIVE\"")
    endif()
    list(JOIN _flags ", " _flags_json)
    set(_b "")
    foreach(_x IN LISTS POLYKV_BACKENDS)
        list(APPEND _b "\"${_x}\"")
    endforeach()
    list(JOIN _b ", " _backends_json)
    set(_p "")
    foreach(_x IN LISTS _patch_names)
        list(APPEND _p "\"${_x}\"")
    endforeach()
    list(JOIN _p ", " _patches_json)
    set(_defs "")
    foreach(_v GGML_NATIVE GGML_CUDA GGML_VULKAN GGML_HIP GGML_METAL CMAKE_CUDA_ARCHITECTURES)
        if(DEFINED ${_v})
            list(APPEND _defs "\"${_v}\": \"${${_v}}\"")
        endif()
    endforeach()
    list(JOIN _defs ", " _defs_json)
    file(WRITE "${out}" "{
  \"upstream_commit\": \"${POLYKV_UPSTREAM_COMMIT}\",
  \"llama_cpp_source\": \"${POLYKV_LLAMA_TREE}\",
  \"patch_series_sha256\": \"${POLYKV_PATCH_SERIES_SHA256}\",
  \"patches\": [${_patches_json}],
  \"backends\": [${_backends_json}],
  \"cpu_flags\": [${_flags_json}],
  \"cpu_flags_source\": \"${POLYKV_CPU_FLAGS_SOURCE}\",
  \"cmake_defines\": {${_defs_json}},
  \"build_type\": \"${CMAKE_BUILD_TYPE}\",
  \"compiler\": \"${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}\",
  \"system_processor\": \"${CMAKE_SYSTEM_PROCESSOR}\"
}
")
endfunction()
