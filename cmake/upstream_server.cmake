# The reference server: llama-server compiled from the PRISTINE tools/server sources
# (unpacked by patchtool into POLYKV_UPSTREAM_SERVER_DIR) against the same libllama,
# libllama-common and ggml as the patched one.  Mirrors tools/server/CMakeLists.txt
# of the pinned tree; the libraries are static here so nothing clashes with the
# patched server's libllama-server-impl.  The source list is explicit on purpose: files that
# the patch series adds to tools/server/ (server-polykv.cpp, .h) are not in the pristine copy
# and must not be compiled into the reference.
set(_up "${POLYKV_UPSTREAM_SERVER_DIR}")

add_library(polykv-upstream-server-context STATIC
    ${_up}/server-chat.cpp ${_up}/server-task.cpp ${_up}/server-queue.cpp
    ${_up}/server-common.cpp ${_up}/server-context.cpp ${_up}/server-stream.cpp
    ${_up}/server-tools.cpp ${_up}/server-mcp.cpp ${_up}/server-schema.cpp)
set_target_properties(polykv-upstream-server-context PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(polykv-upstream-server-context PUBLIC ${_up}
    PRIVATE "${POLYKV_LLAMA_TREE}/tools/mtmd" "${POLYKV_LLAMA_TREE}")
target_link_libraries(polykv-upstream-server-context PUBLIC llama-common mtmd ${CMAKE_THREAD_LIBS_INIT})
target_compile_features(polykv-upstream-server-context PUBLIC cxx_std_17)

add_library(polykv-upstream-server-impl STATIC
    ${_up}/server.cpp ${_up}/server-http.cpp ${_up}/server-models.cpp)
target_include_directories(polykv-upstream-server-impl PUBLIC ${_up}
    PRIVATE "${POLYKV_LLAMA_TREE}/tools/mtmd" "${POLYKV_LLAMA_TREE}")
target_link_libraries(polykv-upstream-server-impl PUBLIC polykv-upstream-server-context llama-ui cpp-httplib
    ${CMAKE_THREAD_LIBS_INIT})
add_dependencies(polykv-upstream-server-impl llama-ui-assets)

add_executable(llama-server-upstream ${_up}/main.cpp)
target_link_libraries(llama-server-upstream PRIVATE polykv-upstream-server-impl)
target_compile_features(llama-server-upstream PRIVATE cxx_std_17)
