// st_reduce (mode 1, the residual add) then st_rms_pack, against
// st_reduce_rms, on the CPU emulation: h and the packed operand must be the
// same bits. Run by st_reduce_rms.sh.
#include <random>
int main() {
    int fails = 0;
    // (width, segments, rows): K3-like; past one turn of the block's quads; a
    // quad cut at the row's end; more segments than a load group (16); one
    // segment; a cut quad in the second half of a thread's pair.
    const int cfgs[6][3] = {{2048, 16, 5}, {4608, 3, 5}, {70, 9, 3}, {2048, 20, 2}, {1000, 1, 2}, {1026, 5, 2}};
    for (const auto& cfg : cfgs) {
        const int d = cfg[0], S = cfg[1], M = cfg[2];
        const int nt = (d + 15) / 16, ldp = nt * 16, mp = 16, akt = (d + 15) / 16, planes = 2;
        const hk_i64 part_seg = (hk_i64)mp * ldp, a_plane = (hk_i64)mp * akt * 16;
        std::mt19937 rng(5 + d + S);
        std::uniform_real_distribution<float> U(-1, 1);
        std::vector<float> part((size_t)S * part_seg), h0((size_t)mp * d), w(d);
        for (auto& x : part) x = U(rng);
        for (auto& x : h0) x = 3 * U(rng);
        for (auto& x : w) x = 1 + 0.2f * U(rng);
        std::vector<float> h1 = h0, h2 = h0;
        std::vector<unsigned short> a1((size_t)planes * a_plane, 0), a2 = a1;
        launch({(unsigned)((d + 1023) / 1024), (unsigned)M, 1}, 256, [&] {
            st_reduce(part.data(), part_seg, 0, ldp, M, d, S, 1, 1, h1.data(), d, 0, nullptr, 0, 1, 1, 1);
        });
        launch({(unsigned)M, 1, 1}, 256, [&] { st_rms_pack(h1.data(), w.data(), a1.data(), a_plane, planes, d, akt, 1e-6f); });
        launch({(unsigned)M, 1, 1}, 256, [&] {
            st_reduce_rms(part.data(), part_seg, ldp, d, S, h2.data(), w.data(), a2.data(), a_plane, planes, d, akt, 1e-6f);
        });
        const bool same = memcmp(h1.data(), h2.data(), h1.size() * 4) == 0 && memcmp(a1.data(), a2.data(), a1.size() * 2) == 0;
        const bool moved = memcmp(h1.data(), h0.data(), h1.size() * 4) != 0;
        printf("d=%d S=%d M=%d: %s%s\n", d, S, M, same ? "equal bits" : "DIFFERENT", moved ? "" : " (h unchanged: the test ran nothing)");
        fails += !same || !moved;
    }
    return fails;
}
