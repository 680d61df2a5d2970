# Choose ggml's x86 instruction-set options for the default build.
#
# GGML_NATIVE=ON (-march=native) crashed with SIGILL in ggml's AMX matmul kernel on the
# machines this project builds on: the CPU advertised amx_tile/amx_int8 but the
# instruction faulted.  So on x86-64 Linux the default is GGML_NATIVE=OFF with each
# extension enabled when BOTH the CPU (/proc/cpuinfo) and the compiler support it.
# AMX stays off unless -DPOLYKV_AMX=ON (see below: it crashed on an Intel VM whose probe passed).  Any -DGGML_<FLAG>=... given by the user (for example
# `pip install . -C cmake.define.GGML_NATIVE=ON`) wins over the probe.
include(CheckCCompilerFlag)

set(POLYKV_CPU_FLAGS_SOURCE "ggml defaults" CACHE INTERNAL "")
if(NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$" OR NOT EXISTS "/proc/cpuinfo")
    message(STATUS "polykv: not x86-64 Linux; leaving ggml's CPU options at their defaults")
    return()
endif()
if(DEFINED GGML_NATIVE AND GGML_NATIVE)
    set(POLYKV_CPU_FLAGS_SOURCE "user: GGML_NATIVE=ON" CACHE INTERNAL "")
    message(WARNING "polykv: GGML_NATIVE=ON was requested; it has crashed with SIGILL (AMX) on some machines")
    return()
endif()
set(GGML_NATIVE OFF CACHE BOOL "ggml: optimize the build for the current system")

file(STRINGS "/proc/cpuinfo" _cpu_flags_line REGEX "^flags" LIMIT_COUNT 1)
string(REGEX REPLACE "^flags[ \t]*:[ \t]*" "" _cpu_flags_line "${_cpu_flags_line}")
string(REPLACE " " ";" _cpu_flags "${_cpu_flags_line}")

# ggml option | /proc/cpuinfo flags required | compiler flags required
set(_isa_table
    "SSE42|sse4_2|-msse4.2"
    "AVX|avx|-mavx"
    "AVX2|avx2|-mavx2"
    "FMA|fma|-mfma"
    "F16C|f16c|-mf16c"
    "BMI2|bmi2|-mbmi2"
    "AVX_VNNI|avx_vnni|-mavxvnni"
    "AVX512|avx512f,avx512cd,avx512vl,avx512dq,avx512bw|-mavx512f,-mavx512cd,-mavx512vl,-mavx512dq,-mavx512bw"
    "AVX512_VBMI|avx512vbmi|-mavx512vbmi"
    "AVX512_VNNI|avx512_vnni|-mavx512vnni"
    "AVX512_BF16|avx512_bf16|-mavx512bf16")

set(_chosen "")
set(_user "")
foreach(_row IN LISTS _isa_table)
    string(REPLACE "|" ";" _row "${_row}")
    list(GET _row 0 _opt)
    list(GET _row 1 _need)
    list(GET _row 2 _cflags)
    if(DEFINED GGML_${_opt})
        list(APPEND _user "${_opt}=${GGML_${_opt}}")
        continue()
    endif()
    set(_ok ON)
    string(REPLACE "," ";" _need "${_need}")
    foreach(_f IN LISTS _need)
        if(NOT _f IN_LIST _cpu_flags)
            set(_ok OFF)
        endif()
    endforeach()
    if(_ok)
        string(REPLACE "," " " _cflags "${_cflags}")
        string(MAKE_C_IDENTIFIER "POLYKV_CC_${_opt}" _var)
        check_c_compiler_flag("${_cflags}" ${_var})
        if(NOT ${_var})
            set(_ok OFF)
        endif()
    endif()
    set(GGML_${_opt} ${_ok} CACHE BOOL "ggml: enable ${_opt} (chosen by polykv's CPU probe)")
    if(_ok)
        list(APPEND _chosen ${_opt})
    endif()
endforeach()

# AMX: off unless asked for with -DPOLYKV_AMX=ON (then only if the CPU advertises it AND a probe
# that does what ggml does survives: request XTILEDATA permission, configure tiles, run one int8
# tile multiply). The probe alone is not proof: on an Intel Xeon VM (amx_tile, amx_int8 in
# /proc/cpuinfo) it exited 0, and then ggml's AMX matmul kernel died with SIGILL on `tilezero`
# in the first llama_decode (tile state lost between ggml's one-time tile configuration and its
# use). A -DGGML_AMX_TILE=... given by the user still wins.
option(POLYKV_AMX "Let ggml use AMX when the CPU has it and the probe runs (it crashed on some VMs)" OFF)
get_property(_amx_help CACHE GGML_AMX_TILE PROPERTY HELPSTRING)
set(_amx_ours OFF)
if(NOT DEFINED GGML_AMX_TILE OR _amx_help MATCHES "polykv")
    set(_amx_ours ON)
endif()
set(_amx_ok OFF)
if(_amx_ours AND POLYKV_AMX AND "amx_tile" IN_LIST _cpu_flags AND "amx_int8" IN_LIST _cpu_flags)
    try_run(_amx_run _amx_compile
        SOURCES "${CMAKE_CURRENT_LIST_DIR}/amx_probe.c"
        COMPILE_DEFINITIONS -mamx-tile -mamx-int8
        RUN_OUTPUT_VARIABLE _amx_out)
    if(_amx_compile AND "${_amx_run}" STREQUAL "0")
        set(_amx_ok ON)
    endif()
    message(STATUS "polykv: AMX probe compiled=${_amx_compile} exit=${_amx_run} -> AMX ${_amx_ok}")
endif()
if(_amx_ours)
    set(GGML_AMX_TILE ${_amx_ok} CACHE BOOL "ggml: enable AMX-TILE (polykv: POLYKV_AMX and probe)" FORCE)
    set(GGML_AMX_INT8 ${_amx_ok} CACHE BOOL "ggml: enable AMX-INT8 (polykv: POLYKV_AMX and probe)" FORCE)
    if(_amx_ok)
        list(APPEND _chosen AMX_TILE AMX_INT8)
    endif()
endif()

list(JOIN _chosen " " _chosen_s)
list(JOIN _user " " _user_s)
set(POLYKV_CPU_FLAGS_SOURCE "probe: cpu+compiler (${_chosen_s})${_user_s}" CACHE INTERNAL "")
if(_user_s)
    set(POLYKV_CPU_FLAGS_SOURCE "probe: cpu+compiler (${_chosen_s}); user: ${_user_s}" CACHE INTERNAL "")
endif()
message(STATUS "polykv: CPU flags ${POLYKV_CPU_FLAGS_SOURCE}")
