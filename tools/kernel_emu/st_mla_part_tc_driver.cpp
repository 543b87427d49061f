// Runs mla.hip's st_mla_part_tc (the fused decode step's MLA partials over
// paged 16-bit rows) on the CPU emulation and writes every chunk partial to a
// file: st_mla_part_tc.sh compares two versions of the kernel with it. The
// partials buffer starts as a pattern, so a chunk written that should not be
// (or not written that should) shows too.
//   st_mla_part_tc GRID DT OUT      (DT 1: bf16 rows, 2: f16)
#include <random>
int main(int argc, char** argv) {
    const int grid = atoi(argv[1]), dt = atoi(argv[2]);
    const int heads = 16, hg = 8, tp = 2, dcp = 2, interleave = 1, bs = 16, chunk = 64;
    const int bmax = 3, maxblk = 12, maxc = 10;  // room for longer contexts than this tick's
    const int W = MLA_TC_W, L = MLA_TC_L, tb = W * 2;
    const std::vector<int> tokens = {150, 37};   // two live requests (positions + 1)
    const int live = (int)tokens.size(), ranks = tp * dcp, nblocks = 64;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> q((size_t)bmax * heads * W);
    for (auto& x : q) x = U(rng);
    // Each rank's mla.kv region: nblocks blocks of bs rows of 576 16-bit values.
    std::vector<std::vector<unsigned short>> region(ranks, std::vector<unsigned short>((size_t)nblocks * bs * W));
    for (auto& r : region)
        for (auto& x : r) {
            const float f = U(rng);
            unsigned u; memcpy(&u, &f, 4);
            x = dt == 1 ? (unsigned short)(u >> 16) : (unsigned short)(0x3000 | (u & 0x3ff) | ((u >> 16) & 0x8000));
        }
    // The tick: live, then positions, then block tables [rank][bmax][maxblk].
    const int pos = 1, blk = pos + bmax;
    std::vector<int> tick((size_t)blk + ranks * bmax * maxblk, 0);
    tick[0] = live;
    for (int b = 0; b < live; ++b) tick[pos + b] = tokens[b] - 1;
    for (int rk = 0; rk < ranks; ++rk)
        for (int b = 0; b < bmax; ++b)
            for (int i = 0; i < maxblk; ++i) tick[blk + (rk * bmax + b) * maxblk + i] = (int)((b * 29 + i * 7 + rk * 3) % nblocks);
    unsigned long long rows[4];
    for (int rk = 0; rk < ranks; ++rk) rows[rk] = (unsigned long long)region[rk].data();
    std::vector<double> parts((size_t)bmax * heads * dcp * maxc * (L + 2), 7.25);
    launch({(unsigned)grid, (unsigned)(heads / 8), 1}, 256, [&] {
        st_mla_part_tc(q.data(), tick.data(), pos, blk, maxblk, bmax, dcp, interleave, bs, hg, rows, (hk_i64)bs * tb, tb, dt,
                       parts.data(), maxc, chunk, heads, 0.0417);
    });
    FILE* f = fopen(argv[3], "wb");
    fwrite(parts.data(), 8, parts.size(), f);
    fclose(f);
    printf("grid=%d dt=%d: parts[0..2] %g %g %g\n", grid, dt, parts[0], parts[1], parts[2]);
}
