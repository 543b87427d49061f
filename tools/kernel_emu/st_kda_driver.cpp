// Runs step.hip's st_kda (the fused decode step's KDA step in place) on the
// CPU emulation over random regions and writes out, the state regions and the
// ring regions to a file: st_kda.sh compares two versions of the kernel with it.
//   st_kda DK DV CAP GRID OUT
#include <random>
int main(int argc, char** argv) {
    const int dk = atoi(argv[1]), dv = atoi(argv[2]), cap = atoi(argv[3]), grid = atoi(argv[4]);
    const int heads = 4, tp = 2, hl = heads / tp, B = 5, bmax = 6, nslots = 8;
    const int nw = (dk + 15) / 16, wrec = 2 * dk + dv, C = heads * (2 * dk + dv);
    const int g_off = 3, b_off = 3 + heads * dk;  // odd offsets: the unaligned path too
    const int ldproj = b_off + heads + 1;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> U(-1, 1);
    auto vec = [&](size_t n, float s) { std::vector<float> v(n); for (auto& x : v) x = s * U(rng); return v; };
    auto cv = vec((size_t)bmax * C, 1), proj = vec((size_t)bmax * ldproj, 1.5), alog = vec(heads, 0.5), dtb = vec((size_t)heads * dk, 0.5);
    std::vector<float> out((size_t)bmax * heads * dv, 0);
    const size_t st_per = (size_t)hl * dk * dv, ring_per = (size_t)(cap > 0 ? cap : 1) * hl * wrec;
    std::vector<std::vector<float>> state(tp), ring(tp);
    std::vector<std::vector<int>> cursor(tp);
    for (int r = 0; r < tp; ++r) {
        state[r] = vec(nslots * st_per, 0.3);
        ring[r] = vec(nslots * ring_per, 0.3);
        cursor[r].resize(nslots);
        for (int s = 0; s < nslots; ++s) cursor[r][s] = cap > 0 ? (int)(rng() % cap) : 0;
        if (cap > 0) cursor[r][1] = cap - 1;  // a commit
    }
    // The tick: live count, then each request's slot on each rank.
    std::vector<int> tick = {B};
    for (int b = 0; b < B; ++b) for (int r = 0; r < tp; ++r) tick.push_back((b * 3 + r * 5 + 1) % nslots);
    unsigned long long rows3[6];
    for (int r = 0; r < tp; ++r) {
        rows3[r] = (unsigned long long)state[r].data();
        rows3[tp + r] = (unsigned long long)ring[r].data();
        rows3[2 * tp + r] = (unsigned long long)cursor[r].data();
    }
    launch({(unsigned)grid, 1, 1}, 32 * nw, [&] {
        st_kda(cv.data(), proj.data(), ldproj, g_off, b_off, alog.data(), dtb.data(), out.data(), tick.data(), 1, tp, rows3,
               (hk_i64)(st_per * 4), (hk_i64)(ring_per * 4), 4, heads, hl, dk, dv, cap);
    });
    FILE* f = fopen(argv[5], "wb");
    fwrite(out.data(), 4, out.size(), f);
    for (int r = 0; r < tp; ++r) { fwrite(state[r].data(), 4, state[r].size(), f); fwrite(ring[r].data(), 4, ring[r].size(), f); }
    fclose(f);
    printf("dk=%d dv=%d cap=%d grid=%d: out[0..3] %g %g %g\n", dk, dv, cap, grid, out[0], out[1], out[2]);
}
