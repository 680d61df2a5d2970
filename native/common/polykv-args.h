// polykv's command-line options (native/polykv.cmake adds polykv-args.cpp to llama-common): one call in
// common_params_parser_init (common/arg.cpp, patch 0073) adds them after --cache-idle-slots. The fields they set
// are common_params' (common/common.h: 0073 pool_slots, 0074 pool_auto*, 0076 polykv_shared_decode, 0077
// share_any, 0078 share_any_max_wait_ms).
#pragma once

#include "arg.h"

#include <functional>

// Adds --pool-slots, --pool-auto, --pool-auto-min-tokens, --share-any, --share-any-max-wait and --shared-decode
// (server only, each with its LLAMA_ARG_* variable) through add_opt, common_params_parser_init's own adder.
void polykv_add_args(const common_params & params, const std::function<void(common_arg)> & add_opt);
