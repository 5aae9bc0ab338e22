// Work sharing for the linears' tiles (small_batch_linear.cpp, bf16_linear.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// Runs body(state, begin, end) over tiles [0, count), per_take at a time, on every thread that is
// free: each takes the next tiles from a shared counter; setup() makes a thread's state once.
// A static split (at::parallel_for's) leaves the core that finishes first spinning until the other
// catches up, at the end of each of a step's ~120 linears; on a shared VM the two cores' speeds
// differ from moment to moment, and libgomp's spinning was ~18% of a batch-16 decode step's time.
constexpr int64_t kTilesPerTake = 8;

template <typename Setup, typename Body>
void parallel_over_tiles(int64_t count, Setup&& setup, Body&& body, int64_t per_take = kTilesPerTake) {
  std::atomic<int64_t> next{0};
  const int64_t takes = (count + per_take - 1) / per_take;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), takes), 1, [&](int64_t, int64_t) {
    auto state = setup();
    for (int64_t begin = next.fetch_add(per_take); begin < count; begin = next.fetch_add(per_take))
      body(state, begin, std::min(begin + per_take, count));
  });
}

// As parallel_over_tiles, a tile at a time, where a thread takes its next tile before it starts on
// the current one: body(state, tile, next) knows the tile it will do after this one (count if
// none), so it can bring that tile's data in from memory while it computes.
template <typename Setup, typename Body>
void parallel_over_tiles_looking_ahead(int64_t count, Setup&& setup, Body&& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    auto state = setup();
    for (int64_t tile = next++; tile < count;) {
      const int64_t following = std::min(next++, count);
      body(state, tile, following);
      tile = following;
    }
  });
}

}  // namespace
