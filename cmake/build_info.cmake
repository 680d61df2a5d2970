# polykv_write_build_info(): writes the build-info record that polykv_py.native.build_info()
# reads, a JSON object built with string(JSON) from the function's arguments only:
#
#   polykv_write_build_info(
#       OUTPUT <file>                     where to write it
#       UPSTREAM_COMMIT <sha>             "upstream_commit"
#       LLAMA_CPP_SOURCE <dir>            "llama_cpp_source"
#       PATCH_SERIES_SHA256 <hex>         "patch_series_sha256"
#       PATCHES <name>...                 "patches": the patch file names, in apply order
#       BACKENDS <name>...                "backends": CPU, CUDA, ...
#       CPU_FLAGS <flag>...               "cpu_flags": ggml instruction-set options that are on
#       CPU_FLAGS_SOURCE <text>           "cpu_flags_source"
#       CMAKE_DEFINES <NAME=VALUE>...     "cmake_defines": object of strings (write ; in a value as \;)
#       BUILD_TYPE <type>                 "build_type"
#       COMPILER <text>                   "compiler"
#       SYSTEM_PROCESSOR <name>)          "system_processor"
#
# Every value is a JSON string (or an array or object of strings); a keyword left out gives "",
# [] or {}.

# "value" as a JSON string literal
function(_polykv_json_string out value)
    string(REPLACE "\\" "\\\\" value "${value}")
    string(REPLACE "\"" "\\\"" value "${value}")
    string(REPLACE "\n" "\\n" value "${value}")
    string(REPLACE "\r" "\\r" value "${value}")
    string(REPLACE "\t" "\\t" value "${value}")
    set(${out} "\"${value}\"" PARENT_SCOPE)
endfunction()

# the list ITEMS... as a JSON array of strings
function(_polykv_json_string_array out)
    set(_json "[]")
    set(_i 0)
    foreach(_item IN LISTS ARGN)
        _polykv_json_string(_s "${_item}")
        string(JSON _json SET "${_json}" ${_i} "${_s}")
        math(EXPR _i "${_i} + 1")
    endforeach()
    set(${out} "${_json}" PARENT_SCOPE)
endfunction()

function(polykv_write_build_info)
    set(_strings UPSTREAM_COMMIT LLAMA_CPP_SOURCE PATCH_SERIES_SHA256 CPU_FLAGS_SOURCE BUILD_TYPE COMPILER
                 SYSTEM_PROCESSOR)
    set(_arrays PATCHES BACKENDS CPU_FLAGS)
    cmake_parse_arguments(PARSE_ARGV 0 ARG "" "OUTPUT;${_strings}" "${_arrays};CMAKE_DEFINES")
    if(ARG_UNPARSED_ARGUMENTS)
        message(FATAL_ERROR "polykv_write_build_info: unknown arguments: ${ARG_UNPARSED_ARGUMENTS}")
    endif()
    if(NOT ARG_OUTPUT)
        message(FATAL_ERROR "polykv_write_build_info: OUTPUT <file> is required")
    endif()

    set(_json "{}")
    foreach(_key IN LISTS _strings)
        string(TOLOWER "${_key}" _name)
        _polykv_json_string(_value "${ARG_${_key}}")
        string(JSON _json SET "${_json}" "${_name}" "${_value}")
    endforeach()
    foreach(_key IN LISTS _arrays)
        string(TOLOWER "${_key}" _name)
        _polykv_json_string_array(_value ${ARG_${_key}})
        string(JSON _json SET "${_json}" "${_name}" "${_value}")
    endforeach()

    set(_defines "{}")
    foreach(_define IN LISTS ARG_CMAKE_DEFINES)
        string(FIND "${_define}" "=" _eq)
        if(_eq LESS 1)
            message(FATAL_ERROR "polykv_write_build_info: CMAKE_DEFINES takes NAME=VALUE, not '${_define}'")
        endif()
        string(SUBSTRING "${_define}" 0 ${_eq} _name)
        math(EXPR _eq "${_eq} + 1")
        string(SUBSTRING "${_define}" ${_eq} -1 _value)
        _polykv_json_string(_value "${_value}")
        string(JSON _defines SET "${_defines}" "${_name}" "${_value}")
    endforeach()
    string(JSON _json SET "${_json}" cmake_defines "${_defines}")

    file(WRITE "${ARG_OUTPUT}" "${_json}\n")
endfunction()
