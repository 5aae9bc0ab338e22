// AMX tile state for the linears (bf16_linear.cpp, int8_linear.cpp): the process's permission to use
// it, and a thread's tiles configured for a kernel's shapes, released when the thread's share of the
// work ends.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

inline bool amx_permitted() {
  // Linux hands out AMX's 8 KB of tile state per process on request (XFEATURE_XTILEDATA = 18); a
  // kernel or hypervisor that refuses it leaves the vector paths to run.
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  TileConfig& tile(int t, int tile_rows, int tile_bytes_per_row) {
    rows[t] = static_cast<uint8_t>(tile_rows), bytes_per_row[t] = static_cast<uint16_t>(tile_bytes_per_row);
    return *this;
  }
};

class AmxTiles {
 public:
  explicit AmxTiles(const TileConfig& config) { _tile_loadconfig(&config); }
  AmxTiles(const AmxTiles&) = delete;  // a copy's destructor would release the tiles under their user
  AmxTiles& operator=(const AmxTiles&) = delete;
  ~AmxTiles() { _tile_release(); }
};

}  // namespace
#endif
