// AMX tiles for bf16 products, or the same operations in plain C.
//
// Built with -mamx-tile -mamx-bf16 (build.py's "amx" variant), each macro is one AMX
// instruction. Built with -DVACPACK_EMULATE_TILES (the "emulated_tiles" variant), each runs
// as C following the instruction's definition in Intel's manual, on eight tiles of 16 rows of
// 64 bytes kept per thread: slow, but on any CPU, so that a kernel's use of the tiles (its
// layouts, strides, edges and masks) is tested on machines without AMX. The emulated dot
// product adds the same float32 products (each exact: a product of two bf16 values fits a
// float32), in an order of its own where the hardware's is not specified bit for bit, and keeps
// the denormals the instruction flushes: results move by float32 rounding only.
//
// Every tile here is configured the same: 16 rows of 64 bytes (16 float32, or 32 bf16 as 16
// pairs). TILE_DOT(c, a, b) adds to float32 tile c, for each of its rows m and columns n, the
// products of row m of a's 16 bf16 pairs with column n of b's pairs: b holds 16 rows (pairs of
// the reduced dimension), each with 16 columns of one pair (the "VNNI" layout).

#ifndef VACPACK_TILES_H
#define VACPACK_TILES_H

#include <stdint.h>
#include <string.h>

#define TILE_ROWS 16
#define TILE_BYTES_PER_ROW 64

#ifdef VACPACK_EMULATE_TILES

static __thread uint8_t emulated_tiles[8][TILE_ROWS][TILE_BYTES_PER_ROW];

static inline float tile_bf16_to_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline void emulated_load(int t, const void* base, int64_t stride_bytes) {
    for (int m = 0; m < TILE_ROWS; ++m)
        memcpy(emulated_tiles[t][m], (const uint8_t*)base + m * stride_bytes, TILE_BYTES_PER_ROW);
}

static inline void emulated_store(int t, void* base, int64_t stride_bytes) {
    for (int m = 0; m < TILE_ROWS; ++m)
        memcpy((uint8_t*)base + m * stride_bytes, emulated_tiles[t][m], TILE_BYTES_PER_ROW);
}

static inline void emulated_dot(int c, int a, int b) {
    for (int m = 0; m < TILE_ROWS; ++m) {
        float acc[16];
        memcpy(acc, emulated_tiles[c][m], sizeof(acc));
        uint16_t a_row[32];
        memcpy(a_row, emulated_tiles[a][m], sizeof(a_row));
        for (int k = 0; k < 16; ++k) {
            uint16_t b_row[32];
            memcpy(b_row, emulated_tiles[b][k], sizeof(b_row));
            for (int n = 0; n < 16; ++n) {
                acc[n] += tile_bf16_to_float(a_row[2 * k]) * tile_bf16_to_float(b_row[2 * n]);
                acc[n] += tile_bf16_to_float(a_row[2 * k + 1]) *
                          tile_bf16_to_float(b_row[2 * n + 1]);
            }
        }
        memcpy(emulated_tiles[c][m], acc, sizeof(acc));
    }
}

static inline int tiles_request_permission(void) { return 0; }
static inline void tiles_configure(void) {}
static inline void tiles_release(void) {}
#define TILE_ZERO(t) memset(emulated_tiles[t], 0, sizeof(emulated_tiles[t]))
#define TILE_LOAD(t, base, stride_bytes) emulated_load(t, base, stride_bytes)
#define TILE_STORE(t, base, stride_bytes) emulated_store(t, base, stride_bytes)
#define TILE_DOT(c, a, b) emulated_dot(c, a, b)

#else

#include <errno.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux hands a process the AMX state only when asked (once per process; its threads share
// the permission). 0 when granted, else minus the errno (ENOSPC, for one, where a thread's
// signal stack is too small for the tiles' state).
static inline int tiles_request_permission(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -errno;
}

// GCC's tile load and configuration intrinsics are asm statements that do not tell the
// compiler which memory they read (the load names none, the configuration 8 of its 64 bytes),
// so a store to a buffer that only a tile load reads afterwards may be dropped or moved past
// it. A compiler barrier before each keeps every store before it in place. (clang's are
// builtins that declare their reads.)
#if defined(__clang__)
#define TILE_MEMORY_BARRIER() ((void)0)
#else
#define TILE_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
#endif

// Palette 1, tiles 0-7 each TILE_ROWS rows of TILE_BYTES_PER_ROW bytes. Per thread: each of
// OpenMP's threads configures its own tiles.
static inline void tiles_configure(void) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = TILE_BYTES_PER_ROW;
        config.rows[t] = TILE_ROWS;
    }
    TILE_MEMORY_BARRIER();
    _tile_loadconfig(&config);
}

static inline void tiles_release(void) { _tile_release(); }
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride_bytes)   \
    do {                                   \
        TILE_MEMORY_BARRIER();             \
        _tile_loadd(t, base, stride_bytes); \
    } while (0)
#define TILE_STORE(t, base, stride_bytes) _tile_stored(t, base, stride_bytes)
#define TILE_DOT(c, a, b) _tile_dpbf16ps(c, a, b)

#endif
#endif
