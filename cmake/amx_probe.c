/* Does an AMX int8 tile multiply run here?  Exit 0 only if it does.
 * Mirrors ggml's AMX path: request XTILEDATA permission, load a tile config,
 * multiply two int8 tiles.  A SIGILL makes try_run report a crash -> AMX stays off. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 2;
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 3; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
    static int8_t a[16 * 64], b[16 * 64];
    static int32_t c[16 * 16];
    memset(a, 1, sizeof a);
    memset(b, 1, sizeof b);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] == 64 ? 0 : 3;
}
