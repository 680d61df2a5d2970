#include "polykv-args.h"

#include "common.h"

#include <algorithm>
#include <stdexcept>
#include <string>

void polykv_add_args(const common_params & params, const std::function<void(common_arg)> & add_opt) {
    add_opt(common_arg(
        {"--pool-slots"}, "N[,N...]",
        "polykv: reserve these slots as shared KV pools: they only run requests that name them with id_slot,\n"
        "and are never purged for room, saved-and-cleared as idle slots or picked by similarity/LRU\n"
        "(default: none; at least one slot must stay unreserved)",
        [](common_params & params, const std::string & value) {
            params.pool_slots.clear();
            for (const auto & item : string_split<std::string>(value, ',')) {
                size_t pos = 0;
                int id = -1;
                try {
                    id = std::stoi(item, &pos);
                } catch (const std::exception &) {
                    pos = 0;
                }
                if (item.empty() || pos != item.size() || id < 0) {
                    throw std::invalid_argument("--pool-slots: '" + item + "' is not a slot id (a non-negative integer)");
                }
                if (std::find(params.pool_slots.begin(), params.pool_slots.end(), id) != params.pool_slots.end()) {
                    throw std::invalid_argument("--pool-slots: slot " + item + " is listed twice");
                }
                params.pool_slots.push_back(id);
            }
        }
    ).set_env("LLAMA_ARG_POOL_SLOTS").set_examples({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--pool-auto"},
        {"--no-pool-auto"},
        "polykv: a request without shared_pool_slot and id_slot shares the KV of its longest common prefix with a\n"
        "--pool-slots pool of the same cache_salt, if at least --pool-auto-min-tokens tokens match (default: disabled)",
        [](common_params & params, bool value) {
            params.pool_auto = value;
        }
    ).set_env("LLAMA_ARG_POOL_AUTO").set_examples({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--pool-auto-min-tokens"}, "N",
        string_format("polykv: fewest matching prompt tokens for --pool-auto to share from a pool (default: %d)", params.pool_auto_min_tokens),
        [](common_params & params, int value) {
            if (value < 1) {
                throw std::invalid_argument("--pool-auto-min-tokens: must be at least 1");
            }
            params.pool_auto_min_tokens = value;
        }
    ).set_env("LLAMA_ARG_POOL_AUTO_MIN_TOKENS").set_examples({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--share-any"},
        {"--no-share-any"},
        "polykv: zero-config sharing (needs -kvu): a prompt takes the longest computed prefix (>= --pool-auto-min-tokens)\n"
        "that any slot of its cache_salt and LoRA set holds, waits for a slot that is computing one, and new tasks go\n"
        "to the idle slot whose cache they lose least of; idle slots stay resident (default: disabled)",
        [](common_params & params, bool value) {
            params.share_any = value;
        }
    ).set_env("LLAMA_ARG_SHARE_ANY").set_examples({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--share-any-max-wait"}, "MS",
        string_format("polykv: --share-any coalescing: a prompt waits at most this many milliseconds for another slot to compute\n"
                      "their common prefix, then computes the rest itself (default: %d)", params.share_any_max_wait_ms),
        [](common_params & params, int value) {
            if (value < 0) {
                throw std::invalid_argument("--share-any-max-wait must be >= 0");
            }
            params.share_any_max_wait_ms = value;
        }
    ).set_env("LLAMA_ARG_SHARE_ANY_MAX_WAIT").set_examples({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--shared-decode"},
        {"--no-shared-decode"},
        "polykv: CPU flash attention scores a decode batch's shared KV cells once for all its rows (the agents\n"
        "times the query heads of a KV head) instead of once per row; f16/q8_0 KV, batches of 2-511 tokens\n"
        "(default: disabled: upstream's kernel)",
        [](common_params & params, bool value) {
            params.polykv_shared_decode = value;
        }
    ).set_env("LLAMA_ARG_SHARED_DECODE").set_examples({LLAMA_EXAMPLE_SERVER}));
}
